// ConvRNN forward and backward through time (see convrnn_cuda.h).
//
// One block per batch row, ITEMS features a thread (feature f = threadIdx.x + i * blockDim.x),
// the float32 state in shared memory, two rows alternating (step t reads one, writes the
// other; one __syncthreads a step). Per row and step:
//   forward:  F inputs read (the next step's prefetched into registers while this one runs),
//             F outputs written, K * F shared-memory taps, ~2K + 20 FLOPs a feature (tanhf);
//   backward: grad_out, h_t read, h_{t-1} read K times (L1), dx written, 2 K * F taps; the
//             gradient row in shared memory too, the K dkernel partials in registers.
// Latency-bound (a barrier a step, B blocks): the gain over the reference loop is one launch
// for T steps instead of ~5 launches a step, with the state never leaving the SM.
#include "convrnn_cuda.h"

#include "row_common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace kernelforge {
namespace cuda_convrnn {
namespace {

using row_common::from_float;
using row_common::to_float;

constexpr int kMaxThreads = 1024;

template <typename T, int ITEMS>
__global__ void __launch_bounds__(kMaxThreads) convrnn_forward_kernel(
    const T* __restrict__ x, int64_t sxb, int64_t sxt, const float* __restrict__ w, const T* __restrict__ hidden,
    int64_t shb, T* __restrict__ out, T* __restrict__ h_last, int time, int features, int taps) {
  extern __shared__ float smem[];
  float* state = smem;  // two rows of `features`: step t reads row t & 1, writes the other
  float* tap = smem + 2 * features;
  const int pad = taps / 2;
  const int64_t b = blockIdx.x;
  for (int j = threadIdx.x; j < taps; j += blockDim.x) tap[j] = w[j];
  float x_next[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int f = threadIdx.x + i * blockDim.x;
    if (f < features) {
      state[f] = to_float(hidden[b * shb + f]);
      x_next[i] = time > 0 ? to_float(x[b * sxb + f]) : 0.f;
    }
  }
  __syncthreads();
  for (int t = 0; t < time; ++t) {
    const float* src = state + (t & 1) * features;
    float* dst = state + ((t + 1) & 1) * features;
    float x_now[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int f = threadIdx.x + i * blockDim.x;
      x_now[i] = x_next[i];
      if (f < features && t + 1 < time) x_next[i] = to_float(x[b * sxb + (t + 1) * sxt + f]);
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int f = threadIdx.x + i * blockDim.x;
      if (f >= features) continue;
      float a = x_now[i];
      const int lo = max(0, pad - f), hi = min(taps, features + pad - f);  // taps inside [0, F)
      for (int j = lo; j < hi; ++j) a = fmaf(tap[j], src[f + j - pad], a);
      const float h = tanhf(a);
      dst[f] = h;
      from_float(&out[(b * time + t) * features + f], h);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int f = threadIdx.x + i * blockDim.x;
    if (f < features) from_float(&h_last[b * features + f], state[(time & 1) * features + f]);
  }
}

// The gradient g = dL/dh_t of the feature a thread owns stays in shared memory (a third row),
// not in registers: with the K dkernel partials unrolled there, 16 features a thread spilled.
template <typename T>
__global__ void __launch_bounds__(kMaxThreads) convrnn_backward_kernel(
    const T* __restrict__ grad_out, int64_t sgb, int64_t sgt, const T* __restrict__ grad_h, int64_t sghb,
    const float* __restrict__ w, const T* __restrict__ hidden, int64_t shb, const T* __restrict__ out,
    T* __restrict__ dx, T* __restrict__ dhidden, float* __restrict__ dw_part, int time, int features, int taps) {
  extern __shared__ float smem[];
  float* da_rows = smem;  // two rows of `features`, alternating by step
  float* g = smem + 2 * features;  // one row; feature f is only ever touched by its own thread
  float* tap = g + features;
  float* warp_sums = tap + kMaxTaps;  // [warps][kMaxTaps]
  const int pad = taps / 2;
  const int64_t b = blockIdx.x;
  for (int j = threadIdx.x; j < taps; j += blockDim.x) tap[j] = w[j];
  for (int f = threadIdx.x; f < features; f += blockDim.x) g[f] = to_float(grad_h[b * sghb + f]);
  float dw[kMaxTaps];
#pragma unroll
  for (int j = 0; j < kMaxTaps; ++j) dw[j] = 0.f;
  __syncthreads();
  for (int step = 0; step < time; ++step) {
    const int t = time - 1 - step;  // out[:, t] is h_{t+1}; its predecessor is out[:, t-1] or hidden
    const T* prev = t > 0 ? out + (b * time + t - 1) * features : hidden + b * shb;
    float* da_row = da_rows + (step & 1) * features;
    for (int f = threadIdx.x; f < features; f += blockDim.x) {
      const float h = to_float(out[(b * time + t) * features + f]);
      const float da = (g[f] + to_float(grad_out[b * sgb + t * sgt + f])) * (1.f - h * h);
      da_row[f] = da;
      from_float(&dx[(b * time + t) * features + f], da);
#pragma unroll
      for (int j = 0; j < kMaxTaps; ++j) {  // unrolled: dw stays in registers
        const int idx = f + j - pad;
        if (j < taps && idx >= 0 && idx < features) dw[j] = fmaf(da, to_float(prev[idx]), dw[j]);
      }
    }
    __syncthreads();
    for (int f = threadIdx.x; f < features; f += blockDim.x) {  // g_{t-1}[f] = sum_j w[j] da[f - j + pad]
      float acc = 0.f;
      const int lo = max(0, f + pad - features + 1), hi = min(taps, f + pad + 1);
      for (int j = lo; j < hi; ++j) acc = fmaf(tap[j], da_row[f - j + pad], acc);
      g[f] = acc;
    }
  }
  for (int f = threadIdx.x; f < features; f += blockDim.x) from_float(&dhidden[b * features + f], g[f]);
  // dkernel partials: each warp's sum by shuffles, then the warps' sums in a fixed order
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
#pragma unroll
  for (int j = 0; j < kMaxTaps; ++j) {
    float s = dw[j];
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
    if (lane == 0) warp_sums[warp * kMaxTaps + j] = s;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < taps; j += blockDim.x) {
    float s = 0.f;
    for (int k = 0; k < warps; ++k) s += warp_sums[k * kMaxTaps + j];
    dw_part[b * taps + j] = s;
  }
}

struct Launch {
  int items, threads;
};

// The fewest features a thread (1, 2, 4, 8, 16) that 1024 threads cover F with.
Launch plan(int64_t features) {
  int items = 1;
  while (items * kMaxThreads < features) items *= 2;
  const int64_t per_thread = (features + items - 1) / items;
  return {items, static_cast<int>((per_thread + 31) / 32 * 32)};
}

bool valid(const ConvRnnShape& s) {
  return s.batch >= 0 && s.time >= 0 && s.features >= 1 && s.features <= kMaxFeatures && s.taps >= 1 &&
         s.taps <= kMaxTaps && s.taps % 2 == 1 && s.batch <= INT32_MAX && s.time <= INT32_MAX;
}

template <typename T>
cudaError_t forward_typed(const void* x, int64_t sxb, int64_t sxt, const float* w, const void* hidden, int64_t shb,
                          void* out, void* h_last, ConvRnnShape s, cudaStream_t stream) {
  const Launch l = plan(s.features);
  const size_t smem = (2 * s.features + s.taps) * sizeof(float);
  const dim3 grid(static_cast<unsigned>(s.batch));
  const auto args = [&](auto kernel) {
    if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    kernel<<<grid, l.threads, smem, stream>>>(static_cast<const T*>(x), sxb, sxt, w, static_cast<const T*>(hidden),
                                              shb, static_cast<T*>(out), static_cast<T*>(h_last),
                                              static_cast<int>(s.time), static_cast<int>(s.features),
                                              static_cast<int>(s.taps));
  };
  switch (l.items) {
    case 1: args(convrnn_forward_kernel<T, 1>); break;
    case 2: args(convrnn_forward_kernel<T, 2>); break;
    case 4: args(convrnn_forward_kernel<T, 4>); break;
    case 8: args(convrnn_forward_kernel<T, 8>); break;
    default: args(convrnn_forward_kernel<T, 16>); break;
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward_typed(const void* grad_out, int64_t sgb, int64_t sgt, const void* grad_h, int64_t sghb,
                           const float* w, const void* hidden, int64_t shb, const void* out, void* dx, void* dhidden,
                           float* dw_part, ConvRnnShape s, cudaStream_t stream) {
  const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, (s.features + 31) / 32 * 32));
  const size_t smem = (3 * s.features + kMaxTaps + (threads / 32) * kMaxTaps) * sizeof(float);
  const auto kernel = convrnn_backward_kernel<T>;
  if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  kernel<<<static_cast<unsigned>(s.batch), threads, smem, stream>>>(
      static_cast<const T*>(grad_out), sgb, sgt, static_cast<const T*>(grad_h), sghb, w, static_cast<const T*>(hidden),
      shb, static_cast<const T*>(out), static_cast<T*>(dx), static_cast<T*>(dhidden), dw_part,
      static_cast<int>(s.time), static_cast<int>(s.features), static_cast<int>(s.taps));
  return cudaGetLastError();
}

}  // namespace

cudaError_t convrnn_forward(const void* x, int64_t x_batch_stride, int64_t x_time_stride, const float* w,
                            const void* hidden, int64_t hidden_batch_stride, void* out, void* h_last,
                            ConvRnnShape shape, DType dtype, cudaStream_t stream) {
  if (!valid(shape)) return cudaErrorInvalidValue;
  if (shape.batch == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return forward_typed<float>(x, x_batch_stride, x_time_stride, w, hidden, hidden_batch_stride, out, h_last,
                                  shape, stream);
    case DType::kFloat16:
      return forward_typed<__half>(x, x_batch_stride, x_time_stride, w, hidden, hidden_batch_stride, out, h_last,
                                   shape, stream);
    case DType::kBFloat16:
      return forward_typed<__nv_bfloat16>(x, x_batch_stride, x_time_stride, w, hidden, hidden_batch_stride, out,
                                          h_last, shape, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t convrnn_backward(const void* grad_out, int64_t go_batch_stride, int64_t go_time_stride,
                             const void* grad_h, int64_t gh_batch_stride, const float* w, const void* hidden,
                             int64_t hidden_batch_stride, const void* out, void* dx, void* dhidden, float* dw_part,
                             ConvRnnShape shape, DType dtype, cudaStream_t stream) {
  if (!valid(shape)) return cudaErrorInvalidValue;
  if (shape.batch == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return backward_typed<float>(grad_out, go_batch_stride, go_time_stride, grad_h, gh_batch_stride, w, hidden,
                                   hidden_batch_stride, out, dx, dhidden, dw_part, shape, stream);
    case DType::kFloat16:
      return backward_typed<__half>(grad_out, go_batch_stride, go_time_stride, grad_h, gh_batch_stride, w, hidden,
                                    hidden_batch_stride, out, dx, dhidden, dw_part, shape, stream);
    case DType::kBFloat16:
      return backward_typed<__nv_bfloat16>(grad_out, go_batch_stride, go_time_stride, grad_h, gh_batch_stride, w,
                                           hidden, hidden_batch_stride, out, dx, dhidden, dw_part, shape, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda_convrnn
}  // namespace kernelforge
