// my_op forward and backward, elementwise over n values: plain CUDA, no torch headers (so the
// kernel file compiles anywhere nvcc exists; my_op_binding.cpp talks to torch).
//   y = f(x);  dx = f'(x) * dy     (the definition: kernelforge/reference/my_op.py)
// Pointers are dense arrays of `dtype`; functions launch asynchronously on `stream` and return
// cudaGetLastError() (cudaSuccess without launching when n == 0).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "dtype.h"

namespace kernelforge {
namespace cuda_my_op {

cudaError_t my_op_forward(const void* x, void* y, int64_t n, DType dtype, cudaStream_t stream);

cudaError_t my_op_backward(const void* x, const void* grad_y, void* grad_x, int64_t n, DType dtype,
                           cudaStream_t stream);

}  // namespace cuda_my_op
}  // namespace kernelforge
