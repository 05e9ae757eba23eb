// Bias + GELU over the rows of a matrix, forward and backward: plain CUDA, no torch headers.
//
//   z = x + bias (fp32, not rounded), y = gelu(z)
//   gelu (erf):  z * Phi(z) = 0.5 z (1 + erf(z / sqrt(2)))
//   gelu (tanh): 0.5 z (1 + tanh(sqrt(2 / pi) (z + 0.044715 z^3)))   (torch's approximate="tanh")
//   backward: grad_x = grad_y * gelu'(z) (recomputed from x), grad_bias = sum over rows of
//   grad_x (fp32, unrounded), deterministic: fp32 partials per block of rows in the
//   workspace, then a column sum in a fixed order. No atomics.
//
// Layout as in norms_cuda.h: rows of `cols` contiguous elements, any row stride >= 0 for
// inputs, dense outputs that do not overlap the inputs, bias a dense (cols,) vector of any
// of the three dtypes; the 16-byte vector path when every row pointer and the bias are
// 16-byte aligned and cols and the row strides are multiples of 16 / sizeof(element).
// Math is fp32 (erff / tanhf / expf); results are rounded once. Functions launch
// asynchronously on `stream` and return cudaGetLastError() (cudaSuccess without launching
// when rows == 0 or cols == 0; cudaErrorInvalidValue for bad sizes, strides, dtypes,
// missing pointers or a too-small workspace).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "dtype.h"

namespace kernelforge {
namespace cuda_activations {

constexpr int64_t kMaxCols = int64_t{1} << 30;

struct BiasGeluArgs {
  const void* x = nullptr;  // (rows, cols), dtype
  int64_t x_row_stride = 0;
  const void* grad_y = nullptr;  // backward only: (rows, cols), dtype
  int64_t grad_y_row_stride = 0;
  const void* bias = nullptr;  // null or (cols,)
  DType bias_dtype = DType::kFloat32;
  void* out = nullptr;  // dense (rows, cols), dtype: y (forward) or grad_x (backward)
  void* grad_bias = nullptr;  // backward: null (not wanted) or (cols,) of grad_bias_dtype
  DType grad_bias_dtype = DType::kFloat32;
  void* workspace = nullptr;  // backward with grad_bias: bias_gelu_backward_workspace_bytes(args)
  size_t workspace_bytes = 0;
  int64_t rows = 0, cols = 0;
  DType dtype = DType::kFloat32;
  bool tanh_form = false;
};

cudaError_t bias_gelu_forward(const BiasGeluArgs& args, cudaStream_t stream);

// Scratch bias_gelu_backward needs for these arguments on the current device (0 when none;
// the pointers matter: they decide the vector width, which decides the grid).
size_t bias_gelu_backward_workspace_bytes(const BiasGeluArgs& args);

cudaError_t bias_gelu_backward(const BiasGeluArgs& args, cudaStream_t stream);

}  // namespace cuda_activations
}  // namespace kernelforge
