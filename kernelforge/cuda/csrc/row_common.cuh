// Building blocks of row kernels (softmax today; the norms and losses next): dtype
// conversion, 16-byte packs, warp and block reductions, cp.async copies into shared
// memory, and the per-device limits that size launches. Plain CUDA, no torch headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace kernelforge {
namespace row_common {

constexpr int kWarpSize = 32;
constexpr int kReservedSmemBytes = 1024;  // static reduction scratch + slack, under the opt-in limit

// ---------------------------------------------------------------------------------------
// Conversions (fp32 math for every storage dtype; two values per F2FP where it pairs).
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void from_float(float* out, float v) { *out = v; }
__device__ __forceinline__ void from_float(__half* out, float v) { *out = __float2half_rn(v); }
__device__ __forceinline__ void from_float(__nv_bfloat16* out, float v) { *out = __float2bfloat16_rn(v); }
__device__ __forceinline__ void from_float(float* out, float v, float w) { out[0] = v, out[1] = w; }
__device__ __forceinline__ void from_float(__half* out, float v, float w) {
  *reinterpret_cast<__half2*>(out) = __floats2half2_rn(v, w);
}
__device__ __forceinline__ void from_float(__nv_bfloat16* out, float v, float w) {
  *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(v, w);
}

// VEC consecutive elements, moved by one memory instruction.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  using Elem = T;
  static constexpr int kVec = VEC;
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void unpack(const Pack<T, VEC>& p, float* out) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = to_float(p.v[j]);
}

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> pack(const float* in) {
  Pack<T, VEC> p;
  if constexpr (VEC == 1) {
    from_float(&p.v[0], in[0]);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; j += 2) from_float(&p.v[j], in[j], in[j + 1]);  // 2 per F2FP
  }
  return p;
}

// ---------------------------------------------------------------------------------------
// Reductions. Butterflies of commutative operations: every lane of a group ends with the
// same bits. A Stats type has identity() and allreduce<WIDTH>() built from these.
template <int WIDTH>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int mask = WIDTH / 2; mask > 0; mask /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, mask, WIDTH));
  return v;
}
template <int WIDTH>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int mask = WIDTH / 2; mask > 0; mask /= 2) v += __shfl_xor_sync(0xffffffffu, v, mask, WIDTH);
  return v;
}

// Block-wide allreduce; blockDim.x is a multiple of 32.
template <typename Stats>
__device__ __forceinline__ Stats block_allreduce(Stats s, Stats* scratch) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  s = s.template allreduce<kWarpSize>();
  __syncthreads();  // the previous row is done reading scratch
  if (lane == 0) scratch[warp] = s;
  __syncthreads();
  s = lane < static_cast<int>(blockDim.x / kWarpSize) ? scratch[lane] : Stats::identity();
  return s.template allreduce<kWarpSize>();  // every warp reduces the partials identically
}

// ---------------------------------------------------------------------------------------
// Global -> shared memory.
// Global -> shared copy of one pack with cp.async: asynchronous, holds no registers.
template <typename P>
__device__ __forceinline__ void copy_to_smem_async(P* dst, const P* src) {
  static_assert(sizeof(P) == 4 || sizeof(P) == 8 || sizeof(P) == 16, "cp.async moves 4, 8 or 16 bytes");
  const unsigned dst_addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if constexpr (sizeof(P) == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst_addr), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst_addr), "l"(src), "n"(sizeof(P)) : "memory");
  }
}

__device__ __forceinline__ void commit_async_copies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wait_async_copies() {  // all but the PENDING newest groups landed
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// Plain copy (2-byte elements, unaligned rows: no cp.async) of packs first, first + stride,
// ... < count, BATCH loads in flight at a time.
template <int BATCH, typename P>
__device__ __forceinline__ void copy_to_smem_batched(P* dst, const P* src, int first, int stride, int count) {
  for (int p = first; p < count; p += BATCH * stride) {
    P batch[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b)
      if (p + b * stride < count) batch[b] = src[p + b * stride];
#pragma unroll
    for (int b = 0; b < BATCH; ++b)
      if (p + b * stride < count) dst[p + b * stride] = batch[b];
  }
}

// ---------------------------------------------------------------------------------------
// Parameters (norm weights and biases, activation biases) whose dtype is known only at run
// time: a float32 weight next to bf16 rows is common, and a template parameter per
// parameter dtype would multiply the kernel count. One uniform branch per load.
// Type codes match the DType enums of the kernel headers: 0 float32, 1 float16, 2 bfloat16.
constexpr int kParamFloat32 = 0, kParamFloat16 = 1, kParamBFloat16 = 2;

// out[0..VEC) = p[0..VEC) as float, in loads of at most 16 bytes. p must be aligned to
// min(VEC * sizeof(W), 16) bytes: true when the base is 16-byte aligned and p is the base
// plus a multiple of VEC elements.
template <typename W, int VEC>
__device__ __forceinline__ void load_floats(const W* p, float* out) {
  constexpr int kChunk = VEC * sizeof(W) <= 16 ? VEC : 16 / static_cast<int>(sizeof(W));
#pragma unroll
  for (int c = 0; c < VEC; c += kChunk) unpack(*reinterpret_cast<const Pack<W, kChunk>*>(p + c), out + c);
}

// out[0..VEC) = param[i..i + VEC) as float, param of type code `type`; i a multiple of VEC.
template <int VEC>
__device__ __forceinline__ void load_param(const void* param, int type, int64_t i, float* out) {
  if (type == kParamFloat32) {
    load_floats<float, VEC>(static_cast<const float*>(param) + i, out);
  } else if (type == kParamFloat16) {
    load_floats<__half, VEC>(static_cast<const __half*>(param) + i, out);
  } else {
    load_floats<__nv_bfloat16, VEC>(static_cast<const __nv_bfloat16*>(param) + i, out);
  }
}

__device__ __forceinline__ void store_param(void* param, int type, int64_t i, float v) {
  if (type == kParamFloat32) {
    from_float(static_cast<float*>(param) + i, v);
  } else if (type == kParamFloat16) {
    from_float(static_cast<__half*>(param) + i, v);
  } else {
    from_float(static_cast<__nv_bfloat16*>(param) + i, v);
  }
}

// Second stage of the deterministic column reductions (weight / bias gradients): out[c] =
// sum over p < parts of partial[p * cols + c], rounded once to type code `out_type`.
// Block (kColumnSumCols, kColumnSumSlices): thread (x, y) sums rows y, y + slices, ... of
// column blockIdx.x * kColumnSumCols + x in that order, then thread (x, 0) adds the slices
// in order. The order depends only on parts and cols: bitwise reproducible, no atomics.
constexpr int kColumnSumCols = 32, kColumnSumSlices = 16;

__device__ __forceinline__ void column_sum(const float* partial, int64_t parts, int64_t cols, void* out,
                                           int out_type) {
  __shared__ float slices[kColumnSumSlices][kColumnSumCols + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColumnSumCols + threadIdx.x;
  float sum = 0.f;
  if (col < cols) {
    int64_t p = threadIdx.y;
    for (; p + 3 * kColumnSumSlices < parts; p += 4 * kColumnSumSlices) {  // 4 loads in flight
      float v[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) v[k] = partial[(p + k * kColumnSumSlices) * cols + col];
#pragma unroll
      for (int k = 0; k < 4; ++k) sum += v[k];
    }
    for (; p < parts; p += kColumnSumSlices) sum += partial[p * cols + col];
  }
  slices[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.f;
#pragma unroll
    for (int s = 0; s < kColumnSumSlices; ++s) total += slices[s][threadIdx.x];
    store_param(out, out_type, col, total);
  }
}

// ---------------------------------------------------------------------------------------
// Host side: launch sizing.

struct DeviceLimits {
  int device, sm_count, smem_optin;
};

// SM count and opt-in shared memory per block of the current device, queried once.
inline cudaError_t current_device_limits(DeviceLimits* lim) {
  constexpr int kMaxCachedDevices = 64;
  static std::atomic<int> cached_sm_count[kMaxCachedDevices];
  static std::atomic<int> cached_smem_optin[kMaxCachedDevices];
  cudaError_t err = cudaGetDevice(&lim->device);
  if (err != cudaSuccess) return err;
  const bool cacheable = lim->device >= 0 && lim->device < kMaxCachedDevices;
  if (cacheable) {
    lim->sm_count = cached_sm_count[lim->device].load(std::memory_order_relaxed);
    lim->smem_optin = cached_smem_optin[lim->device].load(std::memory_order_relaxed);
    if (lim->sm_count > 0 && lim->smem_optin > 0) return cudaSuccess;
  }
  err = cudaDeviceGetAttribute(&lim->sm_count, cudaDevAttrMultiProcessorCount, lim->device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&lim->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, lim->device);
  if (err != cudaSuccess) return err;
  if (cacheable) {
    cached_sm_count[lim->device].store(lim->sm_count, std::memory_order_relaxed);
    cached_smem_optin[lim->device].store(lim->smem_optin, std::memory_order_relaxed);
  }
  return cudaSuccess;
}

inline unsigned grid_size(int64_t work_blocks, int64_t cap) {
  return static_cast<unsigned>(work_blocks < cap ? work_blocks : cap);
}

// Dynamic shared memory above the default 48 KB needs an opt-in, once per kernel and device.
template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, size_t bytes, const DeviceLimits& lim, std::atomic<uint64_t>& configured) {
  const uint64_t bit = lim.device < 64 ? uint64_t{1} << lim.device : 0;
  if (bytes <= 48 * 1024 || (bit != 0 && (configured.load(std::memory_order_relaxed) & bit))) return cudaSuccess;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, lim.smem_optin - kReservedSmemBytes);
  if (err == cudaSuccess) configured.fetch_or(bit, std::memory_order_relaxed);
  return err;
}

}  // namespace row_common
}  // namespace kernelforge
