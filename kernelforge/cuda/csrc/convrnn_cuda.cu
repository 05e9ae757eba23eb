// ConvRNN forward and backward through time (see convrnn_cuda.h).
//
// One block per batch row, ITEMS features a thread, the float32 state in shared memory, two rows
// alternating (a step reads one, writes the other; one __syncthreads a step). Per row and step:
//   forward:  feature f = threadIdx.x + i * blockDim.x; F inputs read (the next step's prefetched into
//             registers while this one runs), F outputs written, K * F shared-memory taps, ~2K + 20
//             FLOPs a feature (tanhf);
//   backward: 3 F sizeof(T) bytes: F elements each of out (h_t, loaded ahead of its step and used by
//             two steps' terms) and grad_out read, F of dx written; F float32 shared-memory writes
//             (da) and K * F reads, each read feeding both dL/dh and a dkernel partial; 4K + 4 FLOPs a
//             feature (2K FMAs, then 1 - h^2, + and * for da), the K dkernel partials in registers.
// Latency-bound (a barrier a step, B blocks): the gain over the reference loop is one launch
// for T steps instead of ~5 launches a step, with the state never leaving the SM.
#include "convrnn_cuda.h"

#include "row_common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

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

// Elements of out, grad_out and hidden as raw bits in registers: a load lands in a register that
// nothing converts before the value's use, so no instruction waits on it early (at a loop's back edge).
template <typename T>
struct Raw;
template <>
struct Raw<float> {
  using Bits = unsigned;
  static __device__ __forceinline__ float to_float(Bits b) { return __uint_as_float(b); }
  static __device__ __forceinline__ Bits from_float(float v) { return __float_as_uint(v); }
};
template <>
struct Raw<__half> {
  using Bits = unsigned short;
  static __device__ __forceinline__ float to_float(Bits b) { return __half2float(__ushort_as_half(b)); }
  static __device__ __forceinline__ Bits from_float(float v) { return __half_as_ushort(__float2half_rn(v)); }
};
template <>
struct Raw<__nv_bfloat16> {
  using Bits = unsigned short;
  static __device__ __forceinline__ float to_float(Bits b) { return __bfloat162float(__ushort_as_bfloat16(b)); }
  static __device__ __forceinline__ Bits from_float(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};

// v = *p where `on`, else v unchanged; *p = v where `on`. Predicated in PTX: under a C++ `if` the
// compiler moves each item's address arithmetic into a branch of its own, and the items' accesses no
// longer share one base register with constant offsets.
template <typename T>
__device__ __forceinline__ void load_if(bool on, const T* p, typename Raw<T>::Bits& v) {
  if constexpr (sizeof(T) == 4) {
    asm("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q ld.global.nc.b32 %0, [%1];\n}"
        : "+r"(v) : "l"(p), "r"(static_cast<int>(on)));
  } else {
    asm("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q ld.global.nc.b16 %0, [%1];\n}"
        : "+h"(v) : "l"(p), "r"(static_cast<int>(on)));
  }
}
// No "memory" clobber: the kernel never reads what it stores, so no access needs ordering against it.
template <typename T>
__device__ __forceinline__ void store_if(bool on, T* p, typename Raw<T>::Bits v) {
  if constexpr (sizeof(T) == 4) {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q st.global.b32 [%0], %1;\n}"
                 :: "l"(p), "r"(v), "r"(static_cast<int>(on)));
  } else {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q st.global.b16 [%0], %1;\n}"
                 :: "l"(p), "h"(v), "r"(static_cast<int>(on)));
  }
}

// Backward, a step per row t = T-1 .. 0 of out (out[:, t] is h_{t+1}). The step that has h = out[:, t]
// in hand also closes the previous step's da row da' (of row t + 1), whose remaining terms need exactly
// that h:
//   g[f]   = sum_j w[j] da'[f - j + pad]           dL/dh_{t+1}, the conv_transpose of da'
//   dw[j] += h[f] da'[f - j + pad]                 = sum_f da'[f] h[f + j - pad]: own h, neighbours' da'
//   da[f]  = (g[f] + grad_out[t, f]) (1 - h[f]^2)  into dx and the other da row
// So one shared-memory read of da' feeds both sums, each row of out is loaded once, and g never
// outlives its step. Row T - 1 takes g = grad_h; after row 0, h = hidden (h_0) closes the last da row
// and g is dhidden.
//
// Item i of a thread is feature f0 + 32 i, f0 = warp * 32 ITEMS + lane: a warp covers 32 ITEMS
// consecutive features, 32 a load (coalesced), and a thread's items are one base plus constants. The
// da rows hold every warp's items, those past the row (f >= F) too: these keep h = 0 and da = 0, so
// shared memory needs no bounds test and only their global accesses are skipped (predicated).
// Items go in groups of kGroup, each group's out and grad_out elements loaded while the group before it
// computes: a step ahead up to 4 items a thread (the next step's first group during this step's last,
// across the barrier). A fully unrolled step of 8 or 16 items gives ptxas the room to schedule every
// load at once, which with the 64 registers of 1024 threads spilled; the run-time tap count, whose 15
// taps and dkernel partials fill the registers, goes one item at a time.
// Slot k (a tap, a dkernel partial) reads da'[f + kMargin - k]: k = j with TAPS taps; TAPS == 0 takes
// the count at run time, centred in kMaxTaps slots. Each da row has kMargin zeros at both ends, so every
// slot reads at a constant offset with no bounds test.
// __launch_bounds__ minBlocks 1: one block an SM is all a row needs; without it ptxas at times aimed
// at two (32 registers) and spilled.
template <typename T, int ITEMS, int TAPS>
__global__ void __launch_bounds__(kMaxThreads, 1) convrnn_backward_kernel(
    const T* __restrict__ grad_out, int64_t sgb, int64_t sgt, const T* __restrict__ grad_h, int64_t sghb,
    const float* __restrict__ w, const T* __restrict__ hidden, int64_t shb, const T* __restrict__ out,
    T* __restrict__ dx, T* __restrict__ dhidden, float* __restrict__ dw_part, int time, int features,
    int runtime_taps) {
  using R = Raw<T>;
  constexpr int kSlots = TAPS > 0 ? TAPS : kMaxTaps, kMargin = kSlots / 2;
  constexpr int kGroup = TAPS == 0 ? 1 : ITEMS < 4 ? ITEMS : 4;
  const int taps = TAPS > 0 ? TAPS : runtime_taps;
  const int first = kMargin - taps / 2;  // the slot of tap 0
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int row = warps * 32 * ITEMS + 2 * kMargin;
  extern __shared__ float smem[];
  float* da_rows = smem + kMargin;    // two rows of `row`, alternating by step; feature 0 at da_rows[0]
  float* warp_sums = smem + 2 * row;  // [warps][kSlots]
  const int64_t b = blockIdx.x;
  const unsigned f0 = warp * 32 * ITEMS + lane;  // unsigned: no sign extension kept for the addresses
  const int n_active = min(ITEMS, max(0, (features - static_cast<int>(f0) + 31) / 32));  // items i < F
  const T* grad_h_b = grad_h + b * sghb + f0;
  const T* hidden_b = hidden + b * shb + f0;
  if (time == 0) {  // no steps: dhidden = grad_h, no dkernel terms
    for (int i = 0; i < n_active; ++i) dhidden[b * features + f0 + 32 * i] = grad_h_b[32 * i];
    for (int j = threadIdx.x; j < taps; j += blockDim.x) dw_part[b * taps + j] = 0.f;
    return;
  }
  // used[k]: slot k holds a tap (always, with TAPS taps). The other slots read as 0: a zero weight alone
  // would turn an inf there into a NaN. The taps sit in registers with TAPS taps; with the run-time
  // count in shared memory, a broadcast read a use, since 15 registers of taps next to the 15 dkernel
  // partials spilled.
  float* tap_row = warp_sums + warps * kSlots;
  bool used[kSlots];
  float wt[kSlots], dw[kSlots];
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    used[k] = TAPS > 0 || (k >= first && k < first + taps);
    if constexpr (TAPS > 0) wt[k] = w[k];
    dw[k] = 0.f;
  }
  const auto tap = [&](int k) {
    if constexpr (TAPS > 0) {
      return wt[k];
    } else {
      return tap_row[k];
    }
  };
  for (int k = threadIdx.x; k < 2 * row; k += blockDim.x) smem[k] = 0.f;  // margins and items past F stay 0
  if (TAPS == 0 && threadIdx.x < kSlots) {
    const int k = threadIdx.x;
    tap_row[k] = k >= first && k < first + taps ? w[k - first] : 0.f;
  }
  __syncthreads();
  // Row T - 1, where g = grad_h: once, so scalars in a plain loop rather than registers held across it.
  const T* out_t = out + (b * time + time - 1) * features + f0;  // rows t of out, grad_out, dx
  const T* go_t = grad_out + b * sgb + (time - 1) * sgt + f0;
  T* dx_t = dx + (b * time + time - 1) * features + f0;
#pragma unroll 4
  for (int i = 0; i < n_active; ++i) {
    const float hf = to_float(out_t[32 * i]);
    const float da = (to_float(grad_h_b[32 * i]) + to_float(go_t[32 * i])) * (1.f - hf * hf);
    da_rows[f0 + 32 * i] = da;
    from_float(&dx_t[32 * i], da);
  }
  // The next group's out and grad_out elements (the first group of row T - 2, or of hidden if T = 1;
  // after row 0 the grad_out row is row 0 again, loaded and never used).
  typename R::Bits h[kGroup], go[kGroup];
#pragma unroll
  for (int u = 0; u < kGroup; ++u) {
    h[u] = go[u] = 0;
    load_if(u < n_active, time > 1 ? out_t - features + 32 * u : hidden_b + 32 * u, h[u]);
    load_if(u < n_active, time > 1 ? go_t - sgt + 32 * u : go_t + 32 * u, go[u]);
  }
  __syncthreads();  // row T - 1's da is complete
  // g of item i from the previous step's da row; on the way, that row's dkernel terms with hf, the
  // item's h (0 past the row).
  const auto close_row = [&](const float* prev, int i, float hf) {
    float g = 0.f;
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const float v = used[k] ? prev[static_cast<int>(f0) + 32 * i + kMargin - k] : 0.f;
      g = fmaf(tap(k), v, g);
      dw[k] = fmaf(hf, v, dw[k]);
    }
    return g;
  };
  for (int s = 1; s < time; ++s) {  // step s: row t = T - 1 - s
    const int t = time - 1 - s;
    out_t -= features, go_t -= sgt, dx_t -= features;
    const float* prev = da_rows + ((s - 1) & 1) * row;
    float* cur = da_rows + (s & 1) * row;
    const T* out_n = t > 0 ? out_t - features : hidden_b;  // the next step's rows
    const T* go_n = t > 0 ? go_t - sgt : go_t;
#pragma unroll 1
    for (int i0 = 0; i0 < n_active; i0 += kGroup) {
      // the loads that refill this group: the next group, or after the last the next step's first
      const bool last = i0 + kGroup >= n_active;
      const int n0 = last ? 0 : i0 + kGroup;
      const T* h_next = (last ? out_n : out_t) + 32 * n0;
      const T* go_next = (last ? go_n : go_t) + 32 * n0;
      // this group's h and go as floats, then at once the loads that refill their registers
      float hf[kGroup], gof[kGroup];
#pragma unroll
      for (int u = 0; u < kGroup; ++u) {
        hf[u] = i0 + u < n_active ? R::to_float(h[u]) : 0.f;
        gof[u] = R::to_float(go[u]);
        load_if(n0 + u < n_active, h_next + 32 * u, h[u]);
        load_if(n0 + u < n_active, go_next + 32 * u, go[u]);
      }
#pragma unroll
      for (int u = 0; u < kGroup; ++u) {
        const int i = i0 + u;
        const bool on = i < n_active;
        const float da = (close_row(prev, i, hf[u]) + gof[u]) * (1.f - hf[u] * hf[u]);
        cur[f0 + 32 * i] = on ? da : 0.f;
        store_if(on, dx_t + 32 * i, R::from_float(da));
      }
    }
    __syncthreads();  // cur is complete; the next step overwrites prev
  }
  // h holds hidden (h_0): the last da row's dkernel terms, and g = dhidden
  const float* last = da_rows + ((time - 1) & 1) * row;
#pragma unroll 1
  for (int i0 = 0; i0 < n_active; i0 += kGroup) {
    const T* h_next = hidden_b + 32 * (i0 + kGroup);
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {
      const int i = i0 + u;
      const bool on = i < n_active;
      const float g = close_row(last, i, on ? R::to_float(h[u]) : 0.f);
      store_if(on, dhidden + b * features + f0 + 32 * i, R::from_float(g));
      load_if(i0 + kGroup + u < n_active, h_next + 32 * u, h[u]);
    }
  }
  // dkernel partials: each warp's sum by shuffles, then the warps' sums in a fixed order
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    float s = dw[k];
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
    if (lane == 0) warp_sums[warp * kSlots + k] = s;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < taps; j += blockDim.x) {
    float s = 0.f;
    for (int k = 0; k < warps; ++k) s += warp_sums[k * kSlots + first + j];
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
  const Launch l = plan(s.features);
  const dim3 grid(static_cast<unsigned>(s.batch));
  // two da rows of items * threads with slots / 2 zeros either side, the warps' dkernel sums, and the
  // run-time tap count's taps
  const auto args = [&](auto kernel, int slots) {
    const size_t smem =
        (2 * (l.items * l.threads + slots / 2 * 2) + l.threads / 32 * slots + kMaxTaps) * sizeof(float);
    if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    kernel<<<grid, l.threads, smem, stream>>>(
        static_cast<const T*>(grad_out), sgb, sgt, static_cast<const T*>(grad_h), sghb, w,
        static_cast<const T*>(hidden), shb, static_cast<const T*>(out), static_cast<T*>(dx), static_cast<T*>(dhidden),
        dw_part, static_cast<int>(s.time), static_cast<int>(s.features), static_cast<int>(s.taps));
  };
  const auto by_taps = [&](auto items) {  // the common tap counts unrolled, the rest at run time
    constexpr int kItems = decltype(items)::value;
    switch (s.taps) {
      case 1: args(convrnn_backward_kernel<T, kItems, 1>, 1); break;
      case 3: args(convrnn_backward_kernel<T, kItems, 3>, 3); break;
      case 5: args(convrnn_backward_kernel<T, kItems, 5>, 5); break;
      case 7: args(convrnn_backward_kernel<T, kItems, 7>, 7); break;
      default: args(convrnn_backward_kernel<T, kItems, 0>, kMaxTaps); break;
    }
  };
  switch (l.items) {
    case 1: by_taps(std::integral_constant<int, 1>()); break;
    case 2: by_taps(std::integral_constant<int, 2>()); break;
    case 4: by_taps(std::integral_constant<int, 4>()); break;
    case 8: by_taps(std::integral_constant<int, 8>()); break;
    default: by_taps(std::integral_constant<int, 16>()); break;
  }
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
