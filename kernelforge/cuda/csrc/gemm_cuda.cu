// GEMM with a fused epilogue: the host launcher (see gemm_cuda.h for the contract,
// gemm_kernel.cuh for the kernel and the tiles).
//
// Work and traffic of a call (E = 2 bytes per operand element, O = bytes per output element):
//   FLOPs: 2 * batch * M * N * K on the tensor cores (mma.sync m16n8k16, fp32 accumulation),
//     plus ~10-30 fp32 operations per output in the epilogue (erff / tanhf / expf).
//   DRAM bytes (the floor): read a and b once, batch * (M * K + K * N) * E; write out (and
//     preact), batch * M * N * O each; read residual and bias once. Each CTA reads a BM-row
//     panel of a and a BN-column panel of b, K deep: (BM + BN) * K * E bytes for 2 * BM * BN * K
//     FLOPs, 64 FLOPs per byte from L2 with the 128 x 128 tile. A panel is re-read by each of
//     the ceil(N / BN) CTAs of its tile row; the grouped order runs kGroupM = 8 tile rows
//     together, so a b panel is fetched from DRAM about once per 8 tile rows and an a panel
//     stays in L2 while its group walks the columns: DRAM traffic stays near the floor while
//     the group's panels (8 * 128 + 128) * K * E bytes, 9.4 MB at K = 4096, fit the 50 MB L2.
//   Arithmetic intensity of the floor at M = N = K = 4096 (fp16 out): 1365 FLOPs per byte,
//     far above the ~300 at which an H100 turns compute bound: large GEMMs are limited by
//     the mma.sync issue rate and shared-memory bandwidth (ldmatrix), small ones by the
//     number of CTAs (132 SMs x 2 CTAs want >= 264 tiles of 128 x 128, M * N >= 4.3e6).
//   Shared memory -> registers: 6 ldmatrix.x4 (3 KB) per 16 mma (65536 FLOPs) per warp,
//     21 FLOPs per byte, so ~50 of the 128 bytes per clock an SM reads are needed at
//     ~1000 dense FLOPs per clock per SM (mma.sync's practical rate on sm_90).
//   Registers and occupancy: see TileFor; 2 CTAs (16 warps) per SM hide the ldmatrix and
//   cp.async latency, 3 slices (96 k's) of loads in flight per CTA hide DRAM / L2 latency.
// Not used: wgmma / TMA (sm_90 only; the Triton backend has them), split-K (small M * N with
// large K runs few CTAs), stream-K.
#include "gemm_cuda.h"

#include "gemm_kernel.cuh"
#include "smem_opt_in.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kernelforge {
namespace cuda_gemm {
namespace {

using gemm::GemmParams;
using gemm::TileFor;

constexpr int64_t kMaxRows = int64_t{1} << 30;      // rows per launch (int arithmetic in the kernel)
constexpr int64_t kMaxCtas = (int64_t{1} << 31) - 1;  // gridDim.x

template <typename Tile>
cudaError_t launch(const GemmArgs& a, cudaStream_t stream) {
  const auto kernel = gemm::gemm_kernel<Tile>;
  const cudaError_t opt_in = kernelforge::opt_in_shared_memory<gemm::gemm_kernel<Tile>, Tile::kSmemBytes>();
  if (opt_in != cudaSuccess) return opt_in;
  cudaError_t err = cudaSuccess;
  gemm::for_each_launch<Tile>(a, kMaxRows, kMaxCtas, [&](const GemmParams& p, int64_t ctas) {
    if (err != cudaSuccess) return;
    kernel<<<static_cast<unsigned>(ctas), Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
    err = cudaGetLastError();
  });
  return err;
}

template <typename T, int WARPS>
cudaError_t launch_for_layout(const GemmArgs& a, cudaStream_t stream) {
  if (a.a_k_major) {
    return a.b_k_major ? launch<typename TileFor<T, true, true, WARPS>::type>(a, stream)
                       : launch<typename TileFor<T, true, false, WARPS>::type>(a, stream);
  }
  return a.b_k_major ? launch<typename TileFor<T, false, true, WARPS>::type>(a, stream)
                     : launch<typename TileFor<T, false, false, WARPS>::type>(a, stream);
}

template <typename T>
cudaError_t launch_for_warps(const GemmArgs& a, cudaStream_t stream) {
  return a.warps == 4 ? launch_for_layout<T, 4>(a, stream) : launch_for_layout<T, 8>(a, stream);
}

template <int WARPS>
int smem_bytes(bool a_k_major, bool b_k_major) {
  if (a_k_major) {
    return b_k_major ? TileFor<__half, true, true, WARPS>::type::kSmemBytes
                     : TileFor<__half, true, false, WARPS>::type::kSmemBytes;
  }
  return b_k_major ? TileFor<__half, false, true, WARPS>::type::kSmemBytes
                   : TileFor<__half, false, false, WARPS>::type::kSmemBytes;
}

}  // namespace

int gemm_smem_bytes(int warps, bool a_k_major, bool b_k_major) {
  switch (warps) {  // the same for float16 and bfloat16
    case 4: return smem_bytes<4>(a_k_major, b_k_major);
    case 8: return smem_bytes<8>(a_k_major, b_k_major);
    default: return 0;
  }
}

cudaError_t gemm_forward(const GemmArgs& args, cudaStream_t stream) {
  if (!gemm::args_valid(args)) return cudaErrorInvalidValue;
  if (args.batch == 0 || args.M == 0 || args.N == 0) return cudaSuccess;
  return args.dtype == DType::kFloat16 ? launch_for_warps<__half>(args, stream)
                                       : launch_for_warps<__nv_bfloat16>(args, stream);
}

}  // namespace cuda_gemm
}  // namespace kernelforge
