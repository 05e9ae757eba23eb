// Softmax / log-softmax forward and backward over matrix rows (see softmax_cuda.h).
//
// Memory bound: the goal is to move every DRAM byte the minimum number of times, with
// 16-byte accesses and enough bytes in flight. One kernel family, templated on the element
// type T (float, __half, __nv_bfloat16), the vector width VEC (16 / sizeof(T), or 1 for
// unaligned data) and an Op saying what a row computes (ForwardOp: softmax / log_softmax;
// BackwardOp: their gradients). Math is fp32; outputs are rounded once. Paths by cols:
//   (a) cols <= 1024: 1..32 threads per row, row in registers, shuffle reductions;
//   (b) the row fits in shared memory: a block per row, row read from DRAM once;
//   (c) longer rows: a block per row, online max/sum sweep, then a second read of the row.
// The row statistics and Ops live in softmax_row_ops.cuh; this file holds the three paths and
// their launchers.
#include "softmax_cuda.h"

#include "row_common.cuh"
#include "softmax_row_ops.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace kernelforge {
namespace cuda_softmax {
namespace {

using namespace row_common;  // conversions, packs, reductions, cp.async, device limits

constexpr int kVectorBytes = 16;            // one LDG.128 / STG.128 per pack
constexpr int kMaxRegisterCols = 1024;      // (a): <= 32 elements per thread and input
constexpr int kMaxRegisterElems = 32;
constexpr int kRegisterPathThreads = 128;   // (a): 4 warps, 4..128 rows per block
constexpr int kMinRowBlockThreads = 128;    // (b): block size grows with cols ...
constexpr int kMaxRowBlockThreads = 512;    //      ... to this
constexpr int kSmemPacksPerThread = 8;      // (b): block size target
constexpr int kSmemStepElems = 16;          // (b): elements per thread and step, all inputs
constexpr int kDoubleBufferBytes = 56 * 1024;  // (b): two rows in flight per block up to this
constexpr int kStreamThreads = 512;         // (c): block size, one block per SM
constexpr int kStreamStages = 4;            // (c): cp.async ring depth
constexpr int kStreamStageBytes = 64;       // (c): bytes per thread and stage, all inputs
constexpr int kMaxPacksPerStep = 8;         // (b), (c): register budget per step
constexpr int kMaxBlocksPerSm = 32;         // grid cap; more rows -> grid-stride loops


// ---------------------------------------------------------------------------------------
// Path (a), cols <= 1024. LANES (1..32) threads own a row, held in their registers (PACKS
// packs of VEC elements per thread and input); reductions are shuffles within the group,
// so short rows keep every lane busy (32 / LANES rows per warp). Each group works on
// ROWS rows at once when a row gives it little to load, to keep enough bytes in flight.
// DRAM bytes per element: forward 2 * sizeof(T) (read x, write y), backward 3 * sizeof(T)
// (read gy and y, write gx): each byte moves once, the minimum.
template <int K, int N>
__host__ __device__ constexpr int rows_per_group() {
  return K * N >= 8 ? 1 : K * N >= 2 ? 8 / (K * N) : 4;
}

template <typename Op, typename T, int VEC, int PACKS, int LANES>
__global__ void __launch_bounds__(kRegisterPathThreads) rows_in_registers_kernel(const RowArgs<T, Op::kInputs> a) {
  constexpr int K = Op::kInputs, N = PACKS * VEC, ROWS = rows_per_group<K, N>();
  constexpr int kGroups = kRegisterPathThreads / LANES, kRowsPerBlock = kGroups * ROWS;
  using P = Pack<T, VEC>;
  const int lane = threadIdx.x % LANES, group = threadIdx.x / LANES;
  const int cols = static_cast<int>(a.cols);
  // The loop is uniform over the block, so every lane reaches every shuffle.
  for (int64_t block_row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; block_row < a.rows;
       block_row += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    float v[ROWS][K][N];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = block_row + r * kGroups + group;
#pragma unroll
      for (int p = 0; p < PACKS; ++p) {
        const int col = (p * LANES + lane) * VEC;
#pragma unroll
        for (int k = 0; k < K; ++k) {
          if (row < a.rows && col < cols) {
            unpack(*reinterpret_cast<const P*>(a.in[k] + row * a.in_stride[k] + col), &v[r][k][p * VEC]);
          } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[r][k][p * VEC + j] = Op::kPad;
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = block_row + r * kGroups + group;
      const auto epilogue = Op::template reduce_in_registers<LANES>(v[r], a.log);
#pragma unroll
      for (int p = 0; p < PACKS; ++p) {
        const int col = (p * LANES + lane) * VEC;
        if (row < a.rows && col < cols) {
          float o[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] = Op::apply(epilogue, v[r], p * VEC + j);
          *reinterpret_cast<P*>(a.out + row * a.cols + col) = pack<T, VEC>(o);
        }
      }
    }
  }
}

// Packs per thread, input and step of paths (b)/(c): ELEMS elements over all K inputs.
template <int K, int VEC, int ELEMS>
__host__ __device__ constexpr int unroll_for() {
  constexpr int packs = ELEMS / (K * VEC) > 0 ? ELEMS / (K * VEC) : 1;
  return packs < kMaxPacksPerStep / K ? packs : kMaxPacksPerStep / K;
}

// One step of paths (b)/(c): v[k][u * VEC + j] = element j of pack p = first + u * blockDim.x
// of input k, read with load(k, u, p), or Op::kPad past the row end. Loads go out first.
template <typename Op, typename P, int UNROLL, typename Load>
__device__ __forceinline__ void load_step(float (&v)[Op::kInputs][UNROLL * P::kVec], int first, int packs, Load load) {
  P raw[Op::kInputs][UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u)
#pragma unroll
    for (int k = 0; k < Op::kInputs; ++k)
      if (first + u * static_cast<int>(blockDim.x) < packs) raw[k][u] = load(k, u, first + u * blockDim.x);
#pragma unroll
  for (int u = 0; u < UNROLL; ++u)
#pragma unroll
    for (int k = 0; k < Op::kInputs; ++k) {
      if (first + u * static_cast<int>(blockDim.x) < packs) {
        unpack(raw[k][u], &v[k][u * P::kVec]);
      } else {
#pragma unroll
        for (int j = 0; j < P::kVec; ++j) v[k][u * P::kVec + j] = Op::kPad;
      }
    }
}

template <typename Op, typename P, int UNROLL, typename Epilogue>
__device__ __forceinline__ void store_step(P* out, const float (&v)[Op::kInputs][UNROLL * P::kVec], int first,
                                           int packs, const Epilogue& epilogue) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int p = first + u * static_cast<int>(blockDim.x);
    if (p < packs) {
      float o[P::kVec];
#pragma unroll
      for (int j = 0; j < P::kVec; ++j) o[j] = Op::apply(epilogue, v, u * P::kVec + j);
      out[p] = pack<typename P::Elem, P::kVec>(o);
    }
  }
}

// Path (b), 1024 < cols and the row (all K inputs) fits in the opt-in shared memory (227 KB
// on H100/H200: forward up to 57856 fp32 / 115712 fp16 columns, backward half of that).
// One block per row, grid-stride over rows. Each thread cp.async-copies its own packs
// (tid, tid + blockDim, ...) into shared memory, so the whole row is in flight at once at
// no register cost. Sweep 1 reads them back into the row statistics; one block reduction;
// sweep 2 reads them again, stores the output and refills each slot with the same pack of
// a later row, overlapping those loads with this row's work. `buffers` (1 or 2) rows are
// resident; only the owning thread touches a slot, so no barrier guards them. (Unaligned
// 2-byte rows cannot use cp.async: they are copied in plain batches, a whole row at a time.)
// DRAM bytes per element: the minimum, forward 2 * sizeof(T), backward 3 * sizeof(T).
template <typename Op, typename T, int VEC>
__global__ void __launch_bounds__(kMaxRowBlockThreads)
    row_in_smem_kernel(const RowArgs<T, Op::kInputs> a, int buffers) {
  constexpr int K = Op::kInputs, UNROLL = unroll_for<K, VEC, kSmemStepElems>();
  using P = Pack<T, VEC>;
  __shared__ typename Op::Stats scratch[kWarpSize];
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  P* const cache = reinterpret_cast<P*>(dynamic_smem);  // [buffers][K][packs]
  const int packs = static_cast<int>(a.cols / VEC), step = blockDim.x * UNROLL;
  constexpr bool kAsync = sizeof(P) >= 4;  // else (2-byte, unaligned) plain batched copies
  const auto input = [&](int k, int64_t row) { return reinterpret_cast<const P*>(a.in[k] + row * a.in_stride[k]); };
  const auto copy_in = [&](int buffer, int64_t row, int p) {
#pragma unroll
    for (int k = 0; k < K; ++k)
      if constexpr (kAsync) copy_to_smem_async(&cache[(buffer * K + k) * packs + p], input(k, row) + p);
  };
  const auto copy_row = [&](int buffer, int64_t row) {
    if (row < a.rows) {
      if constexpr (kAsync) {
#pragma unroll 4
        for (int p = threadIdx.x; p < packs; p += blockDim.x) copy_in(buffer, row, p);
      } else {
#pragma unroll
        for (int k = 0; k < K; ++k)
          copy_to_smem_batched<16>(cache + (buffer * K + k) * packs, input(k, row), threadIdx.x, blockDim.x, packs);
      }
    }
    commit_async_copies();
  };
  for (int buffer = 0; buffer < buffers; ++buffer)
    copy_row(buffer, blockIdx.x + static_cast<int64_t>(buffer) * gridDim.x);
  int buffer = 0;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    if (buffers == 2) wait_async_copies<1>(); else wait_async_copies<0>();  // `row` landed
    const P* const cached = cache + buffer * K * packs;
    const auto load = [&](int k, int, int p) { return cached[k * packs + p]; };
    typename Op::Stats stats = Op::Stats::identity();
    for (int first = threadIdx.x; first < packs; first += step) {
      float v[K][UNROLL * VEC];
      load_step<Op, P, UNROLL>(v, first, packs, load);
      Op::accumulate(stats, v, a.log);
    }
    const auto epilogue = Op::finish(block_allreduce(stats, scratch), a.log);
    const int64_t refill_row = row + static_cast<int64_t>(buffers) * gridDim.x;
    P* const out = reinterpret_cast<P*>(a.out + row * a.cols);
    for (int first = threadIdx.x; first < packs; first += step) {
      float v[K][UNROLL * VEC];
      load_step<Op, P, UNROLL>(v, first, packs, load);
      if (kAsync && refill_row < a.rows) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
          if (first + u * static_cast<int>(blockDim.x) < packs) copy_in(buffer, refill_row, first + u * blockDim.x);
      }
      store_step<Op, P, UNROLL>(out, v, first, packs, epilogue);
    }
    if (kAsync) commit_async_copies(); else copy_row(buffer, refill_row);
    buffer = buffer + 1 == buffers ? 0 : buffer + 1;
  }
}

// Path (c), rows too long for shared memory. One block per row and per SM, grid-stride over
// rows. Each sweep streams the row through a per-thread ring of kStreamStages shared-memory
// slots filled by cp.async, keeping (kStreamStages - 1) * kStreamStageBytes per thread in
// flight at no register cost. Sweep 1 folds the row into its statistics (for the forward
// the online max/sum: one pass finds both); one block reduction; sweep 2 streams the inputs
// again and stores the output. DRAM bytes per element: forward 3 * sizeof(T), backward
// 5 * sizeof(T), less what sweep 2 finds in L2 (one row per SM keeps the set small).
template <typename Op, typename P, int UNROLL, typename Consume>
__device__ __forceinline__ void stream_row(const RowArgs<typename P::Elem, Op::kInputs>& a, int64_t row, P* ring,
                                           Consume consume) {
  constexpr int K = Op::kInputs, S = kStreamStages;
  const int packs = static_cast<int>(a.cols / P::kVec), step = blockDim.x * UNROLL;
  const auto global = [&](int k, int, int p) { return reinterpret_cast<const P*>(a.in[k] + row * a.in_stride[k]) + p; };
  if constexpr (sizeof(P) < 4) {  // unaligned 2-byte elements: no cp.async, plain loads
    for (int first = threadIdx.x; first < packs; first += step) {
      float v[K][UNROLL * P::kVec];
      load_step<Op, P, UNROLL>(v, first, packs, [&](int k, int u, int p) { return *global(k, u, p); });
      consume(v, first);
    }
  } else {
    // Slot (stage, k, u) of this thread; only this thread touches it, so no barriers.
    const auto slot = [&](int stage, int k, int u) {
      return ring + ((stage * K + k) * UNROLL + u) * blockDim.x + threadIdx.x;
    };
    const auto issue = [&](int i) {  // start loading step i
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const int p = threadIdx.x + i * step + u * blockDim.x;
          if (p < packs) copy_to_smem_async(slot(i % S, k, u), global(k, u, p));
        }
      commit_async_copies();
    };
#pragma unroll
    for (int i = 0; i < S - 1; ++i) issue(i);
    for (int i = 0, first = threadIdx.x; first < packs; ++i, first += step) {
      issue(i + S - 1);  // refills the slots consumed in step i - 1
      wait_async_copies<S - 1>();  // step i landed
      float v[K][UNROLL * P::kVec];
      load_step<Op, P, UNROLL>(v, first, packs, [&](int k, int u, int) { return *slot(i % S, k, u); });
      consume(v, first);
    }
  }
}

template <typename Op, typename T, int VEC>
__global__ void __launch_bounds__(kStreamThreads, 1) row_streamed_kernel(const RowArgs<T, Op::kInputs> a) {
  constexpr int K = Op::kInputs, UNROLL = unroll_for<K, VEC, kStreamStageBytes / sizeof(T)>();
  using P = Pack<T, VEC>;
  __shared__ typename Op::Stats scratch[kWarpSize];
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  P* const ring = reinterpret_cast<P*>(dynamic_smem);  // [kStreamStages][K][UNROLL][blockDim]
  const int packs = static_cast<int>(a.cols / VEC);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    typename Op::Stats stats = Op::Stats::identity();
    stream_row<Op, P, UNROLL>(a, row, ring, [&](const float(&v)[K][UNROLL * VEC], int) {
      Op::accumulate(stats, v, a.log);
    });
    const auto epilogue = Op::finish(block_allreduce(stats, scratch), a.log);
    P* const out = reinterpret_cast<P*>(a.out + row * a.cols);
    stream_row<Op, P, UNROLL>(a, row, ring, [&](const float(&v)[K][UNROLL * VEC], int first) {
      store_step<Op, P, UNROLL>(out, v, first, packs, epilogue);
    });
  }
}

// ---------------------------------------------------------------------------------------
// Host side.

// Path (a): picks LANES (threads per row) and PACKS (packs per thread) for cols.
template <typename Op, typename T, int VEC, int PACKS, int LANES>
cudaError_t launch_rows_in_registers(const RowArgs<T, Op::kInputs>& a, const DeviceLimits& lim, cudaStream_t stream) {
  const int64_t packs = (a.cols + VEC - 1) / VEC;
  if constexpr (LANES < kWarpSize) {
    if (packs > LANES) return launch_rows_in_registers<Op, T, VEC, 1, LANES * 2>(a, lim, stream);
  } else if constexpr (PACKS * VEC < kMaxRegisterElems) {
    if (packs > PACKS * LANES) return launch_rows_in_registers<Op, T, VEC, PACKS * 2, LANES>(a, lim, stream);
  }
  constexpr int kRowsPerBlock = kRegisterPathThreads / LANES * rows_per_group<Op::kInputs, PACKS * VEC>();
  const unsigned blocks =
      grid_size((a.rows + kRowsPerBlock - 1) / kRowsPerBlock, int64_t{lim.sm_count} * kMaxBlocksPerSm);
  rows_in_registers_kernel<Op, T, VEC, PACKS, LANES><<<blocks, kRegisterPathThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename Op, typename T, int VEC>
cudaError_t launch_row_in_smem(const RowArgs<T, Op::kInputs>& a, const DeviceLimits& lim, cudaStream_t stream) {
  static std::atomic<uint64_t> configured{0};
  const size_t row_bytes = static_cast<size_t>(Op::kInputs) * a.cols * sizeof(T);
  const int buffers = 2 * row_bytes <= kDoubleBufferBytes ? 2 : 1;
  const cudaError_t err = allow_smem(row_in_smem_kernel<Op, T, VEC>, buffers * row_bytes, lim, configured);
  if (err != cudaSuccess) return err;
  int threads = kMinRowBlockThreads;  // ~kSmemPacksPerThread packs per thread
  while (threads < kMaxRowBlockThreads && static_cast<int64_t>(threads) * kSmemPacksPerThread * VEC < a.cols)
    threads *= 2;
  row_in_smem_kernel<Op, T, VEC><<<grid_size(a.rows, int64_t{lim.sm_count} * kMaxBlocksPerSm), threads,
                                   buffers * row_bytes, stream>>>(a, buffers);
  return cudaGetLastError();
}

template <typename Op, typename T, int VEC>
cudaError_t launch_row_streamed(const RowArgs<T, Op::kInputs>& a, const DeviceLimits& lim, cudaStream_t stream) {
  static std::atomic<uint64_t> configured{0};
  constexpr int UNROLL = unroll_for<Op::kInputs, VEC, kStreamStageBytes / sizeof(T)>();
  const size_t smem_bytes =  // the ring; unaligned 2-byte rows load directly
      sizeof(T) * VEC < 4 ? 0 : sizeof(Pack<T, VEC>) * kStreamStages * Op::kInputs * UNROLL * kStreamThreads;
  const cudaError_t err = allow_smem(row_streamed_kernel<Op, T, VEC>, smem_bytes, lim, configured);
  if (err != cudaSuccess) return err;
  row_streamed_kernel<Op, T, VEC><<<grid_size(a.rows, lim.sm_count), kStreamThreads, smem_bytes, stream>>>(a);
  return cudaGetLastError();
}

template <typename Op, typename T, int VEC>
cudaError_t launch_with_width(const RowArgs<T, Op::kInputs>& a, const DeviceLimits& lim, cudaStream_t stream) {
  if (a.cols <= kMaxRegisterCols) return launch_rows_in_registers<Op, T, VEC, 1, 1>(a, lim, stream);
  const int64_t row_bytes = Op::kInputs * a.cols * static_cast<int64_t>(sizeof(T));
  if (row_bytes <= lim.smem_optin - kReservedSmemBytes) return launch_row_in_smem<Op, T, VEC>(a, lim, stream);
  return launch_row_streamed<Op, T, VEC>(a, lim, stream);
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
