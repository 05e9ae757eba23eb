// Runs the flash-attention forward kernel of attention_kernel.cuh on the CPU through the
// emulated attention_mma.cuh next to this file (see there). Built by
// tests/cuda/test_attention_cuda.py with g++ against a copy of csrc/ in which this
// directory's attention_mma.cuh replaces the real one.
//
//   emulate <input> <output> <eager|lazy> <rr|low|high>
//   emulate --smem      (prints the shared memory per block of each head dim's tile)
// input: 32 little-endian int64 (batch, heads, kv_heads, q_len, kv_len, head_dim, dtype code
// (1 float16, 2 bfloat16), causal, window_left, window_right, then for q, k and v: element
// offset into its buffer, batch, head and row strides, buffer length in elements), one
// float64 scale, then the q, k and v buffers (2 bytes per element).
// output: out (batch, heads, q_len, head_dim) as 2-byte elements, then lse (batch, heads,
// q_len) as float32. Exit status 3 with a message on stderr when a check fails.
#include "attention_kernel.cuh"
#include "emu_driver.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace ka = kernelforge::attention;
using kernelforge::cuda_attention::AttentionForwardArgs;

namespace {

template <typename Tile>
void run(const AttentionForwardArgs& a) {
  const ka::FwdParams p = ka::make_fwd_params(a);
  const kf_emu::Dim3 grid{static_cast<unsigned>((a.q_len + Tile::kBM - 1) / Tile::kBM),
                          static_cast<unsigned>(a.heads), static_cast<unsigned>(a.batch)};
  kf_emu::run_grid(grid, Tile::kThreads, Tile::kSmemBytes, [p] { ka::flash_fwd_kernel<Tile>(p); });
}

template <typename T>
void run_for_dim(const AttentionForwardArgs& a) {
  switch (a.head_dim) {
    case 32: return run<typename ka::TileFor<T, 32>::type>(a);
    case 64: return run<typename ka::TileFor<T, 64>::type>(a);
    case 96: return run<typename ka::TileFor<T, 96>::type>(a);
    case 128: return run<typename ka::TileFor<T, 128>::type>(a);
    case 256: return run<typename ka::TileFor<T, 256>::type>(a);
    default: kf_emu::fail("head_dim %lld not supported", static_cast<long long>(a.head_dim));
  }
}

using kf_emu_driver::Buffer;

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--smem") {  // "head_dim bytes" per line, as TileFor has them
    std::printf("32 %d\n64 %d\n96 %d\n128 %d\n256 %d\n", ka::TileFor<__half, 32>::type::kSmemBytes,
                ka::TileFor<__half, 64>::type::kSmemBytes, ka::TileFor<__half, 96>::type::kSmemBytes,
                ka::TileFor<__half, 128>::type::kSmemBytes, ka::TileFor<__half, 256>::type::kSmemBytes);
    return 0;
  }
  std::FILE* in = kf_emu_driver::open_input(argc, argv);
  if (!in) return 2;
  kf_emu::State& s = kf_emu::st();
  int64_t h[32];
  double scale;
  if (std::fread(h, 8, 32, in) != 32 || std::fread(&scale, 8, 1, in) != 1) return 2;
  Buffer buf[3];
  for (int t = 0; t < 3; ++t) {
    const int64_t n = h[10 + 5 * t + 4];
    buf[t].allocate(static_cast<size_t>(n) * 2, 0xEE);
    if (std::fread(buf[t].data(), 2, n, in) != static_cast<size_t>(n)) return 2;
    s.readable.push_back({buf[t].data(), buf[t].size});
  }
  std::fclose(in);

  AttentionForwardArgs a;
  a.batch = h[0], a.heads = h[1], a.kv_heads = h[2], a.q_len = h[3], a.kv_len = h[4], a.head_dim = h[5];
  a.dtype = h[6] == 1 ? kernelforge::DType::kFloat16 : kernelforge::DType::kBFloat16;
  a.causal = h[7] != 0, a.window_left = h[8], a.window_right = h[9];
  a.scale = static_cast<float>(scale);
  const void* ptr[3];
  int64_t* strides[3][3] = {{&a.q_batch_stride, &a.q_head_stride, &a.q_row_stride},
                            {&a.k_batch_stride, &a.k_head_stride, &a.k_row_stride},
                            {&a.v_batch_stride, &a.v_head_stride, &a.v_row_stride}};
  for (int t = 0; t < 3; ++t) {
    ptr[t] = buf[t].data() + 2 * h[10 + 5 * t];
    for (int d = 0; d < 3; ++d) *strides[t][d] = h[10 + 5 * t + 1 + d];
  }
  a.q = ptr[0], a.k = ptr[1], a.v = ptr[2];
  const size_t rows = static_cast<size_t>(a.batch * a.heads * a.q_len);
  Buffer out, lse;
  out.allocate(rows * a.head_dim * 2, 0xFF);  // NaN: rows never written show
  lse.allocate(rows * 4, 0xFF);
  a.out = out.data(), a.lse = reinterpret_cast<float*>(lse.data());
  if (!ka::args_valid(a)) kf_emu::fail("args_valid rejects the arguments");

  if (a.dtype == kernelforge::DType::kFloat16) run_for_dim<__half>(a);
  else run_for_dim<__nv_bfloat16>(a);

  if (!out.guard_intact(0xFF) || !lse.guard_intact(0xFF)) kf_emu::fail("write past the end of out or lse");
  std::FILE* o = std::fopen(argv[2], "wb");
  if (!o) return 2;
  std::fwrite(out.data(), 1, out.size, o);
  std::fwrite(lse.data(), 1, lse.size, o);
  std::fclose(o);
  return 0;
}
