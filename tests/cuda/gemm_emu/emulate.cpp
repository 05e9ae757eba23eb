// Runs the GEMM kernel of gemm_kernel.cuh on the CPU through the emulated attention_mma.cuh
// of tests/cuda/attention_emu (every CUDA thread a fiber; mma, ldmatrix and cp.async with
// their PTX semantics; races of ldmatrix against cp.async in flight, cp.async reads outside
// the inputs, divergent collectives and deadlocks are reported). Built by
// tests/cuda/test_gemm_cuda.py with g++ against a copy of csrc/ in which the emulated
// attention_mma.cuh replaces the real one.
//
//   emulate <input> <output> <eager|lazy> <rr|low|high>
//   emulate --smem      (prints "warps a_k_major b_k_major bytes" per tile)
// input: 40 little-endian int64: batch, M, N, K, dtype code (1 float16, 2 bfloat16);
//   a: k_major, element offset, batch stride, ld, buffer length (elements);
//   b: k_major, offset, batch stride, ld, length;
//   bias: present, dtype code (0 float32, 1 float16, 2 bfloat16), offset, stride, length;
//   residual: present, dtype code, offset, batch / row / col strides, length;
//   out dtype code, activation (0 none, 1 gelu, 2 gelu_tanh, 3 silu, 4 relu), save_preact,
//   warps, max rows and max CTAs per launch (0: the launcher's), then zeros;
// then the a, b, bias and residual buffers.
// output: out, then preact when asked for (dense (batch, M, N) of the out dtype). Exit
// status 3 with a message on stderr when a check fails.
#include "gemm_kernel.cuh"
#include "emu_driver.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace kg = kernelforge::gemm;
using kernelforge::DType;
using kernelforge::cuda_gemm::Activation;
using kernelforge::cuda_gemm::GemmArgs;

namespace {

template <typename Tile>
void run(const GemmArgs& a, int64_t max_rows, int64_t max_ctas) {
  kg::for_each_launch<Tile>(a, max_rows, max_ctas, [](const kg::GemmParams& p, int64_t ctas) {
    kf_emu::run_grid(kf_emu::Dim3{static_cast<unsigned>(ctas), 1, 1}, Tile::kThreads, Tile::kSmemBytes,
                     [p] { kg::gemm_kernel<Tile>(p); });
  });
}

template <typename T, int WARPS>
void run_for_layout(const GemmArgs& a, int64_t max_rows, int64_t max_ctas) {
  if (a.a_k_major) {
    if (a.b_k_major) run<typename kg::TileFor<T, true, true, WARPS>::type>(a, max_rows, max_ctas);
    else run<typename kg::TileFor<T, true, false, WARPS>::type>(a, max_rows, max_ctas);
  } else {
    if (a.b_k_major) run<typename kg::TileFor<T, false, true, WARPS>::type>(a, max_rows, max_ctas);
    else run<typename kg::TileFor<T, false, false, WARPS>::type>(a, max_rows, max_ctas);
  }
}

using kf_emu_driver::Buffer;

size_t element_bytes(int64_t code) { return code == 0 ? 4 : 2; }

template <int WARPS>
void print_smem() {
  for (int ak = 0; ak < 2; ++ak)
    for (int bk = 0; bk < 2; ++bk)
      std::printf("%d %d %d %d\n", WARPS, ak, bk, kernelforge::cuda_gemm::gemm_smem_bytes(WARPS, ak, bk));
}

}  // namespace

// The launcher's table, without linking gemm_cuda.cu (which launches with <<<>>>).
template <int WARPS>
int smem_for(bool a_k_major, bool b_k_major) {
  if (a_k_major) {
    return b_k_major ? kg::TileFor<__half, true, true, WARPS>::type::kSmemBytes
                     : kg::TileFor<__half, true, false, WARPS>::type::kSmemBytes;
  }
  return b_k_major ? kg::TileFor<__half, false, true, WARPS>::type::kSmemBytes
                   : kg::TileFor<__half, false, false, WARPS>::type::kSmemBytes;
}

int kernelforge::cuda_gemm::gemm_smem_bytes(int warps, bool a_k_major, bool b_k_major) {
  return warps == 8 ? smem_for<8>(a_k_major, b_k_major) : warps == 4 ? smem_for<4>(a_k_major, b_k_major) : 0;
}

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--smem") {
    print_smem<4>();
    print_smem<8>();
    return 0;
  }
  std::FILE* in = kf_emu_driver::open_input(argc, argv);
  if (!in) return 2;
  kf_emu::State& s = kf_emu::st();
  int64_t h[40];
  if (std::fread(h, 8, 40, in) != 40) return 2;
  // Buffers: a, b, bias, residual (a missing one is empty).
  const int64_t lengths[4] = {h[9], h[14], h[15] ? h[19] : 0, h[20] ? h[26] : 0};
  const size_t elem[4] = {2, 2, element_bytes(h[16]), element_bytes(h[21])};
  Buffer buf[4];
  for (int t = 0; t < 4; ++t) {
    buf[t].allocate(static_cast<size_t>(lengths[t]) * elem[t], 0xEE);
    if (std::fread(buf[t].data(), elem[t], lengths[t], in) != static_cast<size_t>(lengths[t])) return 2;
    // cp.async may read whole 16-byte chunks of a and b only.
    if (t < 2) s.readable.push_back({buf[t].data(), buf[t].size});
  }
  std::fclose(in);

  GemmArgs a;
  a.batch = h[0], a.M = h[1], a.N = h[2], a.K = h[3];
  a.dtype = static_cast<DType>(h[4]);
  a.a = buf[0].data() + 2 * h[6], a.a_k_major = h[5] != 0, a.a_batch_stride = h[7], a.a_ld = h[8];
  a.b = buf[1].data() + 2 * h[11], a.b_k_major = h[10] != 0, a.b_batch_stride = h[12], a.b_ld = h[13];
  if (h[15]) {
    a.bias = buf[2].data() + elem[2] * h[17], a.bias_dtype = static_cast<DType>(h[16]), a.bias_stride = h[18];
  }
  if (h[20]) {
    a.residual = buf[3].data() + elem[3] * h[22], a.residual_dtype = static_cast<DType>(h[21]);
    a.residual_batch_stride = h[23], a.residual_row_stride = h[24], a.residual_col_stride = h[25];
  }
  a.out_dtype = static_cast<DType>(h[27]);
  a.activation = static_cast<Activation>(h[28]);
  const bool save_preact = h[29] != 0;
  a.warps = static_cast<int>(h[30]);
  const int64_t max_rows = h[31] ? h[31] : int64_t{1} << 30, max_ctas = h[32] ? h[32] : (int64_t{1} << 31) - 1;

  const size_t out_bytes = static_cast<size_t>(a.batch * a.M * a.N) * element_bytes(h[27]);
  Buffer out, preact;
  out.allocate(out_bytes, 0xFF);  // NaN: elements never written show
  preact.allocate(out_bytes, 0xFF);
  a.out = out.data();
  a.preact = save_preact ? preact.data() : nullptr;
  if (!kg::args_valid(a)) kf_emu::fail("args_valid rejects the arguments");

  if (a.batch > 0 && a.M > 0 && a.N > 0) {
    if (a.dtype == DType::kFloat16) {
      if (a.warps == 4) run_for_layout<__half, 4>(a, max_rows, max_ctas);
      else run_for_layout<__half, 8>(a, max_rows, max_ctas);
    } else {
      if (a.warps == 4) run_for_layout<__nv_bfloat16, 4>(a, max_rows, max_ctas);
      else run_for_layout<__nv_bfloat16, 8>(a, max_rows, max_ctas);
    }
  }

  if (!out.guard_intact(0xFF) || !preact.guard_intact(0xFF)) kf_emu::fail("write past the end of out or preact");
  std::FILE* o = std::fopen(argv[2], "wb");
  if (!o) return 2;
  std::fwrite(out.data(), 1, out.size, o);
  if (save_preact) std::fwrite(preact.data(), 1, preact.size, o);
  std::fclose(o);
  return 0;
}
