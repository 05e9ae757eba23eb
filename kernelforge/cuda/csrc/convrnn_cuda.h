// ConvRNN over time, forward and backward, all T steps in one launch: plain CUDA, no torch headers.
//
//   h_0 = hidden;  h_t = tanh(x[:, t-1] + conv1d(h_{t-1}, w, padding = K / 2)),  t = 1..T
//
// x (B, T, F) with unit feature stride and any batch / time strides; w: K float32 taps (K odd);
// hidden (B, F) with unit feature stride; out (B, T, F) and h_T (B, F) dense. The backward
// (see kernelforge/reference/convrnn.py for the formulas) writes dx (B, T, F) and dhidden
// (B, F) dense and, per batch row, the K float32 partial sums of dkernel into dw_part (B, K):
// the caller adds the rows (a fixed order: deterministic, no atomics).
// One block per batch row keeps the state (float32) in shared memory for all T steps; a
// __syncthreads a step orders the writes of h_t before the shifted reads of the next step.
// Functions launch asynchronously on `stream` and return cudaGetLastError() (cudaSuccess
// without launching when B == 0; cudaErrorInvalidValue for sizes the kernels do not take).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "dtype.h"

namespace kernelforge {
namespace cuda_convrnn {

constexpr int kMaxFeatures = 16384;  // 1024 threads x 16 features a thread
constexpr int kMaxTaps = 15;         // dkernel partials live in registers, one a tap

struct ConvRnnShape {
  int64_t batch = 0, time = 0, features = 0, taps = 0;
};

cudaError_t convrnn_forward(const void* x, int64_t x_batch_stride, int64_t x_time_stride, const float* w,
                            const void* hidden, int64_t hidden_batch_stride, void* out, void* h_last,
                            ConvRnnShape shape, DType dtype, cudaStream_t stream);

cudaError_t convrnn_backward(const void* grad_out, int64_t go_batch_stride, int64_t go_time_stride,
                             const void* grad_h, int64_t gh_batch_stride, const float* w, const void* hidden,
                             int64_t hidden_batch_stride, const void* out, void* dx, void* dhidden, float* dw_part,
                             ConvRnnShape shape, DType dtype, cudaStream_t stream);

}  // namespace cuda_convrnn
}  // namespace kernelforge
