"""Which keys a query sees, for the Triton flash-attention kernels (attention_kernels.py and
attention_decode.py): the masked scores of a tile and the ranges of tiles that need masking.

Which keys a query sees: a band of positions relative to p = i + off (off = Sk - Sq: causal
aligned to the bottom right), p - LEFT <= j <= p + RIGHT (HAS_LEFT / HAS_RIGHT say whether
each side is bounded), the Sk tail, a bool or additive mask (MASK_KIND 1 / 2, read through
strides so a broadcast mask costs no memory), and for block-sparse calls the BlockMask's
tile lists and partial-tile bits. Tiles wholly inside every bound run the MASKED=False
variant: no per-element index math, no -inf guard.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernelforge.triton.masks import block_and_scalar

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# A value of the MASKED parameter: a short band walked as one pipelined loop, whose first and
# last tiles take the band check under a run-time branch (the three-loop split of masked /
# unmasked / masked tiles pays a pipeline fill and drain per loop: on a 9-tile window run that
# cost 20%; benchmarks/results/nvidia-h200/0.1.0/attention/window-experiment/).
EDGE_AT_RUN_TIME = tl.constexpr(2)


# ----------------------------------------------------------------------------- shared pieces
@triton.jit
def in_band(i, j, Sq, Sk, off, LEFT, RIGHT, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    ok = (i < Sq) & (j < Sk)
    if HAS_LEFT:
        ok = ok & (j >= i + off - LEFT)
    if HAS_RIGHT:
        ok = ok & (j <= i + off + RIGHT)
    return ok


@triton.jit
def masked_scores(s, i, j, Sq, Sk, off, LEFT, RIGHT, mask_base, smm, smn, bits_base, partial_id, edge,
                   MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   MASK_KIND: tl.constexpr, BLOCK_SPARSE: tl.constexpr, MB_Q: tl.constexpr, MB_K: tl.constexpr):
    """Scores s of query rows i and key columns j (broadcastable index tiles, either
    orientation) with every mask applied: hidden pairs become -inf. MASKED: 0 none but
    attn_mask, 1 every bound, EDGE_AT_RUN_TIME the band and the tails only where the run-time
    `edge` is true (no attn_mask, no block mask; s may be unscaled then)."""
    inside = (i < Sq) & (j < Sk)
    if MASK_KIND == 2:
        s += tl.load(mask_base + i * smm + j * smn, mask=inside, other=0.0).to(tl.float32) * LOG2E
    if MASKED == EDGE_AT_RUN_TIME:
        if edge:
            s = tl.where(in_band(i, j, Sq, Sk, off, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT), s, float("-inf"))
    elif MASKED:
        ok = in_band(i, j, Sq, Sk, off, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT)
        if MASK_KIND == 1:
            ok = ok & (tl.load(mask_base + i * smm + j * smn, mask=inside, other=0) != 0)
        if BLOCK_SPARSE:
            bits = tl.load(bits_base + partial_id * (MB_Q * MB_K) + (i % MB_Q) * MB_K + (j % MB_K),
                           mask=block_and_scalar(inside, partial_id >= 0), other=1)
            ok = ok & (bits != 0)
        s = tl.where(ok, s, float("-inf"))
    elif MASK_KIND == 1:
        s = tl.where(tl.load(mask_base + i * smm + j * smn, mask=inside, other=0) != 0, s, float("-inf"))
    return s


@triton.jit
def row_range(m0, Sq, Sk, off, LEFT, RIGHT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key tiles for query rows [m0, m0 + BLOCK_M): [lo, full_lo) and [full_hi, hi) need
    masking, [full_lo, full_hi) lie inside every bound. lo, full_lo, full_hi are multiples
    of BLOCK_N (or equal to hi)."""
    m_last = tl.minimum(m0 + BLOCK_M, Sq) - 1
    lo = 0
    hi = Sk
    full_lo = 0
    full_hi = (Sk // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        lo = tl.maximum(m0 + off - LEFT, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.maximum(m_last + off - LEFT + BLOCK_N - 1, 0) // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(hi, tl.maximum(m_last + off + RIGHT + 1, 0))
        full_hi = tl.minimum(full_hi, tl.maximum(m0 + off + RIGHT + 1, 0) // BLOCK_N * BLOCK_N)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def col_range(n0, Sq, Sk, off, LEFT, RIGHT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query tiles that see some key of [n0, n0 + BLOCK_N) (the transpose of row_range):
    [lo, full_lo) and [full_hi, hi) need masking, [full_lo, full_hi) none."""
    n_last = tl.minimum(n0 + BLOCK_N, Sk) - 1
    lo = 0
    hi = Sq
    full_lo = 0
    full_hi = (Sq // BLOCK_M) * BLOCK_M
    if n0 + BLOCK_N > Sk:  # the key tail: every tile is checked against Sk
        full_hi = 0
    if HAS_RIGHT:  # j <= i + off + RIGHT  <=>  i >= j - off - RIGHT
        lo = tl.maximum(n0 - off - RIGHT, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.maximum(n_last - off - RIGHT + BLOCK_M - 1, 0) // BLOCK_M * BLOCK_M
    if HAS_LEFT:  # j >= i + off - LEFT  <=>  i <= j - off + LEFT
        hi = tl.minimum(hi, tl.maximum(n_last - off + LEFT + 1, 0))
        full_hi = tl.minimum(full_hi, tl.maximum(n0 - off + LEFT + 1, 0) // BLOCK_M * BLOCK_M)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi
