// Layer norm / RMS norm backward kernels (device code) for norms_backward.cu, which plans and
// launches them; the paths (a), (b), (c) and their byte counts are described there.
#pragma once

#include "norms_common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace kernelforge {
namespace cuda_norms {
namespace {

constexpr int kBwdWarpThreads = 256;       // (a): block size
constexpr int kBwdMaxElems = 16;           // (a), (b): values per thread
constexpr int kBwdMaxWarpCols = kWarpSize * kBwdMaxElems;  // 512
constexpr int kBwdBlockThreads = 256;      // (b): preferred block size ...
constexpr int kBwdMaxBlockThreads = 512;   //      ... and the largest
constexpr int kBwdMaxRegisterCols = kBwdMaxBlockThreads * kBwdMaxElems;  // 8192
constexpr int kTileThreads = 256;          // (c): block size
constexpr int kTileElems = 8;              // (c): columns per thread
constexpr int kTileCols = kTileThreads * kTileElems;  // 2048 columns per chunk
constexpr int kTileRows = 2;               // (c): rows loaded at once per thread
constexpr int kTileBlocksPerSm = 4;        // (c): grid size target
constexpr int kThreadsPerSm = 1024;        // backward grids: resident threads per SM aimed at

// Two sums (backward: sum(g), sum(g * xhat)); addition commutes, so butterflies agree.
struct Sum2 {
  float a, b;
  __device__ static Sum2 identity() { return {0.f, 0.f}; }
  template <int WIDTH>
  __device__ Sum2 allreduce() const { return {group_sum<WIDTH>(a), group_sum<WIDTH>(b)}; }
};

// ---------------------------------------------------------------------------------------
// Backward.

template <typename T>
struct BwdArgs {
  const T* gy;
  const T* gres;  // null: no grad_residual
  const T* h;
  int64_t gy_stride, gres_stride, h_stride;
  const void* w;  // null: weight 1, no offset
  int w_type;
  const float* mean;  // null for RMS norm
  const float* rstd;
  T* gh;           // dense
  float* part_w;   // [parts, cols] or null
  float* part_b;   // [parts, cols] or null
  float* row_sums;  // path (c): [rows, 2] = sum(g), sum(g * xhat)
  int64_t rows, rows_per_part;
  int cols;
  float offset;
};

// Effective weight (w + offset, or 1) of the valid packs first + u * stride, 0 elsewhere.
template <typename T, int VEC, int PACKS>
__device__ __forceinline__ void load_weight(const BwdArgs<T>& a, int first, int stride, int valid,
                                            float (&w)[PACKS * VEC]) {
#pragma unroll
  for (int u = 0; u < PACKS; ++u) {
    if (u < valid && a.w) {
      load_param<VEC>(a.w, a.w_type, static_cast<int64_t>(first + u * stride) * VEC, &w[u * VEC]);
#pragma unroll
      for (int j = 0; j < VEC; ++j) w[u * VEC + j] += a.offset;
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) w[u * VEC + j] = u < valid ? 1.f : 0.f;
    }
  }
}

// Number of valid packs among first + u * stride, u < PACKS (a prefix).
template <int PACKS>
__device__ __forceinline__ int valid_packs(int first, int stride, int packs) {
  int valid = 0;
#pragma unroll
  for (int u = 0; u < PACKS; ++u) valid += first + u * stride < packs ? 1 : 0;
  return valid;
}

// The raw dy and h packs first + u * stride, u < count (count <= COUNT) of a row.
template <typename T, int VEC, int COUNT>
__device__ __forceinline__ void load_row_packs(const BwdArgs<T>& a, int64_t row, int first, int stride, int count,
                                               Pack<T, VEC> (&gyp)[COUNT], Pack<T, VEC> (&hpk)[COUNT]) {
  using P = Pack<T, VEC>;
#pragma unroll
  for (int u = 0; u < COUNT; ++u) {
    if (u < count) {
      gyp[u] = reinterpret_cast<const P*>(a.gy + row * a.gy_stride)[first + u * stride];
      hpk[u] = reinterpret_cast<const P*>(a.h + row * a.h_stride)[first + u * stride];
    }
  }
}

// sum(g) and sum(g * xhat) over the first `count` packs, g = dy * w. Only the raw packs
// stay live across the callers' reductions (half the registers of floats for 16-bit
// data); each pass unpacks them again.
template <typename T, int VEC, int COUNT>
__device__ __forceinline__ Sum2 row_dots(const Pack<T, VEC> (&gyp)[COUNT], const Pack<T, VEC> (&hpk)[COUNT],
                                         const float (&w)[COUNT * VEC], int count, float mean, float rstd) {
  Sum2 s = Sum2::identity();
#pragma unroll
  for (int u = 0; u < COUNT; ++u) {
    if (u < count) {
      float dy[VEC], xh[VEC];
      unpack(gyp[u], dy);
      unpack(hpk[u], xh);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float g = dy[j] * w[u * VEC + j];
        s.a += g;
        s.b += g * ((xh[j] - mean) * rstd);
      }
    }
  }
  return s;
}

// dh for one pack of a row, given dy and xhat of the pack, and the partial accumulation.
template <typename T, int VEC>
__device__ __forceinline__ void store_dh(const BwdArgs<T>& a, int64_t row, int p, const float* dy, const float* xh,
                                         const float* w, float rstd, float mean_g, float mean_gx, float* dw,
                                         float* db) {
  using P = Pack<T, VEC>;
  float gr[VEC], o[VEC];
  if (a.gres) unpack(reinterpret_cast<const P*>(a.gres + row * a.gres_stride)[p], gr);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    float v = rstd * (dy[j] * w[j] - mean_g - xh[j] * mean_gx);
    if (a.gres) v += gr[j];
    o[j] = v;
    dw[j] += dy[j] * xh[j];
    db[j] += dy[j];
  }
  reinterpret_cast<P*>(a.gh + row * a.cols)[p] = pack<T, VEC>(o);
}

// Paths (a) and (b). Block b owns rows [b * rows_per_part, (b + 1) * rows_per_part) and
// writes row b of the partials. Lanes as in the forward; each thread's columns are fixed,
// so its weight and its partial sums stay in registers across rows.
template <typename T, int VEC, int PACKS, int GROUP>
__global__ void __launch_bounds__(GROUP > 0 ? kBwdWarpThreads : kBwdMaxBlockThreads, 1)
    norm_bwd_regs_kernel(const BwdArgs<T> a) {
  constexpr int N = PACKS * VEC;
  using P = Pack<T, VEC>;
  __shared__ Sum2 scratch[kWarpSize];
  // (a): the row groups' partials, [groups][cols]; groups * cols <= kBwdWarpThreads * N
  // because groups = kBwdWarpThreads / GROUP and cols <= GROUP * N.
  __shared__ float column_buffer[GROUP > 0 ? kBwdWarpThreads * N : 1];
  const int lanes = GROUP > 0 ? GROUP : static_cast<int>(blockDim.x);
  const int lane = static_cast<int>(threadIdx.x) % lanes, group = static_cast<int>(threadIdx.x) / lanes;
  const int groups = static_cast<int>(blockDim.x) / lanes, packs = a.cols / VEC;
  const int valid = valid_packs<PACKS>(lane, lanes, packs);
  float w[N], dw[N], db[N];
  load_weight<T, VEC, PACKS>(a, lane, lanes, valid, w);
#pragma unroll
  for (int j = 0; j < N; ++j) dw[j] = db[j] = 0.f;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * a.rows_per_part;
  const int64_t r1 = r0 + a.rows_per_part < a.rows ? r0 + a.rows_per_part : a.rows;
  for (int64_t base = r0; base < r1; base += groups) {  // uniform over the block
    const int64_t row = base + group;
    const bool active = row < r1;
    const int count = active ? valid : 0;
    P gyp[PACKS], hpk[PACKS];
    load_row_packs<T, VEC, PACKS>(a, row, lane, lanes, count, gyp, hpk);
    const float rstd = active ? a.rstd[row] : 0.f, mean = active && a.mean ? a.mean[row] : 0.f;
    Sum2 s = row_dots<T, VEC, PACKS>(gyp, hpk, w, count, mean, rstd);
    if constexpr (GROUP > 0) {
      s = s.template allreduce<GROUP>();
    } else {
      s = block_allreduce(s, scratch);
    }
    const float n = static_cast<float>(a.cols);
    const float mean_g = a.mean ? s.a / n : 0.f, mean_gx = s.b / n;
#pragma unroll
    for (int u = 0; u < PACKS; ++u) {
      if (active && u < valid) {
        float dy[VEC], xh[VEC];
        unpack(gyp[u], dy);
        unpack(hpk[u], xh);
#pragma unroll
        for (int j = 0; j < VEC; ++j) xh[j] = (xh[j] - mean) * rstd;
        store_dh<T, VEC>(a, row, lane + u * lanes, dy, xh, &w[u * VEC], rstd, mean_g, mean_gx, &dw[u * VEC],
                         &db[u * VEC]);
      }
    }
  }
  // Partials of this block's rows: row blockIdx.x of part_w / part_b.
  const auto flush = [&](float* part, const float(&acc)[N]) {
    float* const out = part + static_cast<int64_t>(blockIdx.x) * a.cols;
    if constexpr (GROUP > 0) {
      __syncthreads();  // the previous flush is done reading column_buffer
#pragma unroll
      for (int u = 0; u < PACKS; ++u)
        if (u < valid)
#pragma unroll
          for (int j = 0; j < VEC; ++j) column_buffer[group * a.cols + (lane + u * lanes) * VEC + j] = acc[u * VEC + j];
      __syncthreads();
      for (int c = threadIdx.x; c < a.cols; c += blockDim.x) {
        float total = 0.f;
        for (int g = 0; g < groups; ++g) total += column_buffer[g * a.cols + c];  // fixed order
        out[c] = total;
      }
    } else {
#pragma unroll
      for (int u = 0; u < PACKS; ++u)
        if (u < valid)
#pragma unroll
          for (int j = 0; j < VEC; ++j) out[(lane + u * lanes) * VEC + j] = acc[u * VEC + j];
    }
  };
  if (a.part_w) flush(a.part_w, dw);  // kernel arguments: uniform branches
  if (a.part_b) flush(a.part_b, db);
}

// Path (c), step 1: row_sums[row] = (sum(g), sum(g * xhat)) with 512 threads per row.
template <typename T, int VEC>
__global__ void __launch_bounds__(kLongThreads, 1) norm_bwd_row_sums_kernel(const BwdArgs<T> a) {
  constexpr int UNROLL = kLongStepBytes / static_cast<int>(sizeof(T)) / VEC;  // >= 1: VEC * E <= 16
  constexpr int N = UNROLL * VEC;
  using P = Pack<T, VEC>;
  __shared__ Sum2 scratch[kWarpSize];
  const int packs = a.cols / VEC, stride = static_cast<int>(blockDim.x), step = stride * UNROLL;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const float rstd = a.rstd[row], mean = a.mean ? a.mean[row] : 0.f;
    Sum2 s = Sum2::identity();
    for (int first = threadIdx.x; first < packs; first += step) {
      const int valid = valid_packs<UNROLL>(first, stride, packs);
      P gyp[UNROLL], hpk[UNROLL];
      load_row_packs<T, VEC, UNROLL>(a, row, first, stride, valid, gyp, hpk);
      float w[N];
      load_weight<T, VEC, UNROLL>(a, first, stride, valid, w);
      const Sum2 chunk = row_dots<T, VEC, UNROLL>(gyp, hpk, w, valid, mean, rstd);
      s.a += chunk.a;
      s.b += chunk.b;
    }
    s = block_allreduce(s, scratch);
    if (threadIdx.x == 0) {
      a.row_sums[2 * row] = s.a;
      a.row_sums[2 * row + 1] = s.b;
    }
  }
}

// Path (c), step 2: block (x, y) covers columns [x * kTileCols, (x + 1) * kTileCols) of rows
// [y * rows_per_part, ...): thread t owns packs chunk + t + u * kTileThreads, u < PACKS,
// for all those rows, kTileRows rows loaded at a time; writes dh and row y of the partials.
template <typename T, int VEC>
__global__ void __launch_bounds__(kTileThreads, 1) norm_bwd_tile_kernel(const BwdArgs<T> a) {
  constexpr int PACKS = kTileElems / VEC, N = kTileElems;
  using P = Pack<T, VEC>;
  const int packs = a.cols / VEC;
  const int first = static_cast<int>(blockIdx.x) * (kTileCols / VEC) + static_cast<int>(threadIdx.x);
  const int valid = valid_packs<PACKS>(first, kTileThreads, packs);
  float w[N], dw[N], db[N];
  load_weight<T, VEC, PACKS>(a, first, kTileThreads, valid, w);
#pragma unroll
  for (int j = 0; j < N; ++j) dw[j] = db[j] = 0.f;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * a.rows_per_part;
  const int64_t r1 = r0 + a.rows_per_part < a.rows ? r0 + a.rows_per_part : a.rows;
  const float n = static_cast<float>(a.cols);
  for (int64_t base = r0; base < r1; base += kTileRows) {
    P gyp[kTileRows][PACKS], hpk[kTileRows][PACKS];
#pragma unroll
    for (int r = 0; r < kTileRows; ++r)
#pragma unroll
      for (int u = 0; u < PACKS; ++u)
        if (base + r < r1 && u < valid) {
          gyp[r][u] = reinterpret_cast<const P*>(a.gy + (base + r) * a.gy_stride)[first + u * kTileThreads];
          hpk[r][u] = reinterpret_cast<const P*>(a.h + (base + r) * a.h_stride)[first + u * kTileThreads];
        }
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) {
      const int64_t row = base + r;
      if (row < r1 && valid > 0) {
        const float rstd = a.rstd[row], mean = a.mean ? a.mean[row] : 0.f;
        const float mean_g = a.mean ? a.row_sums[2 * row] / n : 0.f, mean_gx = a.row_sums[2 * row + 1] / n;
#pragma unroll
        for (int u = 0; u < PACKS; ++u) {
          if (u < valid) {
            float dy[VEC], xh[VEC];
            unpack(gyp[r][u], dy);
            unpack(hpk[r][u], xh);
#pragma unroll
            for (int j = 0; j < VEC; ++j) xh[j] = (xh[j] - mean) * rstd;
            store_dh<T, VEC>(a, row, first + u * kTileThreads, dy, xh, &w[u * VEC], rstd, mean_g, mean_gx,
                             &dw[u * VEC], &db[u * VEC]);
          }
        }
      }
    }
  }
  const int64_t out = static_cast<int64_t>(blockIdx.y) * a.cols;
#pragma unroll
  for (int u = 0; u < PACKS; ++u) {
    if (u < valid) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const int64_t col = static_cast<int64_t>(first + u * kTileThreads) * VEC + j;
        if (a.part_w) a.part_w[out + col] = dw[u * VEC + j];
        if (a.part_b) a.part_b[out + col] = db[u * VEC + j];
      }
    }
  }
}

__global__ void __launch_bounds__(kColumnSumCols * kColumnSumSlices)
    column_sum_kernel(const float* partial, int64_t parts, int64_t cols, void* out, int out_type) {
  column_sum(partial, parts, cols, out, out_type);
}

}  // namespace
}  // namespace cuda_norms
}  // namespace kernelforge
