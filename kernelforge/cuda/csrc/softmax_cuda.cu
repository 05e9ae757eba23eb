// Softmax / log-softmax forward and backward over matrix rows (see softmax_cuda.h).
//
// The kernels are memory bound, so the design goal is to touch every byte of DRAM the
// minimum number of times with 16-byte accesses and enough loads in flight. One kernel
// family, templated on the element type T (float, __half, __nv_bfloat16), on the vector
// width VEC (16 / sizeof(T), or 1 for unaligned data) and on an Op that says what a row
// computes (ForwardOp: softmax / log_softmax; BackwardOp: their gradients). Paths by cols:
//   (a) cols <= 1024:  1..32 threads per row, row in registers, warp-shuffle reductions;
//   (b) row fits in shared memory: one block per row, row read once and parked in smem;
//   (c) longer rows:   one block per row, online softmax pass + a second read of the row.
#include "softmax_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace kernelforge {
namespace cuda_softmax {
namespace {

constexpr int kWarpSize = 32;
constexpr int kVectorBytes = 16;           // one LDG.128 / STG.128 per pack
constexpr int kMaxRegisterCols = 1024;     // path (a) limit: at most 32 elements per thread
constexpr int kMaxRegisterElems = 32;      //   and input, held in registers
constexpr int kRegisterPathThreads = 128;  // path (a) block: 4 warps, 4..128 rows
constexpr int kMinRowBlockThreads = 128;   // paths (b), (c): block size grows with cols
constexpr int kMaxRowBlockThreads = 512;
constexpr int kElemsInFlight = 32;         // (b), (c): elements loaded per thread per step
constexpr int kReservedSmemBytes = 1024;   // (b): static reduction scratch + slack
constexpr int kMaxBlocksPerSm = 32;        // grid cap: more rows -> grid-stride loop
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -__builtin_huge_valf();

// exp(d) = exp2(d * log2(e)): FMUL + MUFU.EX2. Error <= 2 ulp (exp2f) + |d| / 2 ulp (the
// product's rounding), i.e. ~2.5 ulp for the entries that dominate a row (d in [-1, 0]).
__device__ __forceinline__ float exp_of(float d) { return exp2f(d * kLog2e); }

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// VEC consecutive elements moved by one memory instruction (16 bytes for the vector path).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
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
#pragma unroll
  for (int j = 0; j < VEC; ++j) p.v[j] = from_float<T>(in[j]);
  return p;
}

// ---------------------------------------------------------------------------------------
// Row statistics. Each kind has identity(), merge() and shfl_xor() for the reductions;
// merge is commutative bit for bit, so every lane of a butterfly ends with the same value.

// Forward: max of the values and sum of exp(v - max), updated online (one pass). The exp
// reference is the max, or 0 while the max is still -inf, so -inf entries contribute 0 and
// never exp(-inf - -inf) = NaN. A row that is -inf everywhere still ends with max = -inf
// and produces NaN in the epilogue's x - max, exactly like torch.softmax.
struct MaxExpSum {
  float max_value, exp_sum;
  __device__ static MaxExpSum identity() { return {kNegInf, 0.f}; }
  __device__ static float reference(float m) { return m == kNegInf ? 0.f : m; }

  template <int N>
  __device__ void add(const float* v) {
    float m = max_value;
#pragma unroll
    for (int j = 0; j < N; ++j) m = fmaxf(m, v[j]);
    const float ref = reference(m);
    float chunk_sum = 0.f;
#pragma unroll
    for (int j = 0; j < N; ++j) chunk_sum += exp_of(v[j] - ref);
    exp_sum = exp_sum * exp_of(max_value - ref) + chunk_sum;
    max_value = m;
  }
  __device__ void merge(const MaxExpSum& o) {
    const float m = fmaxf(max_value, o.max_value);
    const float ref = reference(m);
    // __fmul_rn: no FMA contraction, so merge(a, b) == merge(b, a) exactly.
    exp_sum = __fmul_rn(exp_sum, exp_of(max_value - ref)) + __fmul_rn(o.exp_sum, exp_of(o.max_value - ref));
    max_value = m;
  }
  __device__ MaxExpSum shfl_xor(int mask, int width) const {
    return {__shfl_xor_sync(0xffffffffu, max_value, mask, width), __shfl_xor_sync(0xffffffffu, exp_sum, mask, width)};
  }
};

// Backward: a plain sum (of gy * y for softmax, of gy for log_softmax).
struct Sum {
  float value;
  __device__ static Sum identity() { return {0.f}; }
  __device__ void merge(const Sum& o) { value += o.value; }
  __device__ Sum shfl_xor(int mask, int width) const {
    return {__shfl_xor_sync(0xffffffffu, value, mask, width)};
  }
};

// ---------------------------------------------------------------------------------------
// Ops: the inputs of a row, the value that pads lanes past the row end (it must not change
// the statistics), how values accumulate, and the per-element output once the row's
// statistics are known. v[k][j] is element j of input k held by this thread.

struct ForwardOp {
  static constexpr int kInputs = 1;  // x
  static constexpr float kPad = kNegInf;
  using Stats = MaxExpSum;
  struct Epilogue {
    float max_value, scale;  // scale: 1 / sum (softmax) or log(sum) (log_softmax)
    bool log;
  };
  template <int N>
  __device__ static void accumulate(Stats& s, const float (&v)[1][N], bool) { s.add<N>(v[0]); }
  __device__ static Epilogue finish(const Stats& s, bool log) {
    return {s.max_value, log ? logf(s.exp_sum) : 1.f / s.exp_sum, log};
  }
  template <int N>
  __device__ static float apply(const Epilogue& e, const float (&v)[1][N], int j) {
    const float d = v[0][j] - e.max_value;
    return e.log ? d - e.scale : exp_of(d) * e.scale;
  }
};

struct BackwardOp {
  static constexpr int kInputs = 2;  // grad_out, out
  static constexpr float kPad = 0.f;
  using Stats = Sum;
  struct Epilogue {
    float sum;
    bool log;
  };
  template <int N>
  __device__ static void accumulate(Stats& s, const float (&v)[2][N], bool log) {
#pragma unroll
    for (int j = 0; j < N; ++j) s.value += log ? v[0][j] : v[0][j] * v[1][j];
  }
  __device__ static Epilogue finish(const Stats& s, bool log) { return {s.value, log}; }
  template <int N>
  __device__ static float apply(const Epilogue& e, const float (&v)[2][N], int j) {
    const float gy = v[0][j], y = v[1][j];
    return e.log ? gy - exp_of(y) * e.sum : y * (gy - e.sum);
  }
};

template <typename T, int K>
struct RowArgs {
  const T* in[K];        // ForwardOp: {x}; BackwardOp: {grad_out, out}
  int64_t in_stride[K];  // row strides, in elements
  T* out;                // dense: row stride == cols
  int64_t rows, cols;
  bool log;
};

// Reduction over aligned groups of WIDTH lanes; every lane gets the group's result.
template <int WIDTH, typename Stats>
__device__ __forceinline__ Stats group_allreduce(Stats s) {
#pragma unroll
  for (int mask = WIDTH / 2; mask > 0; mask /= 2) s.merge(s.shfl_xor(mask, WIDTH));
  return s;
}

// Block-wide reduction; every thread gets the result. blockDim.x is a multiple of 32.
template <typename Stats>
__device__ __forceinline__ Stats block_allreduce(Stats s, Stats* scratch) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  s = group_allreduce<kWarpSize>(s);
  __syncthreads();  // the previous row's readers are done with scratch
  if (lane == 0) scratch[warp] = s;
  __syncthreads();
  s = lane < static_cast<int>(blockDim.x / kWarpSize) ? scratch[lane] : Stats::identity();
  return group_allreduce<kWarpSize>(s);  // every warp reduces the partials identically
}

// ---------------------------------------------------------------------------------------
// Path (a), cols <= 1024. LANES (1..32) threads own one row, which lives in their registers
// (PACKS packs of VEC elements per thread and input); reductions are shuffles within the
// LANES group, so short rows still keep every lane busy (32 / LANES rows per warp).
// DRAM bytes per element: forward 2 * sizeof(T) (read x, write y), backward 3 * sizeof(T)
// (read gy and y, write gx) -- each byte moves once, the minimum possible.
template <typename Op, typename T, int VEC, int PACKS, int LANES>
__global__ void __launch_bounds__(kRegisterPathThreads) rows_in_registers_kernel(const RowArgs<T, Op::kInputs> a) {
  constexpr int K = Op::kInputs, N = PACKS * VEC;
  constexpr int kRowsPerWarp = kWarpSize / LANES, kRowsPerBlock = kRegisterPathThreads / LANES;
  using P = Pack<T, VEC>;
  const int lane = threadIdx.x % LANES;
  const int cols = static_cast<int>(a.cols);
  // The loop runs per warp (not per row) so that every lane reaches every shuffle.
  for (int64_t warp_row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpSize * kRowsPerWarp;
       warp_row < a.rows; warp_row += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t row = warp_row + threadIdx.x % kWarpSize / LANES;
    const bool row_valid = row < a.rows;
    float v[K][N];
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      const int col = (p * LANES + lane) * VEC;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (row_valid && col < cols) {
          unpack(*reinterpret_cast<const P*>(a.in[k] + row * a.in_stride[k] + col), &v[k][p * VEC]);
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) v[k][p * VEC + j] = Op::kPad;
        }
      }
    }
    typename Op::Stats stats = Op::Stats::identity();
    Op::accumulate(stats, v, a.log);
    const auto epilogue = Op::finish(group_allreduce<LANES>(stats), a.log);
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      const int col = (p * LANES + lane) * VEC;
      if (row_valid && col < cols) {
        float o[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) o[j] = Op::apply(epilogue, v, p * VEC + j);
        *reinterpret_cast<P*>(a.out + row * a.cols + col) = pack<T, VEC>(o);
      }
    }
  }
}

template <int K, int VEC>
__host__ __device__ constexpr int unroll_for() {
  return kElemsInFlight / (K * VEC) > 0 ? kElemsInFlight / (K * VEC) : 1;
}

// Paths (b) and (c), cols > 1024: one block per row (grid-stride over rows), two sweeps.
//   sweep 1: UNROLL packs per thread and input in flight, accumulate the row statistics
//            (online max + sum of exp for the forward, the dot/sum for the backward);
//   one block reduction (shuffles + a shared-memory exchange);
//   sweep 2: compute and store the output.
// (b) kRowInSmem: sweep 1 also parks the raw row in dynamic shared memory, sweep 2 reads
//     it back from there (each thread its own packs). DRAM bytes per element stay at the
//     minimum: forward 2 * sizeof(T), backward 3 * sizeof(T). Chosen while
//     K * cols * sizeof(T) fits the opt-in shared memory (~227 KB on H100/H200).
// (c) !kRowInSmem: sweep 2 re-reads the inputs (partly from L2): forward 3 * sizeof(T),
//     backward 5 * sizeof(T). The online max/sum keeps the forward at one extra read.
template <typename Op, typename T, int VEC, bool kRowInSmem>
__global__ void __launch_bounds__(kMaxRowBlockThreads) row_per_block_kernel(const RowArgs<T, Op::kInputs> a) {
  constexpr int K = Op::kInputs, UNROLL = unroll_for<K, VEC>(), N = UNROLL * VEC;
  using P = Pack<T, VEC>;
  using Stats = typename Op::Stats;
  __shared__ Stats scratch[kWarpSize];
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  P* const row_cache = reinterpret_cast<P*>(dynamic_smem);  // K * packs, path (b) only
  const int packs = static_cast<int>(a.cols / VEC);  // cols < 2^31: 32-bit column math
  const int stride = static_cast<int>(blockDim.x) * UNROLL;

  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const P* in[K];
#pragma unroll
    for (int k = 0; k < K; ++k) in[k] = reinterpret_cast<const P*>(a.in[k] + row * a.in_stride[k]);

    Stats stats = Stats::identity();
    for (int first = threadIdx.x; first < packs; first += stride) {
      P raw[K][UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {  // issue every load before using any
        const int p = first + u * static_cast<int>(blockDim.x);
#pragma unroll
        for (int k = 0; k < K; ++k)
          if (p < packs) raw[k][u] = in[k][p];
      }
      float v[K][N];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int p = first + u * static_cast<int>(blockDim.x);
#pragma unroll
        for (int k = 0; k < K; ++k) {
          if (p < packs) {
            if constexpr (kRowInSmem) row_cache[k * packs + p] = raw[k][u];
            unpack(raw[k][u], &v[k][u * VEC]);
          } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[k][u * VEC + j] = Op::kPad;
          }
        }
      }
      Op::accumulate(stats, v, a.log);
    }
    const auto epilogue = Op::finish(block_allreduce(stats, scratch), a.log);

    P* const out = reinterpret_cast<P*>(a.out + row * a.cols);
    for (int first = threadIdx.x; first < packs; first += stride) {
      float v[K][N];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int p = first + u * static_cast<int>(blockDim.x);
#pragma unroll
        for (int k = 0; k < K; ++k) {
          if (p < packs) {
            unpack(kRowInSmem ? row_cache[k * packs + p] : in[k][p], &v[k][u * VEC]);
          } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[k][u * VEC + j] = Op::kPad;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int p = first + u * static_cast<int>(blockDim.x);
        if (p < packs) {
          float o[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] = Op::apply(epilogue, v, u * VEC + j);
          out[p] = pack<T, VEC>(o);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Host side.

struct DeviceLimits {
  int device, sm_count, smem_optin;
};

// SM count and opt-in shared memory per block of the current device, queried once.
cudaError_t current_device_limits(DeviceLimits* lim) {
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

int64_t grid_size(int64_t work_blocks, const DeviceLimits& lim) {
  const int64_t cap = static_cast<int64_t>(lim.sm_count) * kMaxBlocksPerSm;
  return work_blocks < cap ? work_blocks : cap;
}

// Path (a): picks LANES (threads per row) and PACKS (packs per thread) for cols, then launches.
template <typename Op, typename T, int VEC, int PACKS, int LANES>
cudaError_t launch_rows_in_registers(const RowArgs<T, Op::kInputs>& a, const DeviceLimits& lim, cudaStream_t stream) {
  const int64_t packs = (a.cols + VEC - 1) / VEC;
  if constexpr (LANES < kWarpSize) {
    if (packs > LANES) return launch_rows_in_registers<Op, T, VEC, 1, LANES * 2>(a, lim, stream);
  } else if constexpr (PACKS * VEC < kMaxRegisterElems) {
    if (packs > PACKS * LANES) return launch_rows_in_registers<Op, T, VEC, PACKS * 2, LANES>(a, lim, stream);
  }
  constexpr int kRowsPerBlock = kRegisterPathThreads / LANES;
  const int64_t blocks = grid_size((a.rows + kRowsPerBlock - 1) / kRowsPerBlock, lim);
  rows_in_registers_kernel<Op, T, VEC, PACKS, LANES>
      <<<static_cast<unsigned>(blocks), kRegisterPathThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

// Paths (b) and (c).
template <typename Op, typename T, int VEC, bool kRowInSmem>
cudaError_t launch_row_per_block(const RowArgs<T, Op::kInputs>& a, const DeviceLimits& lim, cudaStream_t stream) {
  constexpr int K = Op::kInputs, UNROLL = unroll_for<K, VEC>();
  const auto kernel = row_per_block_kernel<Op, T, VEC, kRowInSmem>;
  const size_t smem_bytes = kRowInSmem ? static_cast<size_t>(K) * a.cols * sizeof(T) : 0;
  if (smem_bytes > 48 * 1024) {  // beyond the default: opt in, once per device
    static std::atomic<uint64_t> configured_devices{0};
    const uint64_t bit = lim.device < 64 ? uint64_t{1} << lim.device : 0;
    if (bit == 0 || !(configured_devices.load(std::memory_order_relaxed) & bit)) {
      const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   lim.smem_optin - kReservedSmemBytes);
      if (err != cudaSuccess) return err;
      configured_devices.fetch_or(bit, std::memory_order_relaxed);
    }
  }
  // Enough threads for one unrolled step to cover the row, within [128, 512].
  const int64_t packs = a.cols / VEC;
  int threads = kMinRowBlockThreads;
  while (threads < kMaxRowBlockThreads && static_cast<int64_t>(threads) * UNROLL < packs) threads *= 2;
  kernel<<<static_cast<unsigned>(grid_size(a.rows, lim)), threads, smem_bytes, stream>>>(a);
  return cudaGetLastError();
}

template <typename Op, typename T, int VEC>
cudaError_t launch_with_width(const RowArgs<T, Op::kInputs>& a, const DeviceLimits& lim, cudaStream_t stream) {
  if (a.cols <= kMaxRegisterCols) return launch_rows_in_registers<Op, T, VEC, 1, 1>(a, lim, stream);
  const int64_t row_bytes = Op::kInputs * a.cols * static_cast<int64_t>(sizeof(T));
  if (row_bytes <= lim.smem_optin - kReservedSmemBytes) return launch_row_per_block<Op, T, VEC, true>(a, lim, stream);
  return launch_row_per_block<Op, T, VEC, false>(a, lim, stream);
}

template <typename Op, typename T>
cudaError_t launch_typed(const void* const* in, const int64_t* in_stride, void* out, int64_t rows, int64_t cols,
                         bool log, cudaStream_t stream) {
  constexpr int K = Op::kInputs, kVec = kVectorBytes / sizeof(T);
  RowArgs<T, K> a{};
  bool vectorizable = cols % kVec == 0 && reinterpret_cast<uintptr_t>(out) % kVectorBytes == 0;
  for (int k = 0; k < K; ++k) {
    a.in[k] = static_cast<const T*>(in[k]);
    a.in_stride[k] = in_stride[k];
    vectorizable = vectorizable && reinterpret_cast<uintptr_t>(in[k]) % kVectorBytes == 0 && in_stride[k] % kVec == 0;
  }
  a.out = static_cast<T*>(out);
  a.rows = rows;
  a.cols = cols;
  a.log = log;
  DeviceLimits lim;
  const cudaError_t err = current_device_limits(&lim);
  if (err != cudaSuccess) return err;
  return vectorizable ? launch_with_width<Op, T, kVec>(a, lim, stream) : launch_with_width<Op, T, 1>(a, lim, stream);
}

template <typename Op>
cudaError_t launch(DType dtype, const void* const* in, const int64_t* in_stride, void* out, int64_t rows,
                   int64_t cols, bool log, cudaStream_t stream) {
  if (rows < 0 || cols < 0 || cols > INT32_MAX) return cudaErrorInvalidValue;
  for (int k = 0; k < Op::kInputs; ++k)
    if (in_stride[k] < 0) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: return launch_typed<Op, float>(in, in_stride, out, rows, cols, log, stream);
    case DType::kFloat16: return launch_typed<Op, __half>(in, in_stride, out, rows, cols, log, stream);
    case DType::kBFloat16: return launch_typed<Op, __nv_bfloat16>(in, in_stride, out, rows, cols, log, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t softmax_forward(const void* x, int64_t x_row_stride, void* y, int64_t rows, int64_t cols, DType dtype,
                            bool log, cudaStream_t stream) {
  const void* in[1] = {x};
  const int64_t in_stride[1] = {x_row_stride};
  return launch<ForwardOp>(dtype, in, in_stride, y, rows, cols, log, stream);
}

cudaError_t softmax_backward(const void* grad_out, int64_t go_row_stride, const void* out, int64_t out_row_stride,
                             void* grad_in, int64_t rows, int64_t cols, DType dtype, bool log, cudaStream_t stream) {
  const void* in[2] = {grad_out, out};
  const int64_t in_stride[2] = {go_row_stride, out_row_stride};
  return launch<BackwardOp>(dtype, in, in_stride, grad_in, rows, cols, log, stream);
}

}  // namespace cuda_softmax
}  // namespace kernelforge
