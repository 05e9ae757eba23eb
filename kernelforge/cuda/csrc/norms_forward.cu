// Layer norm / RMS norm forward over matrix rows (see norms_cuda.h; the shared design
// notes are in norms_common.cuh).
//
// Statistics: each thread merges the exact mean / squared deviations of the values it
// holds (two passes over registers), threads merge with Chan et al.'s formula in a
// butterfly whose operands are ordered by lane (every lane ends with the same bits). No
// sum-of-squares cancellation for layer norm. RMS sums h^2 itself (mean kept 0, the same
// merge adding the sums): an infinite h then gives sum inf and rstd 0, so the row is 0 but
// NaN at the inf (inf x 0), as torch's; deviations from an infinite mean would make the whole
// row NaN. rstd = 1 / sqrtf(.) (IEEE sqrt and division, not the 2-ulp rsqrtf).
//
// Forward, by n (elements, the same choice for every VEC):
//  (a) n <= 512, norm_fwd_regs_kernel<GROUP = 4..32>: GROUP lanes per row, row in
//      registers (<= 16 values a thread), shuffle reductions; 128-thread blocks hold
//      128 / GROUP rows, grid-stride over rows (<= 32 blocks per SM).
//  (b) n <= 8192, norm_fwd_regs_kernel<GROUP = 0>: a block per row, 8 or 16 values a
//      thread (8 while that keeps the block <= 256 threads, then 16 with <= 512 threads),
//      block reduction; grid-stride, ~2048 threads per SM. (32 values a thread at 512
//      threads needs ~145 registers: it spilled, so longer rows take (c).)
//  (c) longer rows, norm_fwd_long_kernel: 512 threads per row, 32 bytes per thread and
//      input per step (16-32 KB in flight per block). Pass 1 reads x (+ residual), writes
//      residual_out, keeps h in shared memory when n * E fits the opt-in limit (227 KB on
//      H100: up to 116K 16-bit / 58K fp32 columns; 2 blocks per SM when two rows fit) and
//      merges the statistics; pass 2 reads h back from shared memory (or, for longer rows,
//      again from global memory: residual_out or x, from L2 while 2 rows per SM fit in the
//      50 MB L2, i.e. rows up to ~190 KB; from DRAM beyond).
//  DRAM bytes: R*n*E read + R*n*E written (+ R*n*E read and written with a residual),
//  + 4-8 bytes of statistics per row; (c) without shared memory reads h twice at worst.
//  FLOPs: ~8 per element (add, chunk mean and deviation, normalize, scale, shift).

#include "norms_common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace kernelforge {
namespace cuda_norms {
namespace {

constexpr int kFwdWarpThreads = 128;       // (a): block size
constexpr int kFwdMaxElems = 16;           // (a), (b): values per thread (32 spills at 512 threads)
constexpr int kFwdMaxWarpCols = kWarpSize * kFwdMaxElems;  // 512
constexpr int kFwdBlockThreads = 256;      // (b): preferred block size ...
constexpr int kFwdMaxBlockThreads = 512;   //      ... and the largest
constexpr int kFwdMaxRegisterCols = kFwdMaxBlockThreads * kFwdMaxElems;  // 8192
constexpr int kMaxBlocksPerSm = 32;        // forward grid cap; more rows -> grid-stride loops

// ---------------------------------------------------------------------------------------
// Statistics.

// Count, mean and sum of squared deviations of a set of values (Chan et al.).
struct MeanM2 {
  float count, mean, m2;
  __device__ static MeanM2 identity() { return {0.f, 0.f, 0.f}; }
  __device__ static MeanM2 merge(const MeanM2& a, const MeanM2& b) {
    const float count = a.count + b.count;
    if (count == 0.f) return a;
    const float delta = b.mean - a.mean, f = b.count / count;
    return {count, a.mean + delta * f, a.m2 + b.m2 + delta * delta * a.count * f};
  }
  // merge(lower lane, upper lane) on both lanes of a pair: identical bits everywhere.
  template <int WIDTH>
  __device__ MeanM2 allreduce() const {
    MeanM2 s = *this;
    const int lane = threadIdx.x % kWarpSize;
#pragma unroll
    for (int mask = WIDTH / 2; mask > 0; mask /= 2) {
      const MeanM2 o{__shfl_xor_sync(0xffffffffu, s.count, mask, WIDTH),
                     __shfl_xor_sync(0xffffffffu, s.mean, mask, WIDTH),
                     __shfl_xor_sync(0xffffffffu, s.m2, mask, WIDTH)};
      s = (lane & mask) ? merge(o, s) : merge(s, o);
    }
    return s;
  }
};

// Stats of v[0..count) (count a multiple of VEC, the valid prefix); v[count..N) are 0.
// RMS: mean 0 and m2 = sum(v^2) (see the top of the file).
template <int N>
__device__ __forceinline__ MeanM2 chunk_stats(const float (&v)[N], int count, bool rms) {
  if (count == 0) return MeanM2::identity();
  float sum = 0.f;
  if (rms) {
#pragma unroll
    for (int j = 0; j < N; ++j) sum += v[j] * v[j];
    return {static_cast<float>(count), 0.f, sum};
  }
#pragma unroll
  for (int j = 0; j < N; ++j) sum += v[j];
  const float mean = sum / static_cast<float>(count);
  float m2 = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float d = v[j] - mean;
    m2 += j < count ? d * d : 0.f;
  }
  return {static_cast<float>(count), mean, m2};
}

struct RowStats {
  float mean, rstd;  // mean = 0 for RMS norm, so xhat = (h - mean) * rstd for both
};

__device__ __forceinline__ RowStats finish_stats(const MeanM2& s, int cols, float eps, bool rms) {
  const float n = static_cast<float>(cols), var = s.m2 / n;
  if (rms) return {0.f, 1.f / sqrtf(var + eps)};  // m2 = sum(h^2) here
  return {s.mean, 1.f / sqrtf(var + eps)};
}

// ---------------------------------------------------------------------------------------
// Forward.

template <typename T>
struct FwdArgs {
  const T* x;
  const T* res;  // null: no residual
  int64_t x_stride, res_stride;
  const void* w;  // null: weight 1, no offset
  const void* b;  // null: bias 0
  int w_type, b_type;
  T* y;        // dense
  T* res_out;  // dense; written iff res
  float* mean;  // null: not written
  float* rstd;
  int64_t rows;
  int cols;
  float eps, offset;
  bool rms;
};

// Packs first + u * stride (u < UNROLL) of h's row `row`: h = x, or x + residual rounded to
// T and stored to residual_out. hp[u] holds the pack as stored, h[u * VEC + j] its values,
// 0 past the row end or for an inactive row. Returns how many packs are valid: those with
// index < packs, a prefix of u because the indices increase with u.
template <typename T, int VEC, int UNROLL>
__device__ __forceinline__ int load_h(const FwdArgs<T>& a, int64_t row, bool active, int first, int stride,
                                      int packs, float (&h)[UNROLL * VEC], Pack<T, VEC> (&hp)[UNROLL]) {
  using P = Pack<T, VEC>;
  P rp[UNROLL];
  int valid = 0;
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {  // all loads first
    const int p = first + u * stride;
    if (active && p < packs) {
      hp[u] = reinterpret_cast<const P*>(a.x + row * a.x_stride)[p];
      if (a.res) rp[u] = reinterpret_cast<const P*>(a.res + row * a.res_stride)[p];
      ++valid;
    }
  }
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    if (u < valid) {
      if (a.res) {
        float s[VEC], t[VEC];
        unpack(hp[u], s);
        unpack(rp[u], t);
#pragma unroll
        for (int j = 0; j < VEC; ++j) s[j] += t[j];
        hp[u] = pack<T, VEC>(s);  // rounded once to T; the norm sees what is stored
        reinterpret_cast<P*>(a.res_out + row * a.cols)[first + u * stride] = hp[u];
      }
      unpack(hp[u], &h[u * VEC]);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) h[u * VEC + j] = 0.f;
    }
  }
  return valid;
}

// y for pack p of row `row` from its h values.
template <typename T, int VEC>
__device__ __forceinline__ void store_y(const FwdArgs<T>& a, int64_t row, int p, const float* h, RowStats st) {
  float w[VEC], b[VEC], o[VEC];
  if (a.w) load_param<VEC>(a.w, a.w_type, static_cast<int64_t>(p) * VEC, w);
  if (a.b) load_param<VEC>(a.b, a.b_type, static_cast<int64_t>(p) * VEC, b);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    float v = (h[j] - st.mean) * st.rstd;
    if (a.w) v *= w[j] + a.offset;
    if (a.b) v += b[j];
    o[j] = v;
  }
  reinterpret_cast<Pack<T, VEC>*>(a.y + row * a.cols)[p] = pack<T, VEC>(o);
}

// Paths (a) and (b): GROUP lanes per row (GROUP = 0: the whole block, blockDim.x a multiple
// of 32), PACKS packs per lane: pack lane + u * lanes, u < PACKS. The caller guarantees
// lanes * PACKS * VEC >= cols. The row loop is uniform over the block, so every lane
// reaches every shuffle and barrier; inactive rows run with zeros and store nothing.
template <typename T, int VEC, int PACKS, int GROUP>
__global__ void __launch_bounds__(GROUP > 0 ? kFwdWarpThreads : kFwdMaxBlockThreads, 1)
    norm_fwd_regs_kernel(const FwdArgs<T> a) {
  constexpr int N = PACKS * VEC;
  __shared__ MeanM2 scratch[kWarpSize];
  const int lanes = GROUP > 0 ? GROUP : static_cast<int>(blockDim.x);
  const int lane = static_cast<int>(threadIdx.x) % lanes, group = static_cast<int>(threadIdx.x) / lanes;
  const int groups = static_cast<int>(blockDim.x) / lanes, packs = a.cols / VEC;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * groups; base < a.rows;
       base += static_cast<int64_t>(gridDim.x) * groups) {
    const int64_t row = base + group;
    const bool active = row < a.rows;
    float h[N];
    Pack<T, VEC> hp[PACKS];
    const int valid = load_h<T, VEC, PACKS>(a, row, active, lane, lanes, packs, h, hp);
    MeanM2 s = chunk_stats<N>(h, valid * VEC, a.rms);
    if constexpr (GROUP > 0) {
      s = s.template allreduce<GROUP>();
    } else {
      s = block_allreduce(s, scratch);
    }
    const RowStats st = finish_stats(s, a.cols, a.eps, a.rms);
    if (active && lane == 0) {
      if (a.mean) a.mean[row] = st.mean;
      a.rstd[row] = st.rstd;
    }
#pragma unroll
    for (int u = 0; u < PACKS; ++u) {
      if (u < valid) {  // from the packs: h is dead after the statistics (fewer registers for 16-bit T)
        float hv[VEC];
        unpack(hp[u], hv);
        store_y<T, VEC>(a, row, lane + u * lanes, hv, st);
      }
    }
  }
}

// Path (c): a block per row, grid-stride. Thread t handles packs t + i * blockDim.x, UNROLL
// of them per step, in both passes: the same thread writes and later reads each shared
// memory slot (and each residual_out pack), so no barrier orders them.
template <typename T, int VEC, bool SMEM>
__global__ void __launch_bounds__(kLongThreads, 1) norm_fwd_long_kernel(const FwdArgs<T> a) {
  constexpr int UNROLL = kLongStepBytes / static_cast<int>(sizeof(T)) / VEC, N = UNROLL * VEC;
  using P = Pack<T, VEC>;
  __shared__ MeanM2 scratch[kWarpSize];
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  P* const cache = reinterpret_cast<P*>(dynamic_smem);  // [packs] when SMEM
  const int packs = a.cols / VEC, stride = static_cast<int>(blockDim.x), step = stride * UNROLL;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    MeanM2 s = MeanM2::identity();
    for (int first = threadIdx.x; first < packs; first += step) {
      float h[N];
      P hp[UNROLL];
      const int valid = load_h<T, VEC, UNROLL>(a, row, true, first, stride, packs, h, hp);
      if constexpr (SMEM) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
          if (u < valid) cache[first + u * stride] = hp[u];
      }
      s = MeanM2::merge(s, chunk_stats<N>(h, valid * VEC, a.rms));
    }
    s = block_allreduce(s, scratch);
    const RowStats st = finish_stats(s, a.cols, a.eps, a.rms);
    if (threadIdx.x == 0) {
      if (a.mean) a.mean[row] = st.mean;
      a.rstd[row] = st.rstd;
    }
    // Pass 2: h again, from shared memory or from what pass 1 read (residual_out / x).
    const P* const src = reinterpret_cast<const P*>(a.res ? a.res_out + row * a.cols : a.x + row * a.x_stride);
    for (int first = threadIdx.x; first < packs; first += step) {
      P hp[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int p = first + u * stride;
        if (p < packs) {
          if constexpr (SMEM) {
            hp[u] = cache[p];
          } else {
            hp[u] = src[p];
          }
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int p = first + u * stride;
        if (p < packs) {
          float h[VEC];
          unpack(hp[u], h);
          store_y<T, VEC>(a, row, p, h, st);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Host side.

// Forward (a): GROUP lanes (4..32) and PACKS per lane for cols (<= kFwdMaxWarpCols).
template <typename T, int VEC, int PACKS, int GROUP>
cudaError_t launch_fwd_warp(const FwdArgs<T>& a, const DeviceLimits& lim, cudaStream_t stream) {
  const int packs = a.cols / VEC;
  if constexpr (GROUP < kWarpSize) {
    if (packs > GROUP) return launch_fwd_warp<T, VEC, 1, GROUP * 2>(a, lim, stream);
  } else if constexpr (PACKS * VEC < kFwdMaxElems) {
    if (packs > PACKS * GROUP) return launch_fwd_warp<T, VEC, PACKS * 2, GROUP>(a, lim, stream);
  }
  constexpr int kRowsPerBlock = kFwdWarpThreads / GROUP;
  const unsigned blocks = grid_size(ceil_div(a.rows, kRowsPerBlock), int64_t{lim.sm_count} * kMaxBlocksPerSm);
  norm_fwd_regs_kernel<T, VEC, PACKS, GROUP><<<blocks, kFwdWarpThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

// Forward (b): ELEMS (8, 16, 32) values per thread; the smallest that keeps the block at
// <= kFwdBlockThreads threads, else 32 (cols <= kFwdMaxRegisterCols: <= 512 threads).
template <typename T, int VEC, int ELEMS>
cudaError_t launch_fwd_block(const FwdArgs<T>& a, const DeviceLimits& lim, cudaStream_t stream) {
  const int threads = round_up_to_warp(ceil_div(a.cols, ELEMS));  // threads * ELEMS >= cols
  if constexpr (ELEMS < kFwdMaxElems) {
    if (threads > kFwdBlockThreads) return launch_fwd_block<T, VEC, ELEMS * 2>(a, lim, stream);
  }
  const int per_sm = 2048 / threads;  // threads <= 512: >= 4
  const unsigned blocks = grid_size(a.rows, int64_t{lim.sm_count} * per_sm);
  norm_fwd_regs_kernel<T, VEC, ELEMS / VEC, 0><<<blocks, threads, 0, stream>>>(a);
  return cudaGetLastError();
}

// Forward (c).
template <typename T, int VEC>
cudaError_t launch_fwd_long(const FwdArgs<T>& a, const DeviceLimits& lim, cudaStream_t stream) {
  const size_t row_bytes = static_cast<size_t>(a.cols) * sizeof(T);
  const size_t smem_limit = static_cast<size_t>(lim.smem_optin - kReservedSmemBytes);
  if (row_bytes <= smem_limit) {
    static std::atomic<uint64_t> configured{0};
    const cudaError_t err = allow_smem(norm_fwd_long_kernel<T, VEC, true>, row_bytes, lim, configured);
    if (err != cudaSuccess) return err;
    const int64_t per_sm = row_bytes * 2 <= smem_limit ? 2 : 1;
    norm_fwd_long_kernel<T, VEC, true>
        <<<grid_size(a.rows, lim.sm_count * per_sm), kLongThreads, row_bytes, stream>>>(a);
  } else {
    norm_fwd_long_kernel<T, VEC, false><<<grid_size(a.rows, int64_t{lim.sm_count} * 2), kLongThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename T, int VEC>
cudaError_t launch_fwd_with_width(const FwdArgs<T>& a, const DeviceLimits& lim, cudaStream_t stream) {
  if (a.cols <= kFwdMaxWarpCols) return launch_fwd_warp<T, VEC, 1, 4>(a, lim, stream);
  if (a.cols <= kFwdMaxRegisterCols) return launch_fwd_block<T, VEC, (8 > VEC ? 8 : VEC)>(a, lim, stream);
  return launch_fwd_long<T, VEC>(a, lim, stream);
}

template <typename T>
cudaError_t launch_forward(const NormForwardArgs& args, cudaStream_t stream) {
  constexpr int kVec = kVectorBytes / sizeof(T);
  FwdArgs<T> a{};
  a.x = static_cast<const T*>(args.x);
  a.res = static_cast<const T*>(args.residual);
  a.x_stride = args.x_row_stride;
  a.res_stride = args.residual_row_stride;
  a.w = args.weight;
  a.b = args.bias;
  a.w_type = static_cast<int>(args.weight_dtype);
  a.b_type = static_cast<int>(args.bias_dtype);
  a.y = static_cast<T*>(args.y);
  a.res_out = static_cast<T*>(args.residual_out);
  a.mean = args.rms ? nullptr : args.mean;
  a.rstd = args.rstd;
  a.rows = args.rows;
  a.cols = static_cast<int>(args.cols);
  a.eps = args.eps;
  a.offset = args.offset;
  a.rms = args.rms;
  // Packs never straddle a row end or a misaligned address: every base 16-byte aligned,
  // and cols and each row stride whole packs, so row * stride + p * kVec stays aligned.
  // The weight / bias loads at p * kVec elements are then aligned too (row_common load_floats).
  const bool vectorizable = args.cols % kVec == 0 && aligned(a.x) && a.x_stride % kVec == 0 && aligned(a.y) &&
                            (!a.res || (aligned(a.res) && a.res_stride % kVec == 0 && aligned(a.res_out))) &&
                            (!a.w || aligned(a.w)) && (!a.b || aligned(a.b));
  DeviceLimits lim;
  const cudaError_t err = current_device_limits(&lim);
  if (err != cudaSuccess) return err;
  return vectorizable ? launch_fwd_with_width<T, kVec>(a, lim, stream) : launch_fwd_with_width<T, 1>(a, lim, stream);
}

}  // namespace

cudaError_t norm_forward(const NormForwardArgs& args, cudaStream_t stream) {
  if (args.rows < 0 || args.cols < 0 || args.cols > kMaxCols || args.x_row_stride < 0 ||
      args.residual_row_stride < 0 || !valid_dtype(args.dtype) || !valid_dtype(args.weight_dtype) ||
      !valid_dtype(args.bias_dtype))
    return cudaErrorInvalidValue;
  if (args.rows == 0 || args.cols == 0) return cudaSuccess;
  if (!args.x || !args.y || !args.rstd || (args.residual && !args.residual_out)) return cudaErrorInvalidValue;
  switch (args.dtype) {
    case DType::kFloat32: return launch_forward<float>(args, stream);
    case DType::kFloat16: return launch_forward<__half>(args, stream);
    case DType::kBFloat16: return launch_forward<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda_norms
}  // namespace kernelforge
