// Softmax / log-softmax over the rows of a matrix: plain CUDA, no torch headers.
//
// Layout: a "row" is `cols` contiguous elements; consecutive rows of an input are
// `*_row_stride` elements apart (any stride >= 0, including 0 for broadcast rows);
// outputs are dense (rows x cols, row stride == cols) and must not overlap the inputs.
// All pointers are device pointers aligned to their element size. The fast 16-byte
// vector path is taken when every pointer is 16-byte aligned and cols and every row
// stride are multiples of 16 / sizeof(element) (4 for float32, 8 for float16/bfloat16);
// anything else runs the same kernels one element at a time.
// Math is fp32 for every dtype; results are rounded once to the storage dtype.
// Both functions launch asynchronously on `stream` and return cudaGetLastError() after
// the launch (cudaSuccess without launching anything when rows == 0 or cols == 0,
// cudaErrorInvalidValue for negative sizes/strides, cols >= 2^31 or an unknown dtype).
// Rows may number 2^31 and more. Needs sm_80 or newer (cp.async); tuned for sm_90.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "dtype.h"

namespace kernelforge {
namespace cuda_softmax {

// y[r, c] = softmax (or log_softmax when `log`) of x[r, :].
cudaError_t softmax_forward(const void* x, int64_t x_row_stride, void* y, int64_t rows, int64_t cols,
                            DType dtype, bool log, cudaStream_t stream);

// grad_in = d/dx given grad_out and the forward output `out`; grad_in is dense.
//   softmax:      gx = y * (gy - sum_c(gy * y))
//   log_softmax:  gx = gy - exp(y) * sum_c(gy)
cudaError_t softmax_backward(const void* grad_out, int64_t go_row_stride, const void* out,
                             int64_t out_row_stride, void* grad_in, int64_t rows, int64_t cols,
                             DType dtype, bool log, cudaStream_t stream);

}  // namespace cuda_softmax
}  // namespace kernelforge
