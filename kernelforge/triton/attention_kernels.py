"""Triton flash-attention kernels (FlashAttention-2): forward, backward dK/dV, backward dQ.

Work per (batch, head), dense: FLOPs 4 * Sq * Sk * D forward (two matmuls), 10 * Sq * Sk * D
backward (five: S = Q K^T and dP = dO V^T recomputed, dV, dK, dQ), about half of that causal.
Bytes: Q, K, V, O once forward (K and V once per query tile, from L2 when the tiles of a
head run together), plus O, dO, dQ, dK, dV and the log-sum-exp backward; no Sq x Sk tensor
ever reaches memory. These kernels are compute bound from a few hundred keys up.

Scores live in log2 units: s2 = scale * log2(e) * q.k (+ log2(e) * additive mask), so the
softmax takes exp2, the SFU's native op. The forward keeps, per query row, the running max
m (log2 units) and the running sum l of exp2(s2 - m); it returns lse = (m + log2 l) * ln 2.

Which keys a query sees (the band, the tails, attn_mask, the BlockMask bits) and which key
tiles need masking: kernelforge/triton/attention_visibility.py.

A row that sees no key keeps m = -inf; the `safe` max (0 in its place) keeps exp2 from
producing NaN, and the epilogue writes out = 0, lse = -inf. A NaN score (a NaN in q, k or a
float mask, or an infinity that makes inf - inf) makes l NaN, and NaN reaches out and lse, as in
torch's softmax: the epilogue tests l != 0, never l > 0. The backward turns lse = -inf
into +inf so that P = exp2(s2 - lse2) = 0 on such rows: their gradients are exactly zero.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernelforge.triton.attention_visibility import (EDGE_AT_RUN_TIME, LN2, LOG2E, col_range,  # noqa: F401
                                                     masked_scores, row_range)


@triton.jit
def finish_rows(acc, m_i, l_i):
    """(out = acc / l, lse in log2 units = m + log2 l) of rows that saw keys; (0, -inf) for
    rows that saw none (l = 0). A NaN l (a NaN score, or inf - inf) is "seen": NaN out and lse."""
    seen = l_i != 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = tl.where(seen[:, None], acc / l_safe[:, None], 0.0)
    return out, tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf"))


@triton.jit
def _query_tile(Q, K, V, MASK, sqb, sqh, sqm, skb, skh, svb, svh, smb, smh, H, GROUP, Sq,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The program of the forward and dQ kernels: one query tile of one (batch, head), the
    heaviest tiles (causal: the last ones) first. Returns its (batch * head) index, batch,
    head, first row, row offsets, the query tile, and the bases of its K, V and mask."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=(offs_m[:, None] < Sq) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_base = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    mask_base = MASK + b.to(tl.int64) * smb + h.to(tl.int64) * smh
    return pid_bh, b, h, m0, offs_m, q, k_base, v_base, mask_base


# ----------------------------------------------------------------------------- forward
@triton.jit
def forward_tile(acc, m_i, l_i, q, k_base, v_base, skn, svn, n0, offs_m, offs_n, offs_d, offs_dv,
                  Sq, Sk, off, LEFT, RIGHT, qk_scale, mask_base, smm, smn, bits_base, partial_id, edge,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, MASKED: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr,
                  BLOCK_SPARSE: tl.constexpr, MB_Q: tl.constexpr, MB_K: tl.constexpr, PRECISION: tl.constexpr):
    cols = n0 + offs_n
    if MASKED:
        kv_rows = cols[:, None] < Sk
    else:
        kv_rows = cols[:, None] >= 0
    k = tl.load(k_base + cols[:, None] * skn + offs_d[None, :], mask=kv_rows & (offs_d[None, :] < HEAD_DIM), other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if MASKED == EDGE_AT_RUN_TIME or not (MASKED or MASK_KIND != 0):
        if MASKED == EDGE_AT_RUN_TIME:  # no additive term: -inf on the raw scores hides a pair as well
            qk = masked_scores(qk, offs_m[:, None], cols[None, :], Sq, Sk, off, LEFT, RIGHT, mask_base, smm, smn,
                                bits_base, partial_id, edge, MASKED, HAS_LEFT, HAS_RIGHT, 0, False, MB_Q, MB_K)
        # scale > 0, so max(qk) * scale is the max of the scaled scores; qk * scale - m is one FMA
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_use = m_new
        if MASKED == EDGE_AT_RUN_TIME:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])
    else:
        s = masked_scores(qk * qk_scale, offs_m[:, None], cols[None, :], Sq, Sk, off, LEFT, RIGHT, mask_base,
                           smm, smn, bits_base, partial_id, edge, MASKED, HAS_LEFT, HAS_RIGHT, MASK_KIND,
                           BLOCK_SPARSE, MB_Q, MB_K)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet: no -inf - -inf
        p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + cols[:, None] * svn + offs_dv[None, :], mask=kv_rows & (offs_dv[None, :] < HEAD_DIM_V),
                other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def flash_forward_kernel(
    Q, K, V, O, LSE, MASK, COUNTS, FULL, BLOCKS, PARTIAL, BITS, SEQLENS,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
    smb, smh, smm, smn, scb, sch, sbb, sbh,
    H, GROUP, Sq, Sk, off, LEFT, RIGHT, qk_scale, NUM_MB_K,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_BAND: tl.constexpr, MASK_KIND: tl.constexpr, BLOCK_SPARSE: tl.constexpr, MB_Q: tl.constexpr,
    MB_K: tl.constexpr, PRECISION: tl.constexpr, ONE_LOOP: tl.constexpr, HAS_SEQLENS: tl.constexpr,
):
    """HAS_SEQLENS: a KV cache filled to SEQLENS[b] (clamped to [0, Sk]): the keys, the tile ranges
    and the band's alignment all end there (the launcher sets HAS_BAND, so that a BlockMask's full
    tiles are checked against it too)."""
    # Inductor passes a Python float as fp64 (eager Triton as fp32): float32 math either way
    qk_scale = tl.cast(qk_scale, tl.float32)
    pid_bh, b, h, m0, offs_m, q, k_base, v_base, mask_base = _query_tile(
        Q, K, V, MASK, sqb, sqh, sqm, skb, skh, svb, svh, smb, smh, H, GROUP, Sq, HEAD_DIM, BLOCK_M, BLOCK_D)
    if HAS_SEQLENS:
        Sk = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), Sk).to(tl.int32)
        off = Sk - Sq
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if BLOCK_SPARSE:
        row = b * scb + h * sch + m0 // MB_Q
        count = tl.load(COUNTS + row)
        full = tl.load(FULL + row)
        list_base = b * sbb + h * sbh + (m0 // MB_Q) * NUM_MB_K
        for t in range(0, full):  # full tiles: inside Sq x Sk, no bits (the band, if any, still masks)
            kb = tl.load(BLOCKS + list_base + t)
            for sub in tl.static_range(MB_K // BLOCK_N):
                acc, m_i, l_i = forward_tile(
                    acc, m_i, l_i, q, k_base, v_base, skn, svn, kb * MB_K + sub * BLOCK_N, offs_m, offs_n, offs_d,
                    offs_dv, Sq, Sk, off, LEFT, RIGHT, qk_scale, mask_base, smm, smn, BITS, -1, True,
                    HEAD_DIM, HEAD_DIM_V, HAS_BAND, HAS_LEFT, HAS_RIGHT, MASK_KIND, False, MB_Q, MB_K, PRECISION)
        for t in range(full, count):  # partial tiles: their bits and every bound
            kb = tl.load(BLOCKS + list_base + t)
            partial_id = tl.load(PARTIAL + list_base + t)
            for sub in tl.static_range(MB_K // BLOCK_N):
                acc, m_i, l_i = forward_tile(
                    acc, m_i, l_i, q, k_base, v_base, skn, svn, kb * MB_K + sub * BLOCK_N, offs_m, offs_n, offs_d,
                    offs_dv, Sq, Sk, off, LEFT, RIGHT, qk_scale, mask_base, smm, smn, BITS, partial_id, True,
                    HEAD_DIM, HEAD_DIM_V, True, HAS_LEFT, HAS_RIGHT, MASK_KIND, True, MB_Q, MB_K, PRECISION)
    else:
        lo, full_lo, full_hi, hi = row_range(m0, Sq, Sk, off, LEFT, RIGHT, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        if ONE_LOOP:
            for n0 in range(lo, hi, BLOCK_N):
                acc, m_i, l_i = forward_tile(
                    acc, m_i, l_i, q, k_base, v_base, skn, svn, n0, offs_m, offs_n, offs_d, offs_dv,
                    Sq, Sk, off, LEFT, RIGHT, qk_scale, mask_base, smm, smn, BITS, -1, (n0 < full_lo) | (n0 >= full_hi),
                    HEAD_DIM, HEAD_DIM_V, EDGE_AT_RUN_TIME, HAS_LEFT, HAS_RIGHT, 0, False, MB_Q, MB_K, PRECISION)
        else:
            for n0 in range(lo, full_lo, BLOCK_N):
                acc, m_i, l_i = forward_tile(
                    acc, m_i, l_i, q, k_base, v_base, skn, svn, n0, offs_m, offs_n, offs_d, offs_dv,
                    Sq, Sk, off, LEFT, RIGHT, qk_scale, mask_base, smm, smn, BITS, -1, True,
                    HEAD_DIM, HEAD_DIM_V, True, HAS_LEFT, HAS_RIGHT, MASK_KIND, False, MB_Q, MB_K, PRECISION)
            for n0 in range(full_lo, full_hi, BLOCK_N):
                acc, m_i, l_i = forward_tile(
                    acc, m_i, l_i, q, k_base, v_base, skn, svn, n0, offs_m, offs_n, offs_d, offs_dv,
                    Sq, Sk, off, LEFT, RIGHT, qk_scale, mask_base, smm, smn, BITS, -1, False,
                    HEAD_DIM, HEAD_DIM_V, False, HAS_LEFT, HAS_RIGHT, MASK_KIND, False, MB_Q, MB_K, PRECISION)
            for n0 in range(full_hi, hi, BLOCK_N):
                acc, m_i, l_i = forward_tile(
                    acc, m_i, l_i, q, k_base, v_base, skn, svn, n0, offs_m, offs_n, offs_d, offs_dv,
                    Sq, Sk, off, LEFT, RIGHT, qk_scale, mask_base, smm, smn, BITS, -1, True,
                    HEAD_DIM, HEAD_DIM_V, True, HAS_LEFT, HAS_RIGHT, MASK_KIND, False, MB_Q, MB_K, PRECISION)

    out, lse2 = finish_rows(acc, m_i, l_i)
    row_ok = offs_m < Sq
    tl.store(LSE + pid_bh.to(tl.int64) * Sq + offs_m, lse2 * LN2, mask=row_ok)
    o_base = O + b.to(tl.int64) * sob + h.to(tl.int64) * soh
    tl.store(o_base + offs_m[:, None] * som + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))


# ----------------------------------------------------------------------------- backward
@triton.jit
def backward_delta_kernel(O, DO, DELTA, sob, soh, som, sdb, sdh, sdm, H, Sq,
                          HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """delta[b, h, i] = sum_d dO * O: the row term of dS = P (dP - delta). Bytes: O and dO
    read once, 4 bytes a row written."""
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    inside = (offs_m[:, None] < Sq) & (offs_d[None, :] < HEAD_DIM_V)
    o = tl.load(O + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * som + offs_d[None, :],
                mask=inside, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + offs_m[:, None] * sdm + offs_d[None, :],
                 mask=inside, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + pid_bh.to(tl.int64) * Sq + offs_m, delta, mask=offs_m < Sq)


@triton.jit
def lse_in_log2(LSE_ROW, offs, Sq, stride):
    """The forward's lse (natural log) of rows `offs` (`stride` apart) in log2 units, +inf for rows
    that saw no key (and past Sq), so that P = exp2(s2 - lse2) is exactly 0 there."""
    lse = tl.load(LSE_ROW + offs * stride, mask=offs < Sq, other=float("-inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def dkdv_tile(dk, dv, k, v, q_base, do_base, lse_row, delta_row, sqm, sdm, m0, offs_m, offs_n, offs_d, offs_dv,
              Sq, Sk, off, LEFT, RIGHT, qk_scale, mask_base, smm, smn, bits_base, partial_id, edge, lse_stride,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, MASKED: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr,
              BLOCK_SPARSE: tl.constexpr, MB_Q: tl.constexpr, MB_K: tl.constexpr, PRECISION: tl.constexpr):
    """One query tile's contribution to a key tile's dK, dV, transposed (keys as rows):
    P^T = exp2(K Q^T - lse2), dV += P^T dO, dS^T = P^T (V dO^T - delta), dK += dS^T Q. The rows'
    lse lie lse_stride apart (1 here; the packed layout of attention_varlen.py), their delta 1."""
    rows = m0 + offs_m
    if MASKED:
        q_rows = rows[:, None] < Sq
    else:
        q_rows = rows[:, None] >= 0
    q = tl.load(q_base + rows[:, None] * sqm + offs_d[None, :], mask=q_rows & (offs_d[None, :] < HEAD_DIM), other=0.0)
    do = tl.load(do_base + rows[:, None] * sdm + offs_dv[None, :], mask=q_rows & (offs_dv[None, :] < HEAD_DIM_V),
                 other=0.0)
    lse2 = lse_in_log2(lse_row, rows, Sq, lse_stride)
    delta = tl.load(delta_row + rows, mask=rows < Sq, other=0.0)
    sT = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
    sT = masked_scores(sT, rows[None, :], offs_n[:, None], Sq, Sk, off, LEFT, RIGHT, mask_base, smm, smn,
                        bits_base, partial_id, edge, MASKED, HAS_LEFT, HAS_RIGHT, MASK_KIND, BLOCK_SPARSE, MB_Q, MB_K)
    pT = tl.math.exp2(sT - lse2[None, :])
    dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
    dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    dsT = pT * (dpT - delta[None, :])
    dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def flash_backward_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, MASK, COUNTS, FULL, BLOCKS, PARTIAL, BITS,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm,
    sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
    smb, smh, smm, smn, scb, sch, sbb, sbh,
    H, HKV, GROUP, Sq, Sk, off, LEFT, RIGHT, qk_scale, scale, NUM_MB_Q,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_BAND: tl.constexpr, MASK_KIND: tl.constexpr, BLOCK_SPARSE: tl.constexpr, MB_Q: tl.constexpr,
    MB_K: tl.constexpr, PRECISION: tl.constexpr, ONE_LOOP: tl.constexpr,
):
    """One program per (key tile, batch, kv head): walks the query tiles that see the key
    tile, for every q head of the group in turn, so dK and dV are summed in a fixed order
    (deterministic, no atomics) and written once."""
    # Inductor passes a Python float as fp64 (eager Triton as fp32): float32 math either way
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_ok = offs_n[:, None] < Sk
    k = tl.load(K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh + offs_n[:, None] * skn + offs_d[None, :],
                mask=key_ok & (offs_d[None, :] < HEAD_DIM), other=0.0)
    v = tl.load(V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh + offs_n[:, None] * svn + offs_dv[None, :],
                mask=key_ok & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    # float32 ("ieee") dots are chains of FMAs accumulating into dk / dv (Triton folds acc + dot
    # into the dot): over the whole group, each element would be one chain of GROUP * Sq
    # roundings, twice PyTorch's error with four heads a group at Sq = 1000 (per-head GEMMs, then
    # a sum over heads), which the 2x-error rule caught on an H200. Summing each head's chain
    # into dk_sum / dv_sum keeps the chains as long as PyTorch's; on tensor cores the
    # accumulators stay single (no registers for a second pair where they are scarcest).
    dk_sum = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv_sum = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        do_base = DO + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh
        row = (b * H + h).to(tl.int64) * Sq
        mask_base = MASK + b.to(tl.int64) * smb + h.to(tl.int64) * smh
        if BLOCK_SPARSE:
            count = tl.load(COUNTS + b * scb + h * sch + n0 // MB_K)
            full = tl.load(FULL + b * scb + h * sch + n0 // MB_K)
            list_base = b * sbb + h * sbh + (n0 // MB_K) * NUM_MB_Q
            for t in range(0, full):
                qb = tl.load(BLOCKS + list_base + t)
                for sub in tl.static_range(MB_Q // BLOCK_M):
                    dk, dv = dkdv_tile(dk, dv, k, v, q_base, do_base, LSE + row, DELTA + row, sqm, sdm,
                                       qb * MB_Q + sub * BLOCK_M, offs_m, offs_n, offs_d, offs_dv, Sq, Sk, off, LEFT,
                                       RIGHT, qk_scale, mask_base, smm, smn, BITS, -1, True, 1, HEAD_DIM, HEAD_DIM_V,
                                       HAS_BAND, HAS_LEFT, HAS_RIGHT, MASK_KIND, False, MB_Q, MB_K, PRECISION)
            for t in range(full, count):
                qb = tl.load(BLOCKS + list_base + t)
                partial_id = tl.load(PARTIAL + list_base + t)
                for sub in tl.static_range(MB_Q // BLOCK_M):
                    dk, dv = dkdv_tile(dk, dv, k, v, q_base, do_base, LSE + row, DELTA + row, sqm, sdm,
                                       qb * MB_Q + sub * BLOCK_M, offs_m, offs_n, offs_d, offs_dv, Sq, Sk, off, LEFT,
                                       RIGHT, qk_scale, mask_base, smm, smn, BITS, partial_id, True, 1, HEAD_DIM,
                                       HEAD_DIM_V, True, HAS_LEFT, HAS_RIGHT, MASK_KIND, True, MB_Q, MB_K, PRECISION)
        else:
            lo, full_lo, full_hi, hi = col_range(n0, Sq, Sk, off, LEFT, RIGHT, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
            if ONE_LOOP:
                for m0 in range(lo, hi, BLOCK_M):
                    dk, dv = dkdv_tile(dk, dv, k, v, q_base, do_base, LSE + row, DELTA + row, sqm, sdm, m0,
                                       offs_m, offs_n, offs_d, offs_dv, Sq, Sk, off, LEFT, RIGHT, qk_scale,
                                       mask_base, smm, smn, BITS, -1, (m0 < full_lo) | (m0 >= full_hi), 1, HEAD_DIM,
                                       HEAD_DIM_V, EDGE_AT_RUN_TIME, HAS_LEFT, HAS_RIGHT, 0, False, MB_Q, MB_K,
                                       PRECISION)
            else:
                for m0 in range(lo, full_lo, BLOCK_M):
                    dk, dv = dkdv_tile(dk, dv, k, v, q_base, do_base, LSE + row, DELTA + row, sqm, sdm, m0,
                                       offs_m, offs_n, offs_d, offs_dv, Sq, Sk, off, LEFT, RIGHT, qk_scale,
                                       mask_base, smm, smn, BITS, -1, True, 1, HEAD_DIM, HEAD_DIM_V, True,
                                       HAS_LEFT, HAS_RIGHT, MASK_KIND, False, MB_Q, MB_K, PRECISION)
                for m0 in range(full_lo, full_hi, BLOCK_M):
                    dk, dv = dkdv_tile(dk, dv, k, v, q_base, do_base, LSE + row, DELTA + row, sqm, sdm, m0,
                                       offs_m, offs_n, offs_d, offs_dv, Sq, Sk, off, LEFT, RIGHT, qk_scale,
                                       mask_base, smm, smn, BITS, -1, False, 1, HEAD_DIM, HEAD_DIM_V, False,
                                       HAS_LEFT, HAS_RIGHT, MASK_KIND, False, MB_Q, MB_K, PRECISION)
                for m0 in range(full_hi, hi, BLOCK_M):
                    dk, dv = dkdv_tile(dk, dv, k, v, q_base, do_base, LSE + row, DELTA + row, sqm, sdm, m0,
                                       offs_m, offs_n, offs_d, offs_dv, Sq, Sk, off, LEFT, RIGHT, qk_scale,
                                       mask_base, smm, smn, BITS, -1, True, 1, HEAD_DIM, HEAD_DIM_V, True,
                                       HAS_LEFT, HAS_RIGHT, MASK_KIND, False, MB_Q, MB_K, PRECISION)
        if PRECISION == "ieee":
            dk_sum += dk
            dv_sum += dv
            dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    if PRECISION == "ieee":
        dk = dk_sum
        dv = dv_sum
    key_ok = offs_n[:, None] < Sk
    tl.store(DK + b.to(tl.int64) * sdkb + hk.to(tl.int64) * sdkh + offs_n[:, None] * sdkn + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=key_ok & (offs_d[None, :] < HEAD_DIM))
    tl.store(DV + b.to(tl.int64) * sdvb + hk.to(tl.int64) * sdvh + offs_n[:, None] * sdvn + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=key_ok & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def dq_tile(dq, q, do, lse2, delta, k_base, v_base, skn, svn, n0, offs_m, offs_n, offs_d, offs_dv,
            Sq, Sk, off, LEFT, RIGHT, qk_scale, mask_base, smm, smn, bits_base, partial_id, edge,
            HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, MASKED: tl.constexpr,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr,
            BLOCK_SPARSE: tl.constexpr, MB_Q: tl.constexpr, MB_K: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile's contribution to a query tile's dQ: P = exp2(Q K^T - lse2),
    dS = P (dO V^T - delta), dQ += dS K."""
    cols = n0 + offs_n
    if MASKED:
        kv_rows = cols[:, None] < Sk
    else:
        kv_rows = cols[:, None] >= 0
    k = tl.load(k_base + cols[:, None] * skn + offs_d[None, :], mask=kv_rows & (offs_d[None, :] < HEAD_DIM), other=0.0)
    v = tl.load(v_base + cols[:, None] * svn + offs_dv[None, :], mask=kv_rows & (offs_dv[None, :] < HEAD_DIM_V),
                other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = masked_scores(s, offs_m[:, None], cols[None, :], Sq, Sk, off, LEFT, RIGHT, mask_base, smm, smn,
                       bits_base, partial_id, edge, MASKED, HAS_LEFT, HAS_RIGHT, MASK_KIND, BLOCK_SPARSE, MB_Q, MB_K)
    p = tl.math.exp2(s - lse2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)


@triton.jit
def flash_backward_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, MASK, COUNTS, FULL, BLOCKS, PARTIAL, BITS,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm, sdqb, sdqh, sdqm,
    smb, smh, smm, smn, scb, sch, sbb, sbh,
    H, GROUP, Sq, Sk, off, LEFT, RIGHT, qk_scale, scale, NUM_MB_K,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_BAND: tl.constexpr, MASK_KIND: tl.constexpr, BLOCK_SPARSE: tl.constexpr, MB_Q: tl.constexpr,
    MB_K: tl.constexpr, PRECISION: tl.constexpr, ONE_LOOP: tl.constexpr,
):
    """One program per (query tile, batch, head), over the key tiles it sees, as the forward."""
    # Inductor passes a Python float as fp64 (eager Triton as fp32): float32 math either way
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)
    pid_bh, b, h, m0, offs_m, q, k_base, v_base, mask_base = _query_tile(
        Q, K, V, MASK, sqb, sqh, sqm, skb, skh, svb, svh, smb, smh, H, GROUP, Sq, HEAD_DIM, BLOCK_M, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m[:, None] < Sq
    do = tl.load(DO + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + offs_m[:, None] * sdm + offs_dv[None, :],
                 mask=row_ok & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    row = pid_bh.to(tl.int64) * Sq
    lse2 = lse_in_log2(LSE + row, offs_m, Sq, 1)
    delta = tl.load(DELTA + row + offs_m, mask=offs_m < Sq, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if BLOCK_SPARSE:
        count = tl.load(COUNTS + b * scb + h * sch + m0 // MB_Q)
        full = tl.load(FULL + b * scb + h * sch + m0 // MB_Q)
        list_base = b * sbb + h * sbh + (m0 // MB_Q) * NUM_MB_K
        for t in range(0, full):
            kb = tl.load(BLOCKS + list_base + t)
            for sub in tl.static_range(MB_K // BLOCK_N):
                dq = dq_tile(dq, q, do, lse2, delta, k_base, v_base, skn, svn, kb * MB_K + sub * BLOCK_N, offs_m,
                             offs_n, offs_d, offs_dv, Sq, Sk, off, LEFT, RIGHT, qk_scale, mask_base, smm, smn, BITS,
                             -1, True, HEAD_DIM, HEAD_DIM_V, HAS_BAND, HAS_LEFT, HAS_RIGHT, MASK_KIND, False, MB_Q,
                             MB_K, PRECISION)
        for t in range(full, count):
            kb = tl.load(BLOCKS + list_base + t)
            partial_id = tl.load(PARTIAL + list_base + t)
            for sub in tl.static_range(MB_K // BLOCK_N):
                dq = dq_tile(dq, q, do, lse2, delta, k_base, v_base, skn, svn, kb * MB_K + sub * BLOCK_N, offs_m,
                             offs_n, offs_d, offs_dv, Sq, Sk, off, LEFT, RIGHT, qk_scale, mask_base, smm, smn, BITS,
                             partial_id, True, HEAD_DIM, HEAD_DIM_V, True, HAS_LEFT, HAS_RIGHT, MASK_KIND, True,
                             MB_Q, MB_K, PRECISION)
    else:
        lo, full_lo, full_hi, hi = row_range(m0, Sq, Sk, off, LEFT, RIGHT, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        if ONE_LOOP:
            for n0 in range(lo, hi, BLOCK_N):
                dq = dq_tile(dq, q, do, lse2, delta, k_base, v_base, skn, svn, n0, offs_m, offs_n, offs_d, offs_dv,
                             Sq, Sk, off, LEFT, RIGHT, qk_scale, mask_base, smm, smn, BITS, -1,
                             (n0 < full_lo) | (n0 >= full_hi), HEAD_DIM, HEAD_DIM_V, EDGE_AT_RUN_TIME, HAS_LEFT,
                             HAS_RIGHT, 0, False, MB_Q, MB_K, PRECISION)
        else:
            for n0 in range(lo, full_lo, BLOCK_N):
                dq = dq_tile(dq, q, do, lse2, delta, k_base, v_base, skn, svn, n0, offs_m, offs_n, offs_d, offs_dv,
                             Sq, Sk, off, LEFT, RIGHT, qk_scale, mask_base, smm, smn, BITS, -1, True, HEAD_DIM,
                             HEAD_DIM_V, True, HAS_LEFT, HAS_RIGHT, MASK_KIND, False, MB_Q, MB_K, PRECISION)
            for n0 in range(full_lo, full_hi, BLOCK_N):
                dq = dq_tile(dq, q, do, lse2, delta, k_base, v_base, skn, svn, n0, offs_m, offs_n, offs_d, offs_dv,
                             Sq, Sk, off, LEFT, RIGHT, qk_scale, mask_base, smm, smn, BITS, -1, False, HEAD_DIM,
                             HEAD_DIM_V, False, HAS_LEFT, HAS_RIGHT, MASK_KIND, False, MB_Q, MB_K, PRECISION)
            for n0 in range(full_hi, hi, BLOCK_N):
                dq = dq_tile(dq, q, do, lse2, delta, k_base, v_base, skn, svn, n0, offs_m, offs_n, offs_d, offs_dv,
                             Sq, Sk, off, LEFT, RIGHT, qk_scale, mask_base, smm, smn, BITS, -1, True, HEAD_DIM,
                             HEAD_DIM_V, True, HAS_LEFT, HAS_RIGHT, MASK_KIND, False, MB_Q, MB_K, PRECISION)
    tl.store(DQ + b.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh + offs_m[:, None] * sdqm + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=row_ok & (offs_d[None, :] < HEAD_DIM))
