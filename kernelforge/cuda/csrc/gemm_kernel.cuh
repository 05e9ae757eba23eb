// The GEMM kernel (mma.sync tensor cores, cp.async multi-stage pipeline, fused epilogue),
// templated on the element type, the operand layouts and the tile, and the host-side pieces
// the launcher (gemm_cuda.cu) and the CPU emulation in the tests share: the tiles, the
// argument checks, the kernel parameters and the split of a call into launches. Plain CUDA,
// no torch headers; the warp-level instructions come from attention_mma.cuh (and only from
// there, so tests/cuda/attention_emu's emulation of that file runs this kernel on the CPU).
//
// One CTA computes a BM x BN tile of one batch entry; WARPS_M x WARPS_N warps each own a
// (BM / WARPS_M) x (BN / WARPS_N) block of it as 16x8 mma tiles (fp32 accumulators in
// registers). Per BK-deep slice of K:
//   1. cp.async (16 bytes, L2 only) copies the A and B slices into one of STAGES shared
//      buffers, STAGES - 1 slices ahead of the math, so the loads of the next slices are in
//      flight while this one is multiplied; one barrier per slice.
//   2. ldmatrix (.trans for an operand whose contiguous dim is M or N, not K) turns the
//      slice into mma fragments: a k-major shared row holds one m (or n) and BK k's, an
//      m/n-major row one k and BM (BN) m's (n's); either way each 8x8 matrix of a fragment
//      is 8 rows of 16 bytes, which is what ldmatrix reads.
//   3. mma.m16n8k16 with fp32 accumulation: every fragment of A is used BN / WARPS_N / 8
//      times, every fragment of B BM / WARPS_M / 16 times.
// Shared rows are padded by 8 elements (16 bytes): a k-major row of BK = 32 is 80 bytes and
// an m/n-major row of 128 is 272 bytes, so the 8 rows an ldmatrix phase reads fall in 8
// different 16-byte bank groups (no conflicts), and so do the 16-byte cp.async writes of a
// quarter warp along an m/n-major row. (An XOR swizzle would save the 20% of padding, but
// k-major rows of BK = 32 are 4 chunks wide: the usual 8-chunk swizzle would have to pair
// rows; padding keeps one indexing rule for all four layouts.)
// Edges: chunks past M, N or K are zero-filled by cp.async (src-size 0); a chunk that
// straddles the end of the contiguous dim (K % 8 != 0 with a padded row stride, or the last
// columns of an m/n-major operand) is read element by element and stored to shared memory
// by the thread, so nothing outside the logical matrices is read and the products past K
// are exact zeros (garbage there could be Inf or NaN, and Inf * 0 is NaN).
// Epilogue: the accumulators go through shared memory (fp32, rows padded by 8 floats: the
// 8-byte writes of a half warp cover the 32 banks once), then each warp takes whole rows,
// each lane 4 consecutive columns: z = acc + bias, y = act(z) + residual, one rounding to
// the output dtype, 8- or 16-byte stores of contiguous columns (coalesced), and preact =
// acc rounded the same way when asked for.
// Tile order: CTAs run batch by batch, and within a batch in groups of kGroupM tile rows,
// column by column (Triton's grouped order): the kGroupM A panels and the current B panel
// stay in L2 while a group walks the columns, so A and B are read from HBM about once per
// group rather than once per CTA.
#pragma once

#include <math.h>

#include <cstdint>

#include "gemm_cuda.h"  // first: cuda_runtime.h before the emulation's threadIdx / gridDim macros
#include "attention_mma.cuh"

namespace kernelforge {
namespace gemm {

using attention::block_sync;
using attention::cp_async_16;
using attention::cp_async_commit;
using attention::cp_async_wait;
using attention::dynamic_smem;
using attention::ldmatrix_x4;
using attention::ldmatrix_x4_trans;
using attention::mma_16816;
using attention::pack2;
using cuda_gemm::Activation;
using cuda_gemm::GemmArgs;

constexpr int kGroupM = 8;  // tile rows per group of the grouped order

// One launch's parameters (the launcher splits a call whose rows or CTAs exceed an int).
// Element strides; a and b point at batch 0, row 0 of this launch's rows.
struct GemmParams {
  const void* a;
  const void* b;
  int64_t a_batch_stride, a_ld, b_batch_stride, b_ld;
  const void* bias;
  int64_t bias_stride;
  const void* residual;
  int64_t residual_batch_stride, residual_row_stride, residual_col_stride;
  void* out;     // dense rows of N elements; row (batch, m) at (batch * out_batch_rows + m) * N
  void* preact;  // null or like out
  int64_t out_batch_rows;  // M of the call (out is dense (batch, M, N))
  int M, N, K;             // this launch's rows, and the call's N and K
  int tiles_m, tiles_n;
  DType bias_dtype, residual_dtype, out_dtype;
  Activation activation;
};

// BM x BN x BK tile, WARPS_M x WARPS_N warps, STAGES shared buffers; A_K / B_K: the operand's
// contiguous dim is K (else M for a, N for b).
template <typename T_, bool A_K, bool B_K, int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES,
          int MIN_BLOCKS>
struct GemmTile {
  using T = T_;
  static constexpr bool kAKMajor = A_K, kBKMajor = B_K;
  static constexpr int kBM = BM, kBN = BN, kBK = BK, kStages = STAGES, kMinBlocks = MIN_BLOCKS;
  static constexpr int kWarpsM = WARPS_M, kWarpsN = WARPS_N, kWarps = WARPS_M * WARPS_N, kThreads = 32 * kWarps;
  static constexpr int kWM = BM / WARPS_M, kWN = BN / WARPS_N;  // a warp's block
  static constexpr int kMT = kWM / 16, kNT = kWN / 8;           // its 16x8 mma tiles
  // Shared rows (elements): k-major rows hold BK k's, m/n-major rows BM / BN m's / n's; +8 pad.
  static constexpr int kAStride = (A_K ? BK : BM) + 8, kARows = A_K ? BM : BK;
  static constexpr int kBStride = (B_K ? BK : BN) + 8, kBRows = B_K ? BN : BK;
  static constexpr int kAElems = kARows * kAStride, kBElems = kBRows * kBStride;
  static constexpr int kStageElems = kAElems + kBElems;
  static constexpr int kCStride = BN + 8;  // epilogue rows (floats)
  static constexpr int kPipeBytes = STAGES * kStageElems * 2;
  static constexpr int kEpilogueBytes = BM * kCStride * 4;
  static constexpr int kSmemBytes = kPipeBytes > kEpilogueBytes ? kPipeBytes : kEpilogueBytes;
  static_assert(sizeof(T) == 2, "16-bit operands");
  static_assert(kWM % 16 == 0 && kWN % 16 == 0 && BK % 16 == 0, "whole mma tiles, B fragments in pairs");
  static_assert(BM % 8 == 0 && BN % 128 == 0, "the epilogue gives each lane 4 columns of 128");
  static_assert((kARows * ((A_K ? BK : BM) / 8)) % kThreads == 0 && (kBRows * ((B_K ? BK : BN) / 8)) % kThreads == 0,
                "tile copies split evenly over the threads");
  static_assert(kAElems % 8 == 0 && kBElems % 8 == 0, "16-byte aligned shared tiles");
};

// The tile per warp count (the raw API's block_size / 32). Shared memory: 4 stages of 20 KB
// (k-major a and b: 2 x 128 rows of 40 elements) down to 17 KB (m/n-major: 2 x 32 rows of
// 136), at least the 68 KB the fp32 epilogue tile takes: 68 to 80 KB per CTA. ptxas -v
// (nvcc 13.0, sm_90) reports no spills and these registers per thread:
//   8 warps (256 threads, the default): 128 x 128 x 32, warps 2 x 4 of 64 x 32 (64 fp32
//     accumulators), 4 stages, 2 CTAs per SM (16 warps): 124-128 registers (128 is the cap
//     of 2 CTAs of 256 threads). 6 ldmatrix.x4 feed 16 mma per 16-deep step: 21 FLOPs per
//     shared byte read.
//   4 warps (128 threads): the same 128 x 128 x 32 tile, warps 2 x 2 of 64 x 64 (128
//     accumulators), 4 stages, 2 CTAs per SM (8 warps): 222-238 registers. 32 FLOPs per
//     shared byte, half the warps to hide latency.
template <typename T, bool A_K, bool B_K, int WARPS>
struct TileFor;
template <typename T, bool A_K, bool B_K>
struct TileFor<T, A_K, B_K, 8> { using type = GemmTile<T, A_K, B_K, 128, 128, 32, 2, 4, 4, 2>; };
template <typename T, bool A_K, bool B_K>
struct TileFor<T, A_K, B_K, 4> { using type = GemmTile<T, A_K, B_K, 128, 128, 32, 2, 2, 4, 2>; };

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

__device__ __forceinline__ float load_float(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat16: return __half2float(static_cast<const __half*>(p)[i]);
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void store_one(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_one(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store_one(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// Four consecutive columns; `count` of them (1..4) exist; `vector`: the four are 4-element
// aligned (N % 4 == 0), so one 16-byte (fp32) or 8-byte (16-bit) store writes them.
__device__ __forceinline__ void store4(float* p, const float (&v)[4], int count, bool vector) {
  if (vector && count == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    for (int e = 0; e < count; ++e) p[e] = v[e];
  }
}
template <typename T>
__device__ __forceinline__ void store4(T* p, const float (&v)[4], int count, bool vector) {
  if (vector && count == 4) {
    *reinterpret_cast<uint2*>(p) = make_uint2(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]));
  } else {
    for (int e = 0; e < count; ++e) store_one(p + e, v[e]);
  }
}

// The activations of kernelforge/reference/activations.py in fp32.
__device__ __forceinline__ float activate(float z, Activation act) {
  switch (act) {
    case Activation::kGelu: return 0.5f * z * (1.f + erff(z * 0.70710678118654752f));
    case Activation::kGeluTanh: {
      const float u = 0.79788456080286536f * (z + 0.044715f * z * z * z);
      return 0.5f * z * (1.f + tanhf(u));
    }
    case Activation::kSilu: return z / (1.f + expf(-z));
    case Activation::kRelu: return z < 0.f ? 0.f : z;  // NaN stays NaN, as torch.relu
    default: return z;
  }
}

// A chunk of 8 elements of which only the first `valid` (1..7) exist: read one by one (no
// byte past the matrix), zeros after them, stored to shared memory by this thread.
template <typename T>
__device__ __forceinline__ void copy_partial_chunk(T* smem_dst, const T* gmem_src, int valid) {
  const uint16_t* src = reinterpret_cast<const uint16_t*>(gmem_src);
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = 2 * i < valid ? src[2 * i] : 0u, hi = 2 * i + 1 < valid ? src[2 * i + 1] : 0u;
    w[i] = lo | hi << 16;
  }
  *reinterpret_cast<uint4*>(smem_dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

// ROWS x (8 * CHUNKS) elements into shared rows of SSTRIDE: tile row r is global row outer0 + r
// (valid below outer_n), at gmem + row * ld; chunk c holds its elements inner0 + 8c ... (valid
// below inner_n). Asynchronous except for straddling chunks; the caller commits.
template <typename T, int ROWS, int CHUNKS, int SSTRIDE, int THREADS>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, int64_t ld, int outer0, int outer_n, int inner0,
                                          int inner_n, int tid) {
#pragma unroll
  for (int i = 0; i < ROWS * CHUNKS / THREADS; ++i) {
    const int idx = tid + i * THREADS;
    const int r = idx / CHUNKS, c = idx % CHUNKS;
    const int row = outer0 + r, col = inner0 + 8 * c;
    T* const dst = smem + r * SSTRIDE + 8 * c;
    const T* const src = gmem + row * ld + col;
    const bool row_ok = row < outer_n;
    if (row_ok && inner_n - col >= 8) {
      cp_async_16(dst, src, true);
    } else if (row_ok && col < inner_n) {
      copy_partial_chunk(dst, src, inner_n - col);
    } else {
      cp_async_16(dst, gmem, false);  // zero fill, nothing read
    }
  }
}

template <typename Tile, typename OutT>
__device__ __forceinline__ void epilogue(const GemmParams& p, const float* sc, int batch, int m0, int n0, int warp,
                                         int lane) {
  constexpr int BN = Tile::kBN, kColGroups = BN / 128;
  const int rows = imin(Tile::kBM, p.M - m0), cols = imin(BN, p.N - n0);
  float bias[kColGroups][4];
#pragma unroll
  for (int j = 0; j < kColGroups; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = 128 * j + 4 * lane + e;
      bias[j][e] = p.bias != nullptr && c < cols ? load_float(p.bias, p.bias_dtype, (n0 + c) * p.bias_stride) : 0.f;
    }
  }
  const bool vector = p.N % 4 == 0;
  const int64_t out_row0 = static_cast<int64_t>(batch) * p.out_batch_rows + m0;
  const char* residual = static_cast<const char*>(p.residual);
#pragma unroll 1
  for (int r = warp; r < rows; r += Tile::kWarps) {
    const int64_t out_offset = (out_row0 + r) * p.N + n0;
#pragma unroll
    for (int j = 0; j < kColGroups; ++j) {
      const int c = 128 * j + 4 * lane;
      if (c >= cols) continue;
      const int count = imin(4, cols - c);
      const float4 v = *reinterpret_cast<const float4*>(sc + r * Tile::kCStride + c);
      const float acc[4] = {v.x, v.y, v.z, v.w};
      float y[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) y[e] = activate(acc[e] + bias[j][e], p.activation);
      if (residual != nullptr) {
        const int64_t base = batch * p.residual_batch_stride + static_cast<int64_t>(m0 + r) * p.residual_row_stride +
                             static_cast<int64_t>(n0 + c) * p.residual_col_stride;
        for (int e = 0; e < count; ++e)
          y[e] += load_float(residual, p.residual_dtype, base + e * p.residual_col_stride);
      }
      store4(static_cast<OutT*>(p.out) + out_offset + c, y, count, vector);
      if (p.preact != nullptr) store4(static_cast<OutT*>(p.preact) + out_offset + c, acc, count, vector);
    }
  }
}

template <typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kMinBlocks) gemm_kernel(const GemmParams p) {
  using T = typename Tile::T;
  constexpr int BM = Tile::kBM, BN = Tile::kBN, BK = Tile::kBK, MT = Tile::kMT, NT = Tile::kNT;
  constexpr int AS = Tile::kAStride, BS = Tile::kBStride, STAGES = Tile::kStages;
  constexpr bool A_K = Tile::kAKMajor, B_K = Tile::kBKMajor;

  T* const smem = reinterpret_cast<T*>(dynamic_smem());
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  // This CTA's tile: batch-major, then grouped (kGroupM tile rows walk the columns together).
  const int per_batch = p.tiles_m * p.tiles_n;
  const int batch = static_cast<int>(blockIdx.x) / per_batch;
  const int t = static_cast<int>(blockIdx.x) - batch * per_batch;
  const int group_width = kGroupM * p.tiles_n;
  const int first_m = t / group_width * kGroupM;
  const int group_rows = imin(p.tiles_m - first_m, kGroupM);
  const int m0 = (first_m + t % group_width % group_rows) * BM;
  const int n0 = t % group_width / group_rows * BN;

  const T* const a = static_cast<const T*>(p.a) + batch * p.a_batch_stride;
  const T* const b = static_cast<const T*>(p.b) + batch * p.b_batch_stride;
  const int M = p.M, N = p.N, K = p.K;

  const auto load_stage = [&](int stage, int kt) {
    T* const sa = smem + stage * Tile::kStageElems;
    T* const sb = sa + Tile::kAElems;
    const int k0 = kt * BK;
    if constexpr (A_K) {
      load_tile<T, BM, BK / 8, AS, Tile::kThreads>(sa, a, p.a_ld, m0, M, k0, K, tid);
    } else {
      load_tile<T, BK, BM / 8, AS, Tile::kThreads>(sa, a, p.a_ld, k0, K, m0, M, tid);
    }
    if constexpr (B_K) {
      load_tile<T, BN, BK / 8, BS, Tile::kThreads>(sb, b, p.b_ld, n0, N, k0, K, tid);
    } else {
      load_tile<T, BK, BN / 8, BS, Tile::kThreads>(sb, b, p.b_ld, k0, K, n0, N, tid);
    }
  };

  // ldmatrix row address of this lane (element offset in a stage's tile; see mma_16816 for
  // the fragment layouts). A: matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15),
  // (m 8-15, k 8-15) of an m-tile; B: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7),
  // (n 8-15, k 8-15) of a pair of n-tiles. Lanes 8i..8i+7 give matrix i's rows.
  const int wm = warp / Tile::kWarpsN * Tile::kWM, wn = warp % Tile::kWarpsN * Tile::kWN;
  const int a_frag = A_K ? (wm + lane % 16) * AS + lane / 16 * 8
                         : (lane % 8 + lane / 16 * 8) * AS + wm + lane / 8 % 2 * 8;
  const int b_frag = B_K ? (wn + lane % 8 + lane / 16 * 8) * BS + lane / 8 % 2 * 8
                         : (lane % 8 + lane / 8 % 2 * 8) * BS + wn + lane / 16 * 8;
  constexpr int kAStepM = A_K ? 16 * AS : 16, kAStepK = A_K ? 16 : 16 * AS;
  constexpr int kBStepN = B_K ? 16 * BS : 16, kBStepK = B_K ? 16 : 16 * BS;

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
  }

  const int k_tiles = (K + BK - 1) / BK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();  // empty groups keep the count per slice uniform
  }
  int read_stage = 0, write_stage = STAGES - 1;
#pragma unroll 1
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<STAGES - 2>();  // this thread's copies of slice kt landed
    block_sync();  // everyone's did; every warp is done with slice kt - 1, whose buffer is refilled next
    if (kt + STAGES - 1 < k_tiles) load_stage(write_stage, kt + STAGES - 1);
    cp_async_commit();
    write_stage = write_stage == STAGES - 1 ? 0 : write_stage + 1;

    const T* const sa = smem + read_stage * Tile::kStageElems;
    const T* const sb = sa + Tile::kAElems;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t af[MT][4], bf[NT / 2][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (A_K) ldmatrix_x4(af[mt], sa + a_frag + mt * kAStepM + kk * kAStepK);
        else ldmatrix_x4_trans(af[mt], sa + a_frag + mt * kAStepM + kk * kAStepK);
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        if constexpr (B_K) ldmatrix_x4(bf[np], sb + b_frag + np * kBStepN + kk * kBStepK);
        else ldmatrix_x4_trans(bf[np], sb + b_frag + np * kBStepN + kk * kBStepK);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          mma_16816<T>(acc[mt][2 * np], af[mt], bf[np][0], bf[np][1]);
          mma_16816<T>(acc[mt][2 * np + 1], af[mt], bf[np][2], bf[np][3]);
        }
      }
    }
    read_stage = read_stage == STAGES - 1 ? 0 : read_stage + 1;
  }

  // Epilogue: accumulators -> shared (fp32) -> whole rows per warp.
  cp_async_wait<0>();
  block_sync();  // every warp is done reading the pipeline buffers the accumulators overwrite
  float* const sc = reinterpret_cast<float*>(smem);
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float* const c = sc + (wm + 16 * mt + g) * Tile::kCStride + wn + 8 * nt + 2 * q;
      *reinterpret_cast<float2*>(c) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
      *reinterpret_cast<float2*>(c + 8 * Tile::kCStride) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
    }
  }
  block_sync();
  switch (p.out_dtype) {
    case DType::kFloat32: epilogue<Tile, float>(p, sc, batch, m0, n0, warp, lane); break;
    case DType::kFloat16: epilogue<Tile, __half>(p, sc, batch, m0, n0, warp, lane); break;
    default: epilogue<Tile, __nv_bfloat16>(p, sc, batch, m0, n0, warp, lane); break;
  }
}

// ---------------------------------------------------------------------------------------
// Host side, shared by the launcher and the CPU emulation test.

inline bool valid_dtype(DType d) { return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16; }

// The contract of gemm_cuda.h.
inline bool args_valid(const GemmArgs& a) {
  using cuda_gemm::kMaxDim;
  const auto aligned16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (a.batch < 0 || a.M < 0 || a.N < 0 || a.K < 0 || a.N > kMaxDim || a.K > kMaxDim) return false;
  if (a.dtype != DType::kFloat16 && a.dtype != DType::kBFloat16) return false;
  if (!valid_dtype(a.out_dtype) || !valid_dtype(a.bias_dtype) || !valid_dtype(a.residual_dtype)) return false;
  if (static_cast<int>(a.activation) < 0 || static_cast<int>(a.activation) > 4) return false;
  if (a.warps != 4 && a.warps != 8) return false;
  if (a.batch == 0 || a.M == 0 || a.N == 0) return true;  // nothing is launched
  if (!a.out || !aligned16(a.out) || (a.preact && !aligned16(a.preact))) return false;
  if (a.K > 0) {
    if (!a.a || !a.b || !aligned16(a.a) || !aligned16(a.b)) return false;
    for (int64_t s : {a.a_batch_stride, a.a_ld, a.b_batch_stride, a.b_ld}) {
      if (s < 0 || s % 8 != 0) return false;
    }
  }
  return true;
}

// Calls launch(params, ctas) for each launch of a call: the batch and the rows are split
// so that a launch has at most max_rows rows and max_ctas CTAs (int in the kernel; the
// emulation test passes small limits to exercise the split).
template <typename Tile, typename F>
void for_each_launch(const GemmArgs& a, int64_t max_rows, int64_t max_ctas, F&& launch) {
  constexpr int BM = Tile::kBM, BN = Tile::kBN;
  const int64_t tiles_n = (a.N + BN - 1) / BN;
  int64_t rows = a.M < max_rows ? a.M : max_rows / BM * BM;
  if ((rows + BM - 1) / BM * tiles_n > max_ctas) rows = max_ctas / tiles_n * BM;
  if (rows < BM) rows = BM;  // max_rows >= BM and max_ctas >= tiles_n (2^23 at most) keep the limits
  const int64_t tiles_m = (rows + BM - 1) / BM;
  const int64_t per_batch = tiles_m * tiles_n;
  const int64_t batches = a.batch < max_ctas / per_batch ? a.batch : max_ctas / per_batch;
  const int64_t e = 2;  // bytes per operand element
  const int64_t out_e = a.out_dtype == DType::kFloat32 ? 4 : 2;
  for (int64_t b0 = 0; b0 < a.batch; b0 += batches) {
    for (int64_t m0 = 0; m0 < a.M; m0 += rows) {
      const int64_t nb = a.batch - b0 < batches ? a.batch - b0 : batches;
      const int64_t nm = a.M - m0 < rows ? a.M - m0 : rows;
      GemmParams p{};
      p.a = a.a, p.b = a.b;
      if (a.K > 0) {  // else nothing is read (the pointers may be null)
        const int64_t a_row = a.a_k_major ? a.a_ld : 1;  // elements from row m to row m + 1 of a
        p.a = static_cast<const char*>(a.a) + (b0 * a.a_batch_stride + m0 * a_row) * e;
        p.b = static_cast<const char*>(a.b) + b0 * a.b_batch_stride * e;
      }
      p.a_batch_stride = a.a_batch_stride, p.a_ld = a.a_ld, p.b_batch_stride = a.b_batch_stride, p.b_ld = a.b_ld;
      p.bias = a.bias, p.bias_stride = a.bias_stride, p.bias_dtype = a.bias_dtype;
      p.residual = nullptr;
      if (a.residual) {
        const int64_t re = a.residual_dtype == DType::kFloat32 ? 4 : 2;
        p.residual = static_cast<const char*>(a.residual) +
                     (b0 * a.residual_batch_stride + m0 * a.residual_row_stride) * re;
      }
      p.residual_batch_stride = a.residual_batch_stride, p.residual_row_stride = a.residual_row_stride;
      p.residual_col_stride = a.residual_col_stride, p.residual_dtype = a.residual_dtype;
      const int64_t out_skip = ((b0 * a.M) + m0) * a.N * out_e;
      p.out = static_cast<char*>(a.out) + out_skip;
      p.preact = a.preact ? static_cast<char*>(a.preact) + out_skip : nullptr;
      p.out_batch_rows = a.M;
      p.M = static_cast<int>(nm), p.N = static_cast<int>(a.N), p.K = static_cast<int>(a.K);
      p.tiles_m = static_cast<int>((nm + BM - 1) / BM), p.tiles_n = static_cast<int>(tiles_n);
      p.activation = a.activation, p.out_dtype = a.out_dtype;
      launch(p, static_cast<int64_t>(p.tiles_m) * p.tiles_n * nb);
    }
  }
}

}  // namespace gemm
}  // namespace kernelforge
