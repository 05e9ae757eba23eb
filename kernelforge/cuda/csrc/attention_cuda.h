// Flash attention forward (FlashAttention-2 scheme on mma.sync tensor cores): plain CUDA,
// no torch headers.
//
//   out[b, h, i, :] = sum_j softmax_j(scale * q[b, h, i, :] . k[b, h / G, j, :]) v[b, h / G, j, :]
//   lse[b, h, i]    = log sum_j exp(scale * q[b, h, i, :] . k[b, h / G, j, :])     (natural log)
// over the keys j visible to query i, G = heads / kv_heads (grouped-query attention). With
// off = kv_len - q_len (causal aligned to the bottom right, as FlashAttention-2), key j is
// visible to query i iff (!causal || j <= i + off) && (window_left < 0 || j >= i + off -
// window_left) && (window_right < 0 || j <= i + off + window_right). A row with no visible
// key gets out = 0 and lse = -inf.
//
// Layout: q is (batch, heads, q_len, head_dim), k and v are (batch, kv_heads, kv_len,
// head_dim), each with any batch / head / row strides (elements) and a contiguous last dim;
// every pointer must be 16-byte aligned and every stride a multiple of 8 elements (16 bytes;
// a dim of size 1 may pass stride 0). out is dense (batch, heads, q_len, head_dim) in the
// inputs' dtype, lse dense (batch, heads, q_len) float32; neither may overlap the inputs.
// dtype: float16 or bfloat16 for all of q, k, v, out; fp32 accumulation and softmax.
// head_dim: 32, 64, 96, 128 or 256. Needs sm_80 or newer (mma.sync, cp.async) and
// forward_smem_bytes(head_dim) of shared memory per block (opt-in); tuned for sm_90.
// attention_forward launches asynchronously on `stream` and returns cudaGetLastError()
// after the launch: cudaSuccess without launching when batch, heads or q_len is 0;
// cudaErrorInvalidValue for anything outside the above (sizes, strides, alignment, dtype,
// head_dim, kv_heads not dividing heads, batch or heads > kMaxGridDim, lengths > kMaxSeqLen,
// a scale that is negative or not finite).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "dtype.h"

namespace kernelforge {
namespace cuda_attention {

constexpr int64_t kMaxSeqLen = int64_t{1} << 29;  // positions (and sums of them) are int in the kernel
constexpr int64_t kMaxGridDim = 65535;            // batch and heads are grid dims z and y

struct AttentionForwardArgs {
  const void* q = nullptr;
  int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0;
  const void* k = nullptr;
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0;
  const void* v = nullptr;
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;
  void* out = nullptr;   // dense (batch, heads, q_len, head_dim)
  float* lse = nullptr;  // dense (batch, heads, q_len)
  int64_t batch = 0, heads = 0, kv_heads = 0, q_len = 0, kv_len = 0, head_dim = 0;
  DType dtype = DType::kFloat16;  // kFloat16 or kBFloat16
  float scale = 1.f;  // finite and >= 0 (for a negative scale, pass -q and -scale)
  bool causal = false;
  int64_t window_left = -1, window_right = -1;  // < 0: no limit on that side
};

// True for the head dims the kernels are built for (32, 64, 96, 128, 256).
inline bool supports_head_dim(int64_t head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128 || head_dim == 256;
}

// Dynamic shared memory one block of the kernel for head_dim takes (bytes; 0 when the
// head dim is not supported). Above 48 KB the launcher opts in.
int forward_smem_bytes(int64_t head_dim);

cudaError_t attention_forward(const AttentionForwardArgs& args, cudaStream_t stream);

}  // namespace cuda_attention
}  // namespace kernelforge
