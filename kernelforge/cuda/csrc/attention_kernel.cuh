// The flash-attention forward kernel (FlashAttention-2 scheme on mma.sync tensor cores),
// templated on the element type, the head dim and the tile shape, and the host-side pieces
// the launcher (attention_forward.cu) and the CPU emulation in the tests share: the tile
// per head dim, the argument checks and the kernel parameters. Plain CUDA, no torch headers.
//
// One CTA owns BM query rows of one (batch, head); each warp owns 16 * MT of them, so the
// softmax statistics never leave a warp (a row lives in the 4 lanes of a quad). Per key
// tile of BN keys, walked from the last to the first (the tiles that need masking, the Sk
// tail and the causal diagonal, come first):
//   1. S = Q K^T (fp32) with mma.m16n8k16: Q as A fragments (held in registers, or read
//      from shared memory at every k-step where registers are short), K by ldmatrix.
//   2. Online softmax in registers: x = S * scale * log2(e), row max over the quad,
//      P = 2^(x - max) on the SFU, O and the row sums rescaled by 2^(old max - new max).
//      Masking (-inf) only on tiles that straddle a causal / window bound or the Sk tail.
//   3. P is rounded to T in registers and is directly the A operand of O += P V (the
//      accumulator layout of two 16x8 S tiles is the A layout of one 16x16 step); V by
//      ldmatrix.trans.
// Loads: cp.async (16 bytes, zero-filled past Sq / Sk) into padded shared rows (D + 8
// elements: 8 rows at the same column are 16 bytes apart modulo 128, so ldmatrix and the
// 16-byte writes are conflict-free for every D, including 96 which an XOR swizzle over
// 8-chunk groups cannot cover). K and V alternate as in FlashAttention-2: V(n) loads while
// S = Q K(n)^T is computed, K(n-1) loads while O += P V(n) is computed; two barriers per tile.
// Epilogue: O / rowsum rounded to T through this warp's rows of the Q buffer, then 16-byte
// stores; lse = (max + log2(rowsum)) * ln(2); a row without visible keys gives O = 0 and
// lse = -inf.
#pragma once

#include <cstdint>

#include "attention_cuda.h"
#include "attention_mma.cuh"

namespace kernelforge {
namespace attention {

// Query positions are below 2^29 + BM, so with the window shifts clamped to +-2^30
// (which changes no clamped bound) every position sum below fits in an int.
constexpr int kMaxShift = 1 << 30;

// Built by the host launcher. Strides are in elements; the last dim is contiguous, every
// pointer and stride 16-byte aligned (the launcher checks).
struct FwdParams {
  const void* q;  // (B, H, Sq, D)
  const void* k;  // (B, Hkv, Sk, D)
  const void* v;  // (B, Hkv, Sk, D)
  void* out;      // dense (B, H, Sq, D)
  float* lse;     // dense (B, H, Sq)
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int heads, group;  // H, and H / Hkv (q head h reads kv head h / group)
  int q_len, kv_len;
  // Key j is visible to query i iff i + lo_shift <= j <= i + hi_shift (and j < Sk): with
  // off = Sk - Sq, lo_shift = off - window_left and hi_shift = off + window_right (off when
  // causal), -kMaxShift / kMaxShift for a side without limit, clamped to that range.
  int lo_shift, hi_shift;
  float scale_log2;  // scale * log2(e), > 0 (the softmax takes the max of the raw scores)
};

// WARPS warps of MT m-tiles (16 rows each): BM = 16 * MT * WARPS query rows per CTA. Two
// m-tiles per warp reuse every K and V fragment read from shared memory twice, halving that
// traffic per FLOP (16 rows per warp need ~170 B / clock / SM of ldmatrix bandwidth at the
// mma.sync peak of an H100, more than the 128 it has). Q_IN_REGS: Q fragments are loaded
// once into registers, else re-read from shared memory at every k-step.
template <typename T_, int D, int MT, int WARPS, int BN, bool Q_IN_REGS, int MIN_BLOCKS>
struct FwdTile {
  using T = T_;
  static constexpr int kD = D, kMT = MT, kWarps = WARPS, kBN = BN, kMinBlocks = MIN_BLOCKS;
  static constexpr bool kQInRegs = Q_IN_REGS;
  static constexpr int kWarpRows = 16 * MT, kBM = kWarpRows * WARPS, kThreads = 32 * WARPS;
  static constexpr int kChunks = D / 8;   // 16-byte chunks per row
  static constexpr int kStride = D + 8;   // elements per shared-memory row (padded)
  static constexpr int kQElems = kBM * kStride, kKVElems = BN * kStride;
  static constexpr int kSmemBytes = (kQElems + 2 * kKVElems) * static_cast<int>(sizeof(T));
  static_assert(D % 16 == 0 && BN % 16 == 0, "mma steps are 16 deep");
  static_assert(kWarpRows * kChunks % 32 == 0, "epilogue stores split evenly over a warp");
};

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

// Visible keys [lo[r], hi[r]] (lo >= 0, hi <= Sk - 1; empty when lo > hi) of query rows
// row and row + 8. Computed only for masked tiles: kept across the key loop these would
// hold 4 registers per m-tile.
__device__ __forceinline__ void row_bounds(const FwdParams& p, int row, int (&lo)[2], int (&hi)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lo[r] = imax(0, row + 8 * r + p.lo_shift);
    hi[r] = imin(p.kv_len - 1, row + 8 * r + p.hi_shift);
  }
}

// Rows [row0, row0 + ROWS) of a (rows, D) matrix whose rows are row_stride elements apart
// (gmem points at row 0), into padded shared rows; rows >= rows_total are zero-filled.
// Asynchronous: the caller commits. Each thread copies one 16-byte column of every
// kRowsPerPass-th row; the addresses are recomputed from the row index on every call (a
// few integer ops) rather than kept per chunk across the key loop, where 16 hoisted 64-bit
// offsets cost ~50 registers. D = 96 spreads 12 columns over 16 lanes (a quarter idle).
template <typename Tile, int ROWS>
__device__ __forceinline__ void copy_rows_async(typename Tile::T* smem, const typename Tile::T* gmem,
                                                int64_t row_stride, int row0, int rows_total, int tid) {
  constexpr int kCols = Tile::kChunks <= 4 ? 4 : Tile::kChunks <= 8 ? 8 : Tile::kChunks <= 16 ? 16 : 32;
  constexpr int kRowsPerPass = Tile::kThreads / kCols;
  static_assert(Tile::kChunks <= kCols && Tile::kThreads % kCols == 0 && ROWS % kRowsPerPass == 0,
                "tile copies split evenly");
  const int col = tid % kCols, r0 = tid / kCols;
  if (kCols != Tile::kChunks && col >= Tile::kChunks) return;
#pragma unroll
  for (int i = 0; i < ROWS / kRowsPerPass; ++i) {
    const int r = r0 + i * kRowsPerPass;
    // Unsigned (wrapping) row arithmetic: the compiler cannot split row * row_stride into a
    // loop-invariant r * row_stride per chunk that it would keep in registers.
    const uint32_t row = static_cast<uint32_t>(row0) + static_cast<uint32_t>(r);
    const bool valid = row < static_cast<uint32_t>(rows_total);
    const typename Tile::T* src = valid ? gmem + row * row_stride + col * 8 : gmem;
    cp_async_16(smem + r * Tile::kStride + col * 8, src, valid);
  }
}

// Online softmax of one S tile (NT 16x8 tiles of this warp) into P, in place. Lane (g, t)
// holds rows g (r = 0) and g + 8 (r = 1), keys key0 + 8 nt + {0, 1} (key0 = n0 + 2t).
// row_max is the running max of the raw scores q.k (scale_log2 > 0, so it is also the max
// of the scaled ones), and P = 2^(s * scale_log2 - ref) is one FFMA and one ex2 per score,
// ref = row_max * scale_log2 (FlashAttention-2's folding). MASK: keys outside [lo[r], hi[r]]
// (window, causal and Sk bounds of the row) become -inf, so P = 0 there. ref is 0 while a
// row has seen no visible key, so such a row gives P = 0 and rescales by 2^-inf = 0
// instead of computing -inf - -inf.
template <bool MASK, int NT, int DT>
__device__ __forceinline__ void online_softmax(float (&s)[NT][4], float (&o)[DT][4], float (&row_max)[2],
                                               float (&row_sum)[2], float scale_log2, int key0, const int (&lo)[2],
                                               const int (&hi)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float m = row_max[r];
    const int lo_rel = lo[r] - key0, hi_rel = hi[r] - key0;  // compared with immediates below
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if constexpr (MASK) {
          if (8 * nt + e < lo_rel || 8 * nt + e > hi_rel) s[nt][2 * r + e] = kNegInf;
        }
        m = fmaxf(m, s[nt][2 * r + e]);
      }
    }
    m = quad_max(m);
    const float ref = m == kNegInf ? 0.f : m * scale_log2;
    const float alpha = fast_exp2(fmaf(row_max[r], scale_log2, -ref));  // 0 while row_max = -inf
    row_max[r] = m;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pv = fast_exp2(fmaf(s[nt][2 * r + e], scale_log2, -ref));
        s[nt][2 * r + e] = pv;
        sum += pv;
      }
    }
    row_sum[r] = row_sum[r] * alpha + sum;  // per lane; the quad's sums are added at the end
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      o[dt][2 * r] *= alpha;
      o[dt][2 * r + 1] *= alpha;
    }
  }
}

template <typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kMinBlocks) flash_fwd_kernel(const FwdParams p) {
  using T = typename Tile::T;
  constexpr int D = Tile::kD, MT = Tile::kMT, BM = Tile::kBM, BN = Tile::kBN, S = Tile::kStride;
  constexpr int kSteps = D / 16;     // k-steps of S = Q K^T
  constexpr int kKeyTiles = BN / 8;  // 16x8 tiles of S per m-tile
  constexpr int kDimTiles = D / 8;   // 16x8 tiles of O per m-tile

  T* const sQ = reinterpret_cast<T*>(dynamic_smem());
  T* const sK = sQ + Tile::kQElems;
  T* const sV = sK + Tile::kKVElems;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int m_block = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // longest causal rows start first
  const int head = blockIdx.y, batch = blockIdx.z;
  const int m0 = m_block * BM;
  const int warp_row = m0 + warp * Tile::kWarpRows;  // first query row of this warp
  const int q_len = p.q_len, kv_len = p.kv_len;

  const T* q = static_cast<const T*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride;
  const int kv_head = head / p.group;
  // K and V of this CTA's kv head. Recomputed at each tile from opaque copies of the indices:
  // two 64-bit pointers held across the key loop cost the 4 registers d = 128 lacks.
  const auto k_head = [&] {
    return static_cast<const T*>(p.k) + opaque(batch) * p.k_batch_stride + opaque(kv_head) * p.k_head_stride;
  };
  const auto v_head = [&] {
    return static_cast<const T*>(p.v) + opaque(batch) * p.v_batch_stride + opaque(kv_head) * p.v_head_stride;
  };

  // Key tiles any row of this CTA sees: [n_first, n_last]; none when the range is empty.
  const int m_last = (m0 + BM < q_len ? m0 + BM : q_len) - 1;
  const int lo_cta = imax(0, m0 + p.lo_shift);
  const int hi_cta = imin(kv_len - 1, m_last + p.hi_shift);
  const int n_first = lo_cta / BN;
  const int n_last = hi_cta < lo_cta ? n_first - 1 : hi_cta / BN;
  const int g = lane / 4, t = lane % 4;

  float o[MT][kDimTiles][4];
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f;
    row_max[mt][0] = row_max[mt][1] = kNegInf;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }

  // ldmatrix row addresses of this lane (see mma_16816 for the fragment layouts):
  //   Q (A, 16x16 per step): row lane % 16 of the m-tile, columns 8 * (lane / 16) ...;
  //   K (B of two 8-key tiles per x4): key lane % 8 + 8 * (lane / 16), columns 8 * (lane / 8 % 2) ...;
  //   V (B of two 8-column tiles per x4, transposed): key lane % 16, columns 8 * (lane / 16) ...
  const T* q_frag_row = sQ + (warp * Tile::kWarpRows + lane % 16) * S + lane / 16 * 8;
  const T* k_frag_row = sK + (lane % 8 + lane / 16 * 8) * S + lane / 8 % 2 * 8;
  const T* v_frag_row = sV + (lane % 16) * S + lane / 16 * 8;

  if (n_first <= n_last) {
    copy_rows_async<Tile, BM>(sQ, q, p.q_row_stride, m0, q_len, tid);
    copy_rows_async<Tile, BN>(sK, k_head(), p.k_row_stride, n_last * BN, kv_len, tid);
    cp_async_commit();

    uint32_t q_regs[Tile::kQInRegs ? MT : 1][Tile::kQInRegs ? kSteps : 1][4];
    if constexpr (Tile::kQInRegs) {
      cp_async_wait<0>();
      block_sync();
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int kk = 0; kk < kSteps; ++kk) ldmatrix_x4(q_regs[mt][kk], q_frag_row + 16 * mt * S + kk * 16);
      }
    }

    for (int n = n_last; n >= n_first; --n) {
      const int n0 = n * BN;
      cp_async_wait<0>();
      block_sync();  // K(n) landed for every thread; every warp is done reading V(n + 1)
      copy_rows_async<Tile, BN>(sV, v_head(), p.v_row_stride, n0, kv_len, tid);
      cp_async_commit();

      float s[MT][kKeyTiles][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kKeyTiles; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
      }
#pragma unroll
      for (int kk = 0; kk < kSteps; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if constexpr (Tile::kQInRegs) {
            a[mt][0] = q_regs[mt][kk][0], a[mt][1] = q_regs[mt][kk][1];
            a[mt][2] = q_regs[mt][kk][2], a[mt][3] = q_regs[mt][kk][3];
          } else {
            ldmatrix_x4(a[mt], q_frag_row + 16 * mt * S + kk * 16);
          }
        }
#pragma unroll
        for (int np = 0; np < kKeyTiles / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, k_frag_row + np * 16 * S + kk * 16);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<T>(s[mt][2 * np], a[mt], b[0], b[1]);
            mma_16816<T>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
          }
        }
      }

      // No mask when every row of the CTA sees every key of the tile: n0 is at or above the
      // last row's lower bound, n0 + BN - 1 at or below the first row's upper bound and the
      // Sk tail. (Recomputed per tile from the parameters: cheaper than 2 live registers.)
      if (n0 >= m0 + BM - 1 + p.lo_shift && n0 + BN - 1 <= imin(kv_len - 1, m0 + p.hi_shift)) {
        const int unused[2] = {0, 0};
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          online_softmax<false>(s[mt], o[mt], row_max[mt], row_sum[mt], p.scale_log2, n0 + 2 * t, unused, unused);
      } else {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          int lo[2], hi[2];
          row_bounds(p, warp_row + 16 * mt + g, lo, hi);
          online_softmax<true>(s[mt], o[mt], row_max[mt], row_sum[mt], p.scale_log2, n0 + 2 * t, lo, hi);
        }
      }

      cp_async_wait<0>();
      block_sync();  // V(n) landed; every warp is done reading K(n)
      if (n > n_first) {
        copy_rows_async<Tile, BN>(sK, k_head(), p.k_row_stride, n0 - BN, kv_len, tid);
        cp_async_commit();
      }

#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {  // O += P V over 16 keys per step
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          a[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          a[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          a[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          a[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < kDimTiles / 2; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_frag_row + kk * 16 * S + dp * 16);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<T>(o[mt][2 * dp], a[mt], b[0], b[1]);
            mma_16816<T>(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }
  }

  // Epilogue: this warp's rows of O, normalized and rounded, staged in its own rows of the
  // Q buffer (only this warp ever read them), then written with 16-byte stores.
  T* const sO = sQ + warp * Tile::kWarpRows * S;
  const int64_t head_row = int64_t{batch} * p.heads + head;  // (batch, head) row of lse
  warp_sync();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = quad_sum(row_sum[mt][r]);
      const float inv = sum != 0.f ? 1.f / sum : 0.f;  // 0: no key seen; NaN (a NaN score) stays NaN
      const int row = 16 * mt + g + 8 * r;  // within the warp's rows
#pragma unroll
      for (int dt = 0; dt < kDimTiles; ++dt) {
        *reinterpret_cast<uint32_t*>(sO + row * S + dt * 8 + 2 * t) =
            pack2<T>(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
      }
      if (t == 0 && warp_row + row < q_len) {
        p.lse[head_row * q_len + warp_row + row] =
            sum != 0.f ? fmaf(row_max[mt][r], p.scale_log2, log2f(sum)) * 0.6931471805599453f : kNegInf;
      }
    }
  }
  warp_sync();
  T* const out = static_cast<T*>(p.out) + (head_row * q_len + warp_row) * D;
#pragma unroll
  for (int i = 0; i < Tile::kWarpRows * Tile::kChunks / 32; ++i) {
    const int c = lane + 32 * i;
    const int r = c / Tile::kChunks, col = c % Tile::kChunks * 8;
    if (warp_row + r < q_len) {
      *reinterpret_cast<uint4*>(out + int64_t{r} * D + col) = *reinterpret_cast<const uint4*>(sO + r * S + col);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Host side, shared by the launcher and the CPU emulation test.

// Tile per head dim: FwdTile<T, D, MT, WARPS, BN, Q_IN_REGS, MIN_BLOCKS>, BM = 16 * MT * WARPS.
// Accumulator registers per thread are listed (255 at most in all); ptxas -v (nvcc 13.0,
// sm_90) reports 254 / 237 / 245 / 255 / 248 registers used and no spills. Every tile runs
// 8 warps per SM (2 CTAs of 4, or 1 of 8), bounded by registers.
//   D = 32:  128 x 128, 4 warps of 32 rows, Q in registers: S 128 + O 32 + Q 16. The wide
//            key tile halves the per-tile overhead (barriers, O rescales), which dominates
//            at small D. 30 KB of shared memory.
//   D = 64:  128 x 64, 4 warps of 32 rows, Q in registers: S 64 + O 64 + Q 32 (128 keys
//            with Q in shared memory spilled). 36 KB.
//   D = 96, 128: 128 x 64, 4 warps of 32 rows, Q from shared memory (FlashAttention-2's
//            tile for D = 128 on sm_80 / sm_90): S 64 + O 96 / 128. 52 / 68 KB.
//   D = 256: 128 x 64, 8 warps of 16 rows, Q from shared memory: O alone is 128 registers,
//            so a warp takes 16 rows; 8 warps keep 128 rows per K / V tile. 132 KB.
template <typename T, int D>
struct TileFor;
template <typename T>
struct TileFor<T, 32> { using type = FwdTile<T, 32, 2, 4, 128, true, 2>; };
template <typename T>
struct TileFor<T, 64> { using type = FwdTile<T, 64, 2, 4, 64, true, 2>; };
template <typename T>
struct TileFor<T, 96> { using type = FwdTile<T, 96, 2, 4, 64, false, 2>; };
template <typename T>
struct TileFor<T, 128> { using type = FwdTile<T, 128, 2, 4, 64, false, 2>; };
template <typename T>
struct TileFor<T, 256> { using type = FwdTile<T, 256, 1, 8, 64, false, 1>; };

// The contract of attention_cuda.h: sizes, dtype, head dim, alignment and strides.
inline bool args_valid(const cuda_attention::AttentionForwardArgs& a) {
  using cuda_attention::kMaxGridDim;
  using cuda_attention::kMaxSeqLen;
  const auto aligned16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (a.batch < 0 || a.heads < 0 || a.kv_heads < 1 || a.q_len < 0 || a.kv_len < 0) return false;
  if (a.batch > kMaxGridDim || a.heads > kMaxGridDim || a.q_len > kMaxSeqLen || a.kv_len > kMaxSeqLen) return false;
  if (a.heads % a.kv_heads != 0 || !cuda_attention::supports_head_dim(a.head_dim)) return false;
  if (a.dtype != DType::kFloat16 && a.dtype != DType::kBFloat16) return false;
  if (!(a.scale >= 0.f && a.scale <= 3.4e38f)) return false;  // finite, not negative (the binding negates q)
  if (!a.out || !a.lse || !a.q || !aligned16(a.q) || !aligned16(a.out)) return false;
  if (a.kv_len > 0 && (!a.k || !a.v || !aligned16(a.k) || !aligned16(a.v))) return false;
  for (int64_t s : {a.q_batch_stride, a.q_head_stride, a.q_row_stride, a.k_batch_stride, a.k_head_stride,
                    a.k_row_stride, a.v_batch_stride, a.v_head_stride, a.v_row_stride}) {
    if (s < 0 || s % 8 != 0) return false;
  }
  return true;
}

inline int clamp_shift(int64_t s) {
  return static_cast<int>(s < -kMaxShift ? -kMaxShift : s > kMaxShift ? kMaxShift : s);
}

// Kernel parameters of valid arguments. Key j visible to query i iff i + lo_shift <= j <=
// i + hi_shift: off = Sk - Sq, lo_shift = off - window_left, hi_shift = off when causal
// (window_right >= 0 cannot widen it), else off + window_right.
inline FwdParams make_fwd_params(const cuda_attention::AttentionForwardArgs& a) {
  FwdParams p{};
  p.q = a.q, p.k = a.k, p.v = a.v, p.out = a.out, p.lse = a.lse;
  p.q_batch_stride = a.q_batch_stride, p.q_head_stride = a.q_head_stride, p.q_row_stride = a.q_row_stride;
  p.k_batch_stride = a.k_batch_stride, p.k_head_stride = a.k_head_stride, p.k_row_stride = a.k_row_stride;
  p.v_batch_stride = a.v_batch_stride, p.v_head_stride = a.v_head_stride, p.v_row_stride = a.v_row_stride;
  p.heads = static_cast<int>(a.heads);
  p.group = static_cast<int>(a.heads / a.kv_heads);
  p.q_len = static_cast<int>(a.q_len), p.kv_len = static_cast<int>(a.kv_len);
  const int64_t off = a.kv_len - a.q_len, far = int64_t{1} << 40;  // |off| <= 2^29: no overflow
  const int64_t left = a.window_left < far ? a.window_left : far, right = a.window_right < far ? a.window_right : far;
  p.lo_shift = left >= 0 ? clamp_shift(off - left) : -kMaxShift;
  p.hi_shift = a.causal ? clamp_shift(off) : right >= 0 ? clamp_shift(off + right) : kMaxShift;
  // A zero scale (uniform attention) becomes a tiny positive one: 2^(s * 1e-30 - ref) is 1 to
  // the last bit for every finite score, and masked scores stay -inf (where -inf * 0 is NaN).
  p.scale_log2 = a.scale * 1.4426950408889634f;
  if (!(p.scale_log2 >= 1e-30f)) p.scale_log2 = 1e-30f;
  return p;
}

}  // namespace attention
}  // namespace kernelforge
