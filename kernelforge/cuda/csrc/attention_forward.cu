// Flash attention forward: the host launcher (see attention_cuda.h for the contract,
// attention_kernel.cuh for the kernel and the tile per head dim).
//
// Work and traffic of a call (E = 2 bytes per element, Hkv = kv_heads):
//   FLOPs: 4 * B * H * Sq * Sk * D for dense attention (two matmuls of 2 * Sq * Sk * D);
//     over visible keys only: causal with Sq == Sk about half of it (2 * B * H * Sq * (Sq + 1)
//     * D; the diagonal tiles are computed whole, ~BM / (2 * Sq) more), a window about
//     4 * B * H * Sq * (left + right + 1) * D. Key tiles no row of a CTA sees are skipped.
//   DRAM bytes (the floor): read Q and write O, B * H * Sq * D * E each; read K and V,
//     B * Hkv * Sk * D * E each; write lse, 4 * B * H * Sq. K and V are re-read from L2 by
//     each of the ceil(Sq / BM) CTAs of a head (the grid runs a head's CTAs and the G q heads
//     of a kv head next to each other), so L2 -> SM traffic is ~2 * B * H * ceil(Sq / BM) *
//     Sk * D * E: with BM = 128, 128 FLOPs per byte, ~2.6 TB/s of L2 bandwidth at 330 TFLOP/s.
//   Shared memory -> registers: each warp reads every K and V tile once per key tile, so
//     32 query rows per warp (D <= 128) give 32 FLOPs per ldmatrix byte (~45% of an H100
//     SM's 128 B / clock at 330 TFLOP/s); 16 rows per warp (D = 256, where O leaves no
//     registers for more) need ~80%.
//   Compute bound beyond a few hundred keys: per score 4 * D tensor FLOPs against ~5 fp32
//   ops (max, FFMA, sum, half a conversion, O rescale share) and one ex2 (16 per clock per
//   SM), so the softmax share of the work doubles at D = 64 and again at D = 32, which run
//   below the D = 128 rate.
#include "attention_cuda.h"

#include "attention_kernel.cuh"
#include "smem_opt_in.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kernelforge {
namespace cuda_attention {
namespace {

using attention::TileFor;

template <typename Tile>
cudaError_t launch(const AttentionForwardArgs& a, cudaStream_t stream) {
  const auto kernel = attention::flash_fwd_kernel<Tile>;
  const cudaError_t opt_in = kernelforge::opt_in_shared_memory<attention::flash_fwd_kernel<Tile>, Tile::kSmemBytes>();
  if (opt_in != cudaSuccess) return opt_in;
  // x: query tiles (reversed in the kernel), y: heads, z: batch.
  const dim3 grid(static_cast<unsigned>((a.q_len + Tile::kBM - 1) / Tile::kBM), static_cast<unsigned>(a.heads),
                  static_cast<unsigned>(a.batch));
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(attention::make_fwd_params(a));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_for_dim(const AttentionForwardArgs& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 32: return launch<typename TileFor<T, 32>::type>(a, stream);
    case 64: return launch<typename TileFor<T, 64>::type>(a, stream);
    case 96: return launch<typename TileFor<T, 96>::type>(a, stream);
    case 128: return launch<typename TileFor<T, 128>::type>(a, stream);
    case 256: return launch<typename TileFor<T, 256>::type>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

int forward_smem_bytes(int64_t head_dim) {
  switch (head_dim) {  // the same for float16 and bfloat16
    case 32: return TileFor<__half, 32>::type::kSmemBytes;
    case 64: return TileFor<__half, 64>::type::kSmemBytes;
    case 96: return TileFor<__half, 96>::type::kSmemBytes;
    case 128: return TileFor<__half, 128>::type::kSmemBytes;
    case 256: return TileFor<__half, 256>::type::kSmemBytes;
    default: return 0;
  }
}

cudaError_t attention_forward(const AttentionForwardArgs& args, cudaStream_t stream) {
  if (!attention::args_valid(args)) return cudaErrorInvalidValue;
  if (args.batch == 0 || args.heads == 0 || args.q_len == 0) return cudaSuccess;
  return args.dtype == DType::kFloat16 ? launch_for_dim<__half>(args, stream)
                                       : launch_for_dim<__nv_bfloat16>(args, stream);
}

}  // namespace cuda_attention
}  // namespace kernelforge
