// my_op's CUDA kernels (see my_op_cuda.h). Elementwise, a grid-stride loop, float32 math and
// one rounding to the storage dtype. Per element: forward moves 2 x itemsize bytes, backward
// 3 x itemsize: bandwidth-bound unless the math is long.
//
// TODO(new-op): write the math in forward_math and backward_math (the formulas of
// kernelforge/reference/my_op.py). Until then they return NaN, so the tests fail.
#include "my_op_cuda.h"

#include "row_common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>

#include <algorithm>
#include <cstdint>

namespace kernelforge {
namespace cuda_my_op {
namespace {

using row_common::from_float;
using row_common::to_float;

constexpr int kThreads = 256;

__device__ __forceinline__ float forward_math(float x) {
  // TODO(new-op): y = f(x), e.g. return x / (1.f + __expf(-x));
  return x * CUDART_NAN_F;
}

__device__ __forceinline__ float backward_math(float x, float grad_y) {
  // TODO(new-op): dx = f'(x) * grad_y
  return x * grad_y * CUDART_NAN_F;
}

template <typename T>
__global__ void my_op_forward_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    from_float(&y[i], forward_math(to_float(x[i])));
  }
}

template <typename T>
__global__ void my_op_backward_kernel(const T* __restrict__ x, const T* __restrict__ grad_y, T* __restrict__ grad_x,
                                      int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    from_float(&grad_x[i], backward_math(to_float(x[i]), to_float(grad_y[i])));
  }
}

// Enough blocks to fill the GPU a few times over; the grid-stride loop covers the rest.
unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
}

template <typename T>
cudaError_t forward_typed(const void* x, void* y, int64_t n, cudaStream_t stream) {
  my_op_forward_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(y), n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward_typed(const void* x, const void* grad_y, void* grad_x, int64_t n, cudaStream_t stream) {
  my_op_backward_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(grad_y), static_cast<T*>(grad_x), n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t my_op_forward(const void* x, void* y, int64_t n, DType dtype, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: return forward_typed<float>(x, y, n, stream);
    case DType::kFloat16: return forward_typed<__half>(x, y, n, stream);
    case DType::kBFloat16: return forward_typed<__nv_bfloat16>(x, y, n, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t my_op_backward(const void* x, const void* grad_y, void* grad_x, int64_t n, DType dtype,
                           cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: return backward_typed<float>(x, grad_y, grad_x, n, stream);
    case DType::kFloat16: return backward_typed<__half>(x, grad_y, grad_x, n, stream);
    case DType::kBFloat16: return backward_typed<__nv_bfloat16>(x, grad_y, grad_x, n, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda_my_op
}  // namespace kernelforge
