"""Experiment (not wired into the library): Gluon backward kernels (dK/dV and dQ) for a band of
keys (sliding window) on Hopper, against the library's Triton backward.

Why: on the causal window of 512 (S = 8192, d128, bf16, H200) the Triton backward takes
~0.65 ms against the Gluon forward's 0.19, and forward+backward sits at 1.19x FlexAttention
against a 1.5x target. Triton's dK/dV kernel holds K, V, dK and dV in registers (255 a thread,
spilling); here K and V stay in shared memory as wgmma operands and the two score MMAs of a
query tile run asynchronously ahead of the elementwise work.

One warpgroup per 64-key tile of one (batch, kv head); it walks the query tiles that see the
key tile (attention_visibility._col_range), for every q head of the group, as one loop:

    issue S^T = K Q_i^T and dP^T = V dO_i^T   (async wgmma, both operands in shared memory)
    wait S^T; P^T = exp2(S^T * scale - lse_i)  (masked on edge tiles)
    issue dV += P^T dO_i                       (P^T from registers)
    wait dP^T; dS^T = P^T (dP^T - delta_i)
    issue dK += dS^T Q_i                       (dS^T from registers)
    wait all; refill the Q / dO ring slot by TMA

FLOPs per tile pair: 4 MMAs of 2 * 64 * 64 * D. Bytes: K, V read once, Q, dO (and lse,
delta) once per key tile that sees them (from L2), dK, dV written once. The dQ kernel walks
a query tile's band as the forward does (S and dP recomputed, dQ += dS K: 3 MMAs a pair).

Status: both compiled for sm_90a here (--compile-only: dK/dV d128 255 registers, 4 bytes
spilled, 98 KB shared; dQ d128 156 registers; d64 213 / 122, none spilled); not yet run on a
GPU. Run:

    python3 benchmarks/gluon_backward_experiment.py              # GPU: agreement and timing
    python3 benchmarks/gluon_backward_experiment.py --compile-only  # CPU: sm_90a build report
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kernelforge.triton.attention_gluon import (_band_tiles, _descriptor, _issue_tile, one_and_two_rings,
                                                query_tile_program)
from kernelforge.triton.attention_visibility import _col_range, _in_band

BLOCK_M = 64  # query rows a step
BLOCK_N = 64  # keys a program (one warpgroup's wgmma height)
STAGES = 2
NUM_WARPS = 4
LOG2E = 1.4426950408889634
LOG2E_C: gl.constexpr = gl.constexpr(1.4426950408889634)


@gluon.jit
def band_dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, DELTA,
                     H, GROUP, Sq, Sk, off, LEFT, RIGHT, qk_scale, scale,
                     HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr,
                     num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype

    HKV = H // GROUP
    pid_bh = gl.program_id(1)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    n0 = gl.program_id(0) * BLOCK_N
    lo, full_lo, full_hi, hi = _col_range(n0, Sq, Sk, off, LEFT, RIGHT, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    per_head = gl.cdiv(hi - lo, BLOCK_M)
    steps = per_head * GROUP

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    q_cols: gl.constexpr = gl.SliceLayout(0, s_layout)

    # K and V come once, on one barrier; Q and dO stream through rings
    k_buf, kv_ready, q_bufs, q_ready, do_bufs, do_ready = one_and_two_rings(k_desc, q_desc, do_desc, STAGES)
    v_buf = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)

    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], kv_ready, k_buf)
    tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0], kv_ready, v_buf)
    for st in gl.static_range(STAGES):
        h_st = hk * GROUP + st // gl.maximum(per_head, 1)
        m_st = lo + (st % gl.maximum(per_head, 1)) * BLOCK_M
        _issue_tile(q_desc, q_bufs, q_ready, b, h_st, m_st, st, st < steps)
        _issue_tile(do_desc, do_bufs, do_ready, b, h_st, m_st, st, st < steps)

    k = k_buf.reshape([BLOCK_N, HEAD_DIM])
    v = v_buf.reshape([BLOCK_N, HEAD_DIM])
    keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BLOCK_M, layout=q_cols)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(kv_ready, 0)

    for t in range(steps):
        slot = t % STAGES
        phase = (t // STAGES) & 1
        h = hk * GROUP + t // per_head
        m0 = lo + (t % per_head) * BLOCK_M
        q_i = q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
        do_i = do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
        mbarrier.wait(q_ready.index(slot), phase)
        sT = warpgroup_mma(k, q_i.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(slot), phase)
        dpT = warpgroup_mma(v, do_i.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # the rows' lse (log2 units, +inf where a row saw no key or lies past Sq)
        rows = m0 + cols
        row_base = (b * H + h).to(gl.int64) * Sq
        lse = gl.load(LSE + row_base + rows, mask=rows < Sq, other=float("-inf"))
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)
        sT = warpgroup_mma_wait(1, deps=(sT,))
        if (m0 < full_lo) | (m0 >= full_hi):
            ok = _in_band(rows[None, :], keys[:, None], Sq, Sk, off, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT)
            sT = gl.where(ok, sT, float("-inf"))
        pT = gl.exp2(sT * qk_scale - lse2[None, :])
        pT_op = gl.convert_layout(pT.to(dtype), op_layout)
        dv = warpgroup_mma(pT_op, do_i, dv, is_async=True)
        # delta loaded only now: its registers are not live across the exponentials
        delta = gl.load(DELTA + row_base + rows, mask=rows < Sq, other=0.0)
        dpT = warpgroup_mma_wait(1, deps=(dpT,))
        dsT = pT * (dpT - delta[None, :])
        dsT_op = gl.convert_layout(dsT.to(dtype), op_layout)
        dk = warpgroup_mma(dsT_op, q_i, dk, is_async=True)
        # the register operands stay live until their MMAs are done
        dv, dk, pT_op, dsT_op = warpgroup_mma_wait(0, deps=(dv, dk, pT_op, dsT_op))
        # slot `slot` is free: fetch step t + STAGES into it
        nxt = t + STAGES
        h_n = hk * GROUP + nxt // per_head
        m_n = lo + (nxt % per_head) * BLOCK_M
        _issue_tile(q_desc, q_bufs, q_ready, b, h_n, m_n, slot, nxt < steps)
        _issue_tile(do_desc, do_bufs, do_ready, b, h_n, m_n, slot, nxt < steps)

    mbarrier.invalidate(kv_ready)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(q_ready.index(st))
        mbarrier.invalidate(do_ready.index(st))
    # dK = scale * sum dS^T Q, dV = sum P^T dO, through K's and V's buffers (every MMA is done)
    k.store((dk * scale).to(dtype))
    v.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, n0, 0], k_buf)
    tma.async_copy_shared_to_global(dv_desc, [b, hk, n0, 0], v_buf)
    tma.store_wait(0)


@gluon.jit
def _dkdv_probs(sT, t, per_head, hk, GROUP, lo, full_lo, full_hi, keys, cols, b, H, LSE, Sq, Sk, off, LEFT, RIGHT,
                qk_scale, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_M: gl.constexpr):
    """Step t of the dK/dV walk, its S^T and dP^T MMAs issued: its rows' lse, the wait for S^T,
    P^T = exp2(S^T * scale - lse) (masked on edge tiles)."""
    h = hk * GROUP + t // per_head
    m0 = lo + (t % per_head) * BLOCK_M
    rows = m0 + cols
    row_base = (b * H + h).to(gl.int64) * Sq
    lse = gl.load(LSE + row_base + rows, mask=rows < Sq, other=float("-inf"))
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)
    sT = warpgroup_mma_wait(1, deps=(sT,))
    if (m0 < full_lo) | (m0 >= full_hi):
        ok = _in_band(rows[None, :], keys[:, None], Sq, Sk, off, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT)
        sT = gl.where(ok, sT, float("-inf"))
    return gl.exp2(sT * qk_scale - lse2[None, :]), row_base + rows, rows < Sq


@gluon.jit
def _issue_scores_T(k, v, q_bufs, q_ready, do_bufs, do_ready, t, s_zero, STAGES: gl.constexpr):
    """S^T = K Q_t^T and dP^T = V dO_t^T, async, once their ring slots have landed."""
    BLOCK_M: gl.constexpr = q_bufs.type.shape[3]
    HEAD_DIM: gl.constexpr = q_bufs.type.shape[4]
    slot = t % STAGES
    phase = (t // STAGES) & 1
    mbarrier.wait(q_ready.index(slot), phase)
    sT = warpgroup_mma(k, q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), s_zero, use_acc=False,
                       is_async=True)
    mbarrier.wait(do_ready.index(slot), phase)
    dpT = warpgroup_mma(v, do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), s_zero,
                        use_acc=False, is_async=True)
    return sT, dpT


@gluon.jit
def band_dkdv_pipelined_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, DELTA,
                               H, GROUP, Sq, Sk, off, LEFT, RIGHT, qk_scale, scale,
                               HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr,
                               num_warps: gl.constexpr):
    """band_dkdv_kernel with step t + 1's two score MMAs issued right behind step t's dV and dK
    MMAs, then a wait for those two alone (the tensor cores never drain between steps)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype

    HKV = H // GROUP
    pid_bh = gl.program_id(1)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    n0 = gl.program_id(0) * BLOCK_N
    lo, full_lo, full_hi, hi = _col_range(n0, Sq, Sk, off, LEFT, RIGHT, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    per_head = gl.maximum(gl.cdiv(hi - lo, BLOCK_M), 1)  # a key tile no row sees walks one masked step
    steps = per_head * GROUP

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)

    k_buf, kv_ready, q_bufs, q_ready, do_bufs, do_ready = one_and_two_rings(k_desc, q_desc, do_desc, STAGES)
    v_buf = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], kv_ready, k_buf)
    tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0], kv_ready, v_buf)
    for st in gl.static_range(STAGES):
        h_st = hk * GROUP + st // per_head
        m_st = lo + (st % per_head) * BLOCK_M
        _issue_tile(q_desc, q_bufs, q_ready, b, h_st, m_st, st, st < steps)
        _issue_tile(do_desc, do_bufs, do_ready, b, h_st, m_st, st, st < steps)

    k = k_buf.reshape([BLOCK_N, HEAD_DIM])
    v = v_buf.reshape([BLOCK_N, HEAD_DIM])
    keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(kv_ready, 0)
    sT, dpT = _issue_scores_T(k, v, q_bufs, q_ready, do_bufs, do_ready, 0, s_zero, STAGES)
    for t in range(steps - 1):
        slot = t % STAGES
        pT, row_at, row_in = _dkdv_probs(sT, t, per_head, hk, GROUP, lo, full_lo, full_hi, keys, cols, b, H, LSE,
                                         Sq, Sk, off, LEFT, RIGHT, qk_scale, HAS_LEFT, HAS_RIGHT, BLOCK_M)
        pT_op = gl.convert_layout(pT.to(dtype), op_layout)
        dv = warpgroup_mma(pT_op, do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM]), dv, is_async=True)
        delta = gl.load(DELTA + row_at, mask=row_in, other=0.0)
        dpT = warpgroup_mma_wait(1, deps=(dpT,))
        dsT_op = gl.convert_layout((pT * (dpT - delta[None, :])).to(dtype), op_layout)
        dk = warpgroup_mma(dsT_op, q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM]), dk, is_async=True)
        sT, dpT = _issue_scores_T(k, v, q_bufs, q_ready, do_bufs, do_ready, t + 1, s_zero, STAGES)
        dv, dk, pT_op, dsT_op = warpgroup_mma_wait(2, deps=(dv, dk, pT_op, dsT_op))
        nxt = t + STAGES  # slot `slot` is free: fetch step t + STAGES into it
        h_n = hk * GROUP + nxt // per_head
        m_n = lo + (nxt % per_head) * BLOCK_M
        _issue_tile(q_desc, q_bufs, q_ready, b, h_n, m_n, slot, nxt < steps)
        _issue_tile(do_desc, do_bufs, do_ready, b, h_n, m_n, slot, nxt < steps)
    last = (steps - 1) % STAGES
    pT, row_at, row_in = _dkdv_probs(sT, steps - 1, per_head, hk, GROUP, lo, full_lo, full_hi, keys, cols, b, H, LSE,
                                     Sq, Sk, off, LEFT, RIGHT, qk_scale, HAS_LEFT, HAS_RIGHT, BLOCK_M)
    pT_op = gl.convert_layout(pT.to(dtype), op_layout)
    dv = warpgroup_mma(pT_op, do_bufs.index(last).reshape([BLOCK_M, HEAD_DIM]), dv, is_async=True)
    delta = gl.load(DELTA + row_at, mask=row_in, other=0.0)
    dpT = warpgroup_mma_wait(1, deps=(dpT,))
    dsT_op = gl.convert_layout((pT * (dpT - delta[None, :])).to(dtype), op_layout)
    dk = warpgroup_mma(dsT_op, q_bufs.index(last).reshape([BLOCK_M, HEAD_DIM]), dk, is_async=True)
    dv, dk, pT_op, dsT_op = warpgroup_mma_wait(0, deps=(dv, dk, pT_op, dsT_op))

    mbarrier.invalidate(kv_ready)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(q_ready.index(st))
        mbarrier.invalidate(do_ready.index(st))
    k.store((dk * scale).to(dtype))
    v.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, n0, 0], k_buf)
    tma.async_copy_shared_to_global(dv_desc, [b, hk, n0, 0], v_buf)
    tma.store_wait(0)


@gluon.jit
def band_dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE, DELTA,
                   H, GROUP, Sq, Sk, off, LEFT, RIGHT, qk_scale, scale,
                   HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr,
                   num_warps: gl.constexpr):
    """dQ of one 64-row query tile over its band, as the forward walks it:
    issue S = Q K_j^T and dP = dO V_j^T; wait S, P = exp2(S * scale - lse); wait dP,
    dS = P (dP - delta); issue dQ += dS K_j; wait; refill the K / V slots."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype

    pid_bh, b, h, hk, m0 = query_tile_program(H, GROUP, BLOCK_M)
    lo, tiles, full_lo, full_hi = _band_tiles(m0, Sq, Sk, off, LEFT, RIGHT, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)

    # Q and dO come once (on Q's barrier), K and V stream through rings
    q_buf, qdo_ready, k_bufs, k_ready, v_bufs, v_ready = one_and_two_rings(q_desc, k_desc, v_desc, STAGES)
    do_buf = gl.allocate_shared_memory(dtype, do_desc.block_type.shape, do_desc.layout)
    mbarrier.expect(qdo_ready, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], qdo_ready, q_buf)
    tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], qdo_ready, do_buf)
    for st in gl.static_range(STAGES):
        _issue_tile(k_desc, k_bufs, k_ready, b, hk, lo + st * BLOCK_N, st, st < tiles)
        _issue_tile(v_desc, v_bufs, v_ready, b, hk, lo + st * BLOCK_N, st, st < tiles)

    q = q_buf.reshape([BLOCK_M, HEAD_DIM])
    do = do_buf.reshape([BLOCK_M, HEAD_DIM])
    rows = m0 + gl.arange(0, BLOCK_M, layout=s_rows)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    row_base = pid_bh.to(gl.int64) * Sq
    lse = gl.load(LSE + row_base + rows, mask=rows < Sq, other=float("-inf"))
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)
    delta = gl.load(DELTA + row_base + rows, mask=rows < Sq, other=0.0)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(qdo_ready, 0)

    for j in range(tiles):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        n0 = lo + j * BLOCK_N
        k_j = k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
        mbarrier.wait(k_ready.index(slot), phase)
        s = warpgroup_mma(q, k_j.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(slot), phase)
        dp = warpgroup_mma(do, v_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                           use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))
        if (n0 < full_lo) | (n0 >= full_hi):
            ok = _in_band(rows[:, None], n0 + cols[None, :], Sq, Sk, off, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT)
            s = gl.where(ok, s, float("-inf"))
        p = gl.exp2(s * qk_scale - lse2[:, None])
        dp = warpgroup_mma_wait(0, deps=(dp,))
        # V slot `slot` is free: fetch tile j + STAGES into it
        _issue_tile(v_desc, v_bufs, v_ready, b, hk, lo + (j + STAGES) * BLOCK_N, slot, j + STAGES < tiles)
        ds_op = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), op_layout)
        dq = warpgroup_mma(ds_op, k_j, dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))
        _issue_tile(k_desc, k_bufs, k_ready, b, hk, lo + (j + STAGES) * BLOCK_N, slot, j + STAGES < tiles)

    mbarrier.invalidate(qdo_ready)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(st))
        mbarrier.invalidate(v_ready.index(st))
    q.store((dq * scale).to(dtype))  # dQ leaves through Q's buffer (every MMA is done)
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [b, h, m0, 0], q_buf)
    tma.store_wait(0)


@gluon.jit
def _row_delta(O, som, DO_SMEM, b, h, H, m0, Sq, DELTA, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
               rows_layout: gl.constexpr, num_warps: gl.constexpr):
    """delta = rowsum(O * dO) of the tile's rows, O read from global memory (its only read),
    dO from the tile already in shared memory; stored for the dK/dV kernel that runs next."""
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    r = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blocked))
    c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blocked))
    base = O + (b * H + h).to(gl.int64) * Sq * som
    o = gl.load(base + r[:, None] * som + c[None, :], mask=(r < Sq)[:, None], other=0.0)
    do = DO_SMEM.load(blocked)
    delta = gl.sum(o.to(gl.float32) * do.to(gl.float32), 1)
    gl.store(DELTA + (b * H + h).to(gl.int64) * Sq + r, delta, mask=r < Sq)
    return gl.convert_layout(delta, rows_layout)


@gluon.jit
def _dq_scores(s, dp, j, lo, full_lo, full_hi, rows, cols, lse2, delta, Sq, Sk, off, LEFT, RIGHT, qk_scale,
               v_desc, v_bufs, v_ready, b, hk, tiles, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
               STAGES: gl.constexpr, op_layout: gl.constexpr):
    """Key tile j of the dQ walk, its S and dP MMAs issued: wait for S, P = exp2(S * scale - lse)
    (masked on edge tiles), wait for dP, refill the V slot, dS = P (dP - delta) as the dQ MMA's
    register operand."""
    BLOCK_N: gl.constexpr = v_desc.block_type.shape[2]
    n0 = lo + j * BLOCK_N
    s = warpgroup_mma_wait(1, deps=(s,))
    if (n0 < full_lo) | (n0 >= full_hi):
        ok = _in_band(rows[:, None], n0 + cols[None, :], Sq, Sk, off, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT)
        s = gl.where(ok, s, float("-inf"))
    p = gl.exp2(s * qk_scale - lse2[:, None])
    dp = warpgroup_mma_wait(0, deps=(dp,))
    _issue_tile(v_desc, v_bufs, v_ready, b, hk, lo + (j + STAGES) * BLOCK_N, j % STAGES, j + STAGES < tiles)
    return gl.convert_layout((p * (dp - delta[:, None])).to(v_desc.dtype), op_layout)


@gluon.jit
def band_dq_pipelined_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE, DELTA, O, som,
                             H, GROUP, Sq, Sk, off, LEFT, RIGHT, qk_scale, scale,
                             HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr,
                             FUSE_DELTA: gl.constexpr, num_warps: gl.constexpr):
    """band_dq_kernel with tile j + 1's two score MMAs issued right behind tile j's dQ MMA
    (the tensor cores never drain between tiles), and optionally delta computed here from O."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype

    pid_bh, b, h, hk, m0 = query_tile_program(H, GROUP, BLOCK_M)
    lo, tiles, full_lo, full_hi = _band_tiles(m0, Sq, Sk, off, LEFT, RIGHT, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)

    q_buf, qdo_ready, k_bufs, k_ready, v_bufs, v_ready = one_and_two_rings(q_desc, k_desc, v_desc, STAGES)
    do_buf = gl.allocate_shared_memory(dtype, do_desc.block_type.shape, do_desc.layout)
    mbarrier.expect(qdo_ready, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], qdo_ready, q_buf)
    tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], qdo_ready, do_buf)
    for st in gl.static_range(STAGES):
        _issue_tile(k_desc, k_bufs, k_ready, b, hk, lo + st * BLOCK_N, st, st < tiles)
        _issue_tile(v_desc, v_bufs, v_ready, b, hk, lo + st * BLOCK_N, st, st < tiles)

    q = q_buf.reshape([BLOCK_M, HEAD_DIM])
    do = do_buf.reshape([BLOCK_M, HEAD_DIM])
    rows = m0 + gl.arange(0, BLOCK_M, layout=s_rows)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    row_base = pid_bh.to(gl.int64) * Sq
    lse = gl.load(LSE + row_base + rows, mask=rows < Sq, other=float("-inf"))
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(qdo_ready, 0)
    if FUSE_DELTA:
        delta = _row_delta(O, som, do, b, h, H, m0, Sq, DELTA, BLOCK_M, HEAD_DIM, s_rows, num_warps)
    else:
        delta = gl.load(DELTA + row_base + rows, mask=rows < Sq, other=0.0)

    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q, k_bufs.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                      use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(0), 0)
    dp = warpgroup_mma(do, v_bufs.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                       use_acc=False, is_async=True)
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
    for j in range(tiles - 1):
        slot = j % STAGES
        ds_op = _dq_scores(s, dp, j, lo, full_lo, full_hi, rows, cols, lse2, delta, Sq, Sk, off, LEFT, RIGHT,
                           qk_scale, v_desc, v_bufs, v_ready, b, hk, tiles, HAS_LEFT, HAS_RIGHT, STAGES, op_layout)
        dq = warpgroup_mma(ds_op, k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]), dq, is_async=True)
        # tile j + 1's score MMAs queue behind dQ_j; the wait is for dQ_j alone
        nxt = (j + 1) % STAGES
        mbarrier.wait(k_ready.index(nxt), ((j + 1) // STAGES) & 1)
        s = warpgroup_mma(q, k_bufs.index(nxt).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(nxt), ((j + 1) // STAGES) & 1)
        dp = warpgroup_mma(do, v_bufs.index(nxt).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                           use_acc=False, is_async=True)
        dq, ds_op = warpgroup_mma_wait(2, deps=(dq, ds_op))
        _issue_tile(k_desc, k_bufs, k_ready, b, hk, lo + (j + STAGES) * BLOCK_N, slot, j + STAGES < tiles)
    last = (tiles - 1) % STAGES
    ds_op = _dq_scores(s, dp, tiles - 1, lo, full_lo, full_hi, rows, cols, lse2, delta, Sq, Sk, off, LEFT, RIGHT,
                       qk_scale, v_desc, v_bufs, v_ready, b, hk, tiles, HAS_LEFT, HAS_RIGHT, STAGES, op_layout)
    dq = warpgroup_mma(ds_op, k_bufs.index(last).reshape([BLOCK_N, HEAD_DIM]), dq, is_async=True)
    dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))

    mbarrier.invalidate(qdo_ready)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(st))
        mbarrier.invalidate(v_ready.index(st))
    q.store((dq * scale).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [b, h, m0, 0], q_buf)
    tma.store_wait(0)


DEFAULT = dict(block_m=BLOCK_M, block_n=BLOCK_N, stages=STAGES, num_warps=NUM_WARPS)


def _dq_arguments(q, k, v, do, dq, lse, delta, scale, left, right, block_m, block_n, stages, num_warps):
    H, Sq, Hkv, Sk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    args = (_descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), _descriptor(do, block_m),
            _descriptor(dq, block_m), lse, delta, H, H // Hkv, Sq, Sk, Sk - Sq,
            0 if left is None else left, 0 if right is None else right, scale * LOG2E, scale)
    return args, dict(HAS_LEFT=left is not None, HAS_RIGHT=right is not None, STAGES=stages, num_warps=num_warps)


def band_dq(q, k, v, do, lse, delta, scale, left, right, **config):
    config = {**DEFAULT, **config}
    dq = torch.empty_like(q)
    args, constexprs = _dq_arguments(q, k, v, do, dq, lse, delta, scale, left, right, **config)
    band_dq_kernel[(triton.cdiv(q.shape[2], config["block_m"]), q.shape[0] * q.shape[1])](*args, **constexprs)
    return dq


def _arguments(q, k, v, do, dk, dv, lse, delta, scale, left, right, block_m, block_n, stages, num_warps):
    H, Sq, Hkv, Sk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    args = (_descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), _descriptor(do, block_m),
            _descriptor(dk, block_n), _descriptor(dv, block_n), lse, delta, H, H // Hkv, Sq, Sk, Sk - Sq,
            0 if left is None else left, 0 if right is None else right, scale * LOG2E, scale)
    constexprs = dict(HAS_LEFT=left is not None, HAS_RIGHT=right is not None, STAGES=stages, num_warps=num_warps)
    return args, constexprs


def band_dkdv(q, k, v, do, lse, delta, scale, left, right, **config):
    config = {**DEFAULT, **config}
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    args, constexprs = _arguments(q, k, v, do, dk, dv, lse, delta, scale, left, right, **config)
    band_dkdv_kernel[(triton.cdiv(k.shape[2], config["block_n"]), k.shape[0] * k.shape[1])](*args, **constexprs)
    return dk, dv


def band_dkdv_pipelined(q, k, v, do, lse, delta, scale, left, right, **config):
    config = {**DEFAULT, **config}
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    args, constexprs = _arguments(q, k, v, do, dk, dv, lse, delta, scale, left, right, **config)
    band_dkdv_pipelined_kernel[(triton.cdiv(k.shape[2], config["block_n"]), k.shape[0] * k.shape[1])](
        *args, **constexprs)
    return dk, dv


def band_dq_pipelined(q, k, v, do, lse, delta, scale, left, right, out=None, stages=STAGES):
    """The pipelined dQ kernel; with `out`, delta is computed here (and written into `delta`)."""
    dq = torch.empty_like(q)
    args, constexprs = _dq_arguments(q, k, v, do, dq, lse, delta, scale, left, right, BLOCK_M, BLOCK_N, stages,
                                     NUM_WARPS)
    o = q if out is None else out
    args = args[:7] + (o, o.stride(2)) + args[7:]
    band_dq_pipelined_kernel[(triton.cdiv(q.shape[2], BLOCK_M), q.shape[0] * q.shape[1])](
        *args, FUSE_DELTA=out is not None, **constexprs)
    return dq


# (block_m, block_n, stages, num_warps): one warpgroup a 64-row tile, or two sharing the streamed tiles
DKDV_CONFIGS = [(64, 64, 2, 4), (32, 64, 2, 4), (32, 64, 3, 4), (64, 128, 2, 8), (32, 128, 2, 8), (64, 64, 1, 4)]
DKDV_PIPELINED_CONFIGS = [(64, 64, 2, 4), (32, 64, 2, 4), (32, 64, 3, 4), (64, 64, 3, 4)]
DQ_CONFIGS = [(64, 64, 2, 4), (64, 64, 3, 4), (128, 64, 2, 8), (128, 64, 3, 8), (64, 128, 2, 4)]


def _config(values):
    return dict(zip(("block_m", "block_n", "stages", "num_warps"), values))


def compile_report(head_dim: int):
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    t = torch.zeros(1, 2, 1000, head_dim, dtype=torch.bfloat16)
    rows = torch.zeros(1, 2, 1000)
    builds = [(band_dkdv_kernel, c, _arguments(t, t, t, t, t, t, rows, rows, 0.1, 512, 0, **_config(c)))
              for c in DKDV_CONFIGS]
    builds += [(band_dq_kernel, c, _dq_arguments(t, t, t, t, t, rows, rows, 0.1, 512, 0, **_config(c)))
               for c in DQ_CONFIGS]
    builds += [(band_dkdv_pipelined_kernel, c, _arguments(t, t, t, t, t, t, rows, rows, 0.1, 512, 0, **_config(c)))
               for c in DKDV_PIPELINED_CONFIGS]
    for fuse in (False, True):
        values, constexprs = _dq_arguments(t, t, t, t, t, rows, rows, 0.1, 512, 0, **_config(DQ_CONFIGS[0]))
        builds.append((band_dq_pipelined_kernel, DQ_CONFIGS[0] + (f"fuse_delta={fuse}",),
                       (values[:7] + (t, 128) + values[7:], {**constexprs, "FUSE_DELTA": fuse})))
    for kernel, config, (values, constexprs) in builds:
        signature = {n: mangle_type(a) for n, a in zip(kernel.arg_names, values)}
        signature.update({n: "constexpr" for n in constexprs})
        try:
            compiled = triton.compile(GluonASTSource(kernel, signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", 90, 32), options={"num_warps": config[3]})
        except Exception as e:  # noqa: BLE001 - a report line per configuration
            print(f"{kernel.__name__} d{head_dim} {config}: does not compile: {str(e)[:1500]}")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            with open(f"{tmp}/k.ptx", "w") as f:
                f.write(compiled.asm["ptx"])
            report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f"{tmp}/k.ptx", "-o",
                                     f"{tmp}/k.cubin"], capture_output=True, text=True, check=True).stderr
        spills = re.search(r"(\d+) bytes spill stores", report)
        registers = re.search(r"Used (\d+) registers", report).group(1)
        print(f"{kernel.__name__} d{head_dim} {config}: {registers} registers, "
              f"{spills.group(1) if spills else 0} bytes spilled, {compiled.metadata.shared} B shared", flush=True)


def _timed(label, fn, check):
    """Time fn (agreement first); a configuration that fails prints why and the sweep goes on."""
    from triton.testing import do_bench
    try:
        for name, mine, ref in check(fn()):
            err = (mine.float() - ref.float()).abs().max().item()
            print(f"  {label}: max |{name} - triton| {err:.3g} (|{name}| max {ref.abs().max().item():.3g})")
        ms = do_bench(fn, rep=200)
        print(f"  {label}: {ms * 1e3:.1f} us", flush=True)
        return ms
    except Exception as e:  # noqa: BLE001
        print(f"  {label}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--s", type=int, default=8192)
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args()
    if args.compile_only:
        for d in (64, 128):
            compile_report(d)
        return
    from triton.testing import do_bench

    from kernelforge.reference.attention import Visibility
    from kernelforge.triton import attention as tri

    S, W = args.s, args.window
    for D in (128, 64):
        B, H = 16384 // S, 16
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        do = torch.randn_like(q)
        scale = D ** -0.5
        for left, causal in ((W, True), (None, True), (None, False)):
            vis = Visibility.of(causal, (left, None))
            right = vis.right
            name = f"d{D} {'causal' if causal else 'full'} window {left}"
            out, lse = tri.flash_forward(q, k, v, scale, vis)
            delta = (out.float() * do.float()).sum(-1)
            ref_dq, ref_dk, ref_dv = tri.flash_backward(do, q, k, v, out, lse, scale, vis)
            t_tri = do_bench(lambda: tri.flash_backward(do, q, k, v, out, lse, scale, vis), rep=200)
            print(f"{name}: triton backward (delta, dK/dV, dQ) {t_tri * 1e3:.1f} us", flush=True)
            t_delta = _timed("delta (torch)", lambda: (out.float() * do.float()).sum(-1), lambda r: ())
            best = {}
            dkdv_configs = DKDV_CONFIGS if left is not None else DKDV_CONFIGS[:1]
            dq_configs = DQ_CONFIGS if left is not None else DQ_CONFIGS[:1]
            for c in dkdv_configs:
                ms = _timed(f"dK/dV {c}",
                            lambda c=c: band_dkdv(q, k, v, do, lse, delta, scale, left, right, **_config(c)),
                            lambda r: (("dk", r[0], ref_dk), ("dv", r[1], ref_dv)))
                best["dkdv"] = min(best.get("dkdv", float("inf")), ms or float("inf"))
            for c in DKDV_PIPELINED_CONFIGS:
                ms = _timed(f"dK/dV pipelined {c}",
                            lambda c=c: band_dkdv_pipelined(q, k, v, do, lse, delta, scale, left, right, **_config(c)),
                            lambda r: (("dk", r[0], ref_dk), ("dv", r[1], ref_dv)))
                best["dkdv"] = min(best.get("dkdv", float("inf")), ms or float("inf"))
            for c in dq_configs:
                ms = _timed(f"dQ {c}", lambda c=c: band_dq(q, k, v, do, lse, delta, scale, left, right, **_config(c)),
                            lambda r: (("dq", r, ref_dq),))
                best["dq"] = min(best.get("dq", float("inf")), ms or float("inf"))
            for stages in (2, 1, 3):
                ms = _timed(f"dQ pipelined, stages {stages}",
                            lambda st=stages: band_dq_pipelined(q, k, v, do, lse, delta, scale, left, right, stages=st),
                            lambda r: (("dq", r, ref_dq),))
                best["dq"] = min(best.get("dq", float("inf")), ms or float("inf"))
            fused_delta = torch.empty_like(delta)
            ms = _timed("dQ pipelined + delta from O",
                        lambda: band_dq_pipelined(q, k, v, do, lse, fused_delta, scale, left, right, out=out),
                        lambda r: (("dq", r, ref_dq), ("delta", fused_delta, delta)))
            print(f"{name}: best gluon dK/dV {best['dkdv'] * 1e3:.1f} + dQ {best['dq'] * 1e3:.1f} us "
                  f"(+ delta {t_delta * 1e3 if t_delta else float('nan'):.1f} in torch, or dQ with delta "
                  f"{ms * 1e3 if ms else float('nan'):.1f}) against triton {t_tri * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    sys.exit(main())
