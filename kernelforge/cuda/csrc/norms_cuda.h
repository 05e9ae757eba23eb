// Layer norm / RMS norm over the rows of a matrix, with an optional residual add, forward
// and backward: plain CUDA, no torch headers.
//
// Layout: a "row" is `cols` contiguous elements; consecutive rows of an input are
// `*_row_stride` elements apart (any stride >= 0, 0 = one broadcast row); outputs are
// dense (rows x cols, row stride == cols) and must not overlap the inputs. Weight and
// bias are dense (cols,) vectors of any of the three dtypes, independently of the rows'
// dtype. All pointers are device pointers aligned to their element size. The 16-byte
// vector path is taken when every row pointer, weight and bias is 16-byte aligned and
// cols and every row stride are multiples of 16 / sizeof(element) (4 for float32, 8 for
// float16 / bfloat16); anything else runs the same kernels one element at a time.
// Math is fp32 for every dtype; results are rounded once to their storage dtype.
// Functions launch asynchronously on `stream` and return cudaGetLastError() after the
// launches (cudaSuccess without launching when rows == 0 or cols == 0;
// cudaErrorInvalidValue for negative sizes or strides, cols > kMaxCols, a missing
// required pointer or a workspace that is too small). Needs sm_80 or newer; tuned for sm_90.
//
//   h = x, or x + residual rounded to x's dtype (stored as residual_out)
//   layer norm: mean = sum(h) / n, rstd = 1 / sqrt(sum((h - mean)^2) / n + eps),
//               y = (h - mean) * rstd * (w + offset) + b
//   RMS norm:   rstd = 1 / sqrt(sum(h^2) / n + eps), y = h * rstd * (w + offset) + b
// with w = 1 and no offset when weight is null, b = 0 when bias is null.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "dtype.h"

namespace kernelforge {
namespace cuda_norms {

constexpr int64_t kMaxCols = int64_t{1} << 30;

struct NormForwardArgs {
  const void* x = nullptr;  // (rows, cols), dtype
  int64_t x_row_stride = 0;
  const void* residual = nullptr;  // null, or (rows, cols) of dtype
  int64_t residual_row_stride = 0;
  const void* weight = nullptr;  // null or (cols,)
  DType weight_dtype = DType::kFloat32;
  const void* bias = nullptr;  // null or (cols,)
  DType bias_dtype = DType::kFloat32;
  void* y = nullptr;             // dense (rows, cols), dtype
  void* residual_out = nullptr;  // dense (rows, cols), dtype; required iff residual is given
  float* mean = nullptr;         // (rows,) or null (not written); RMS norm never writes it
  float* rstd = nullptr;         // (rows,), required
  int64_t rows = 0, cols = 0;
  DType dtype = DType::kFloat32;
  float eps = 1e-5f, offset = 0.f;
  bool rms = false;
};

cudaError_t norm_forward(const NormForwardArgs& args, cudaStream_t stream);

// With xhat = (h - mean) * rstd (RMS: h * rstd), g = dy * (w + offset) (dy without weight):
//   grad_h = rstd * (g - mean(g) - xhat * mean(g * xhat)) + grad_residual   (RMS: no mean(g))
//   grad_weight = sum over rows of dy * xhat, grad_bias = sum over rows of dy
// The two column sums are deterministic: fp32 partial sums per block of rows in the
// workspace, then a column sum in a fixed order. No atomics.
struct NormBackwardArgs {
  const void* grad_y = nullptr;  // (rows, cols), dtype
  int64_t grad_y_row_stride = 0;
  const void* grad_residual = nullptr;  // null, or (rows, cols) of dtype: added into grad_h
  int64_t grad_residual_row_stride = 0;
  const void* h = nullptr;  // (rows, cols), dtype: the normalized input (residual_out)
  int64_t h_row_stride = 0;
  const void* weight = nullptr;  // null or (cols,)
  DType weight_dtype = DType::kFloat32;
  const float* mean = nullptr;  // (rows,) for layer norm; ignored for RMS norm
  const float* rstd = nullptr;  // (rows,)
  void* grad_h = nullptr;       // dense (rows, cols), dtype
  void* grad_weight = nullptr;  // null (not wanted) or (cols,) of grad_weight_dtype
  DType grad_weight_dtype = DType::kFloat32;
  void* grad_bias = nullptr;  // null (not wanted) or (cols,) of grad_bias_dtype
  DType grad_bias_dtype = DType::kFloat32;
  void* workspace = nullptr;  // norm_backward_workspace_bytes(...) bytes, 16-byte aligned
  size_t workspace_bytes = 0;
  int64_t rows = 0, cols = 0;
  DType dtype = DType::kFloat32;
  float offset = 0.f;
  bool rms = false;
};

// Scratch norm_backward needs for these sizes on the current device (0 when none). Depends
// only on rows, cols, which gradients are wanted and the device's SM count.
size_t norm_backward_workspace_bytes(int64_t rows, int64_t cols, bool grad_weight, bool grad_bias);

cudaError_t norm_backward(const NormBackwardArgs& args, cudaStream_t stream);

}  // namespace cuda_norms
}  // namespace kernelforge
