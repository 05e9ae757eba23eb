// GEMM with a fused epilogue on mma.sync tensor cores: plain CUDA, no torch headers.
//
//   acc[b, m, n] = sum_k a[b, m, k] * b[b, k, n]                 (fp32 accumulation)
//   out[b, m, n] = act(acc + bias[n]) + residual[b, m, n]       (fp32, one rounding)
//   preact[b, m, n] = acc[b, m, n]                               (rounded, when asked for)
// act: none, gelu (erf form), gelu_tanh, silu or relu, as kernelforge/reference/activations.py
// defines them; bias and residual are optional (a missing one adds nothing).
//
// Operands: a and b float16 or bfloat16 (both the same). Each has one contiguous dim, either
// of its two matrix dims ("k-major": unit stride along K; a (M, K) row-major is k-major, so is
// b = W^T of an nn.Linear weight W (N, K)); the other matrix dim and the batch have strides
// (elements, >= 0) that are multiples of 8, and the pointer is 16-byte aligned: every row of
// the contiguous dim starts on a 16-byte boundary, which the 16-byte cp.async copies need.
// Any M, N, K >= 0 (K = 0 gives the epilogue of zeros); nothing outside the logical matrices
// is read. A batch stride of 0 shares an operand over the batch.
// bias: (N,) with any element stride, residual: (batch, M, N) with any element strides (0
// where broadcast); either float32, float16 or bfloat16. out and preact: dense (batch, M, N)
// of out_dtype (float32, float16 or bfloat16), 16-byte aligned, not overlapping the inputs.
// Needs sm_80 or newer (mma.sync, ldmatrix, cp.async) and gemm_smem_bytes() of shared memory
// per block (opt-in above 48 KB); tuned for sm_90.
// gemm_forward launches asynchronously on `stream` and returns cudaGetLastError() after the
// launch: cudaSuccess without launching when batch, M or N is 0; cudaErrorInvalidValue for
// anything outside the above (sizes, strides, alignment, dtypes, warps, grid too large).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "dtype.h"

namespace kernelforge {
namespace cuda_gemm {

constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;  // M, N, K and the CTA count are int in the kernel

enum class Activation : int { kNone = 0, kGelu = 1, kGeluTanh = 2, kSilu = 3, kRelu = 4 };

struct GemmArgs {
  // a[b, m, k] = a + b * a_batch_stride + (a_k_major ? m * a_ld + k : k * a_ld + m)
  const void* a = nullptr;
  bool a_k_major = true;
  int64_t a_batch_stride = 0, a_ld = 0;
  // b[b, k, n] = b + b * b_batch_stride + (b_k_major ? n * b_ld + k : k * b_ld + n)
  const void* b = nullptr;
  bool b_k_major = false;
  int64_t b_batch_stride = 0, b_ld = 0;
  const void* bias = nullptr;  // null or bias[n * bias_stride]
  DType bias_dtype = DType::kFloat32;
  int64_t bias_stride = 1;
  const void* residual = nullptr;  // null or residual[b * rs_batch + m * rs_row + n * rs_col]
  DType residual_dtype = DType::kFloat32;
  int64_t residual_batch_stride = 0, residual_row_stride = 0, residual_col_stride = 0;
  void* out = nullptr;     // dense (batch, M, N)
  void* preact = nullptr;  // null or dense (batch, M, N)
  DType out_dtype = DType::kFloat16;
  int64_t batch = 0, M = 0, N = 0, K = 0;
  DType dtype = DType::kFloat16;  // of a and b: kFloat16 or kBFloat16
  Activation activation = Activation::kNone;
  int warps = 8;  // 8 (256 threads: the default tile) or 4 (128 threads); see gemm_kernel.cuh
};

// Dynamic shared memory of one block of the kernel for these warps and layouts (bytes; 0
// for an unsupported warp count). Above 48 KB the launcher opts in.
int gemm_smem_bytes(int warps, bool a_k_major, bool b_k_major);

cudaError_t gemm_forward(const GemmArgs& args, cudaStream_t stream);

}  // namespace cuda_gemm
}  // namespace kernelforge
