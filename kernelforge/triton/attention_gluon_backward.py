"""Hopper flash-attention backward in Gluon, dK/dV and dQ, for a band of keys (a sliding window,
causal attention, or every key) and, once switched on, for a BlockMask; never an attn_mask.

Why next to the Triton backward (attention_kernels.py): on a causal window of 512 (2 x 16 x
8192, d128, bf16, H200) the Triton backward took 0.65 ms against the Gluon forward's 0.18,
and forward + backward stood at 1.19x FlexAttention against a 1.5x target. Its dK/dV kernel
holds K, V and both accumulators in registers (255 a thread, spilling). Here K and V stay in
shared memory as wgmma operands, the two score MMAs of a step run asynchronously ahead of the
elementwise work, and P^T and dS^T feed the next MMAs from registers.

dK/dV (dkdv_kernel): one warpgroup a 64-key tile of one (batch, kv head); it walks the query
tiles that see the key tile (col_range), for every q head of the group, as one loop:

    issue S^T = K Q_i^T and dP^T = V dO_i^T   (async wgmma, both operands in shared memory)
    wait S^T; P^T = exp2(S^T * scale - lse_i)  (masked on edge tiles)
    issue dV += P^T dO_i
    wait dP^T; dS^T = P^T (dP^T - delta_i)
    issue dK += dS^T Q_i
    wait; refill the Q / dO ring slot by TMA

dQ (dq_kernel): one warpgroup a 64-row query tile; it walks its keys as the forward does:
issue S = Q K_j^T and dP = dO V_j^T; wait S, P = exp2(S * scale - lse); wait dP, refill the
V slot; dS = P (dP - delta); issue dQ += dS K_j; wait; refill the K slot.

A BlockMask (ENABLED["block_mask_backward"]) changes only
which tiles a program walks and their masking, as in the forward (attention_gluon.py): dQ
walks its query tile's list of key tiles (a stand-in tile, all hidden, where nothing is
listed: dQ = 0); dK/dV walks its key tile's list of query tiles (BlockMask.q_*) for each q
head of the group, so the lists must not differ between those heads. Full tiles take no
per-element work; partial ones test their bits, one 64-bit word a tile row loaded before the
wait for the scores (partial_words for dQ, partial_words_t for dK/dV, whose score tiles run
keys down), in 32-bit halves in dK/dV (tile_visible says why).

Work per tile pair of 64 x 64: dK/dV 4 MMAs and dQ 3, each 2 * 64 * 64 * D FLOPs (S and dP
are computed twice: a fused kernel would add dQ by atomics instead). Bytes: K, V, dK, dV once
per key tile; Q, dO, lse, delta once per key tile that sees them (from L2: neighbouring key
tiles share their query tiles); Q, dO, dQ once and K, V once per query tile in dQ. delta =
rowsum(O * dO) is computed by the dQ launch, run first (FUSE_DELTA; O read once there); dK/dV
takes each step's lse and delta by TMA with its Q and dO tiles (_issue_step). dQ at d128
without a BlockMask runs a one-stage ring, three programs an SM (attention_gluon.ring_stages).
No atomics: deterministic.

Measured (H200, bf16, 2 x 16 x 8192; the Gluon backward experiment, docs/notes/attention.md, its logs
in benchmarks/results/nvidia-h200/0.1.0/attention/gluon-backward-experiment/), dK/dV + dQ against the
Triton backward (delta, dK/dV, dQ):

    d128 causal window 512: 312 + 213 us against 662;  d64: 204 + 118 against 392
    d128 causal:          1861 + 1331 us against 4259; d64: 1246 + 739 against 2568
    d128 every key:       3667 + 2506 us against 6973; d64: 2365 + 1356 against 4085

Slower there, each measured: 32-row query steps, 128-key tiles on two warpgroups, 1 or 3
stages, 128-row dQ tiles, and issuing step t + 1's score MMAs before waiting for step t's
accumulating MMAs (window d128: dK/dV 502 us, dQ 261: the wait for the older MMAs alone costs
more than it hides).

Later (run4 to run7 logs there; ncu counters beside them): dK/dV's per-step lse and delta
loads were its largest stall (long scoreboard 2.10 of 6.07 cycles an instruction); by TMA
they fell to 0.92 and the window's dK/dV from 315 to 296 us. A ring step's tiles on one
mbarrier (fewer of Triton's bar.syncs) was 7 to 15 us slower. delta in the dQ launch: window
d128 538 -> 524 us the backward; at d128 causal and every key it is within 1.4% either way.

Only sm_90 has wgmma; kernelforge/triton/attention.py sends a backward here when `takes` says
so and keeps the Triton backward for everything else (attn_mask, BlockMasks with tiles under
64 or lists that differ between the q heads of a kv group, other GPUs, fp32, other head dims).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernelforge.reference.attention import Visibility
from kernelforge.triton._launch import cdiv, launch
from kernelforge.triton.attention_gluon import (DTYPES, ENABLED, HEAD_DIMS, LOG2E, invalidate_rings, issue_tile,
                                                key_walk, list_arguments, one_and_two_rings, query_tile_program,
                                                ring_stages, sm90_usage, tile_visible, tile_words, tma_descriptor,
                                                tma_ready, walk_tile)
from kernelforge.triton.attention_visibility import col_range

BLOCK_M = 64  # query rows a step (dK/dV) or a program (dQ): one warpgroup's wgmma height
BLOCK_N = 64  # keys a program (dK/dV) or a step (dQ)
STAGES = 2
NUM_WARPS = 4
# delta = rowsum(O * dO) in the dQ launch (run first) instead of the Triton kernel before both:
# O read once there, one launch fewer (the Gluon backward experiment timed both: docs/notes/attention.md).
FUSE_DELTA = True
LOG2E_C: gl.constexpr = gl.constexpr(LOG2E)
# a (B, H, Sq) float32 vector's 64 rows in shared memory (lse, delta; see _issue_step)
ROW_LAYOUT: gl.constexpr = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3))


@gluon.jit
def _lse2(LSE, row_base, rows, Sq):
    """The forward's lse (natural log) of rows [row_base + rows] in log2 units (_log2_lse)."""
    return _log2_lse(gl.load(LSE + row_base + rows, mask=rows < Sq, other=float("-inf")))


@gluon.jit
def _log2_lse(lse):
    """lse in log2 units, +inf where a row saw no key or lies past Sq (lse = -inf), so that
    P = exp2(s2 - lse2) is exactly 0 there."""
    return gl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)


@gluon.jit
def _pair_and_two_rings(one_desc, two_desc, a_desc, b_desc, b, head, row0, STAGES: gl.constexpr):
    """one_and_two_rings with a second tile beside the once-loaded one (the same rows of
    another tensor: K with V, Q with dO), both loads issued now on the one barrier: (one, two,
    their barrier, ring a, its barriers, ring b, its barriers)."""
    one, ready, ring_a, a_ready, ring_b, b_ready = one_and_two_rings(one_desc, a_desc, b_desc, STAGES)
    two = gl.allocate_shared_memory(two_desc.dtype, two_desc.block_type.shape, two_desc.layout)
    mbarrier.expect(ready, one_desc.block_type.nbytes + two_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(one_desc, [b, head, row0, 0], ready, one)
    tma.async_copy_global_to_shared(two_desc, [b, head, row0, 0], ready, two)
    return one, two, ready, ring_a, a_ready, ring_b, b_ready


@gluon.jit
def _issue_step(q_desc, q_bufs, q_ready, do_desc, do_bufs, do_ready, lse_desc, lse_bufs, delta_desc, delta_bufs,
                b, head, row0, slot, pred, ROWS_TMA: gl.constexpr):
    """A dK/dV step's Q and dO tiles into ring slot `slot`, with ROWS_TMA their rows' lse and
    delta on the same barriers: read from shared memory then, not loaded from global memory in
    every step (that load's latency was the kernel's largest stall: ncu, H200, causal window
    512, d128). TMA wants 16-byte row strides (Sq % 4 == 0); other lengths load them. Q and dO
    keep a barrier each: the S^T MMA starts on Q alone (all four on one barrier was slower)."""
    if ROWS_TMA:
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes + lse_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(lse_desc, [b, head, row0], q_ready.index(slot), lse_bufs.index(slot), pred=pred)
        mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes + delta_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(delta_desc, [b, head, row0], do_ready.index(slot), delta_bufs.index(slot),
                                        pred=pred)
    else:
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes, pred=pred)
        mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(q_desc, [b, head, row0, 0], q_ready.index(slot), q_bufs.index(slot), pred=pred)
    tma.async_copy_global_to_shared(do_desc, [b, head, row0, 0], do_ready.index(slot), do_bufs.index(slot), pred=pred)


@gluon.jit
def _step_rows(bufs, slot, ROWS, row_base, rows, Sq, other: gl.constexpr, ROWS_TMA: gl.constexpr):
    """A step's rows of lse or delta (layout of `rows`): from the ring (_issue_step), zeros past
    Sq, or loaded, `other` past Sq."""
    if ROWS_TMA:
        values = bufs.index(slot).reshape([rows.shape[0]]).load(rows.type.layout)
    else:
        values = gl.load(ROWS + row_base + rows, mask=rows < Sq, other=other)
    return values


@gluon.jit
def _query_step(t, per_head, hk, GROUP, lo, full_lo, full_hi, list_base, count, BLOCKS, PARTIAL,
                BLOCK_M: gl.constexpr, BLOCK_SPARSE: gl.constexpr, MB_Q: gl.constexpr, HAS_BAND: gl.constexpr):
    """Step t of a dK/dV program's walk, the query tiles of each q head of its group in turn:
    (q head, first row, partial-tile id, whether it needs per-element masking)."""
    m0, partial_id, edge = walk_tile(t % per_head, lo, full_lo, full_hi, list_base, count, BLOCKS, PARTIAL,
                                      BLOCK_M, BLOCK_SPARSE, MB_Q, HAS_BAND)
    return hk * GROUP + t // per_head, m0, partial_id, edge


@gluon.jit
def dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, LSE, DELTA,
                COUNTS, BLOCKS, PARTIAL, WORDS, scb, sch, sbb, sbh, NUM_MB_Q,
                H, GROUP, Sq, Sk, off, LEFT, RIGHT, qk_scale, scale,
                HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_SPARSE: gl.constexpr, MB_Q: gl.constexpr,
                MB_K: gl.constexpr, ROWS_TMA: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    HAS_BAND: gl.constexpr = HAS_LEFT or HAS_RIGHT
    dtype: gl.constexpr = q_desc.dtype

    HKV = H // GROUP
    pid_bh = gl.program_id(1)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    n0 = gl.program_id(0) * BLOCK_N
    if BLOCK_SPARSE:  # the mask's column of key tiles holding keys [n0, n0 + BLOCK_N); one list
        # serves every q head of the group (`takes`: the mask broadcasts over heads, or GROUP is 1)
        lo = 0
        full_lo = 0
        full_hi = 0
        count = gl.load(COUNTS + b * scb + hk * GROUP * sch + n0 // MB_K)
        list_base = b * sbb + hk * GROUP * sbh + (n0 // MB_K) * NUM_MB_Q
        per_head = count * (MB_Q // BLOCK_M)
    else:
        lo, full_lo, full_hi, hi = col_range(n0, Sq, Sk, off, LEFT, RIGHT, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        per_head = gl.cdiv(hi - lo, BLOCK_M)
        count = 0
        list_base = 0
    steps = per_head * GROUP  # 0 for a key tile no row sees: dK = dV = 0

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)

    # K and V come once, on one barrier; Q with its rows' lse and dO with their delta stream
    # through rings
    k_buf, v_buf, kv_ready, q_bufs, q_ready, do_bufs, do_ready = _pair_and_two_rings(k_desc, v_desc, q_desc, do_desc,
                                                                                     b, hk, n0, STAGES)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 1, BLOCK_M], ROW_LAYOUT)  # 512 bytes each,
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 1, BLOCK_M], ROW_LAYOUT)  # unused without TMA
    for st in gl.static_range(STAGES):
        h_st, m_st, _, _ = _query_step(st, gl.maximum(per_head, 1), hk, GROUP, lo, full_lo, full_hi, list_base,
                                       count, BLOCKS, PARTIAL, BLOCK_M, BLOCK_SPARSE, MB_Q, HAS_BAND)
        _issue_step(q_desc, q_bufs, q_ready, do_desc, do_bufs, do_ready, lse_desc, lse_bufs, delta_desc, delta_bufs,
                    b, h_st, m_st, st, st < steps, ROWS_TMA)

    k = k_buf.reshape([BLOCK_N, HEAD_DIM])
    v = v_buf.reshape([BLOCK_N, HEAD_DIM])
    key_bits = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    keys = n0 + key_bits
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(kv_ready, 0)

    for t in range(steps):
        slot = t % STAGES
        phase = (t // STAGES) & 1
        h, m0, partial_id, edge = _query_step(t, per_head, hk, GROUP, lo, full_lo, full_hi, list_base, count,
                                              BLOCKS, PARTIAL, BLOCK_M, BLOCK_SPARSE, MB_Q, HAS_BAND)
        q_i = q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
        do_i = do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
        mbarrier.wait(q_ready.index(slot), phase)
        sT = warpgroup_mma(k, q_i.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(slot), phase)
        dpT = warpgroup_mma(v, do_i.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        rows = m0 + cols
        # a word a key row (two loads a thread), issued before the wait for S^T
        words = tile_words(WORDS, partial_id, n0, m0, key_bits, BLOCK_SPARSE, MB_K, MB_Q)
        row_base = (b * H + h).to(gl.int64) * Sq
        lse2 = _log2_lse(_step_rows(lse_bufs, slot, LSE, row_base, rows, Sq, float("-inf"), ROWS_TMA))
        if ROWS_TMA:  # P = 0 past Sq (Q's rows there are zeros, and so is the ring's lse)
            lse2 = gl.where(rows < Sq, lse2, float("inf"))
        sT = warpgroup_mma_wait(1, deps=(sT,))
        if edge:
            ok = tile_visible(rows[None, :], keys[:, None], words, cols[None, :], partial_id, Sq, Sk, off, LEFT, RIGHT,
                               HAS_LEFT, HAS_RIGHT, BLOCK_SPARSE, True)
            sT = gl.where(ok, sT, float("-inf"))
        pT = gl.exp2(sT * qk_scale - lse2[None, :])
        pT_op = gl.convert_layout(pT.to(dtype), op_layout)
        dv = warpgroup_mma(pT_op, do_i, dv, is_async=True)
        # delta read only now: its registers are not live across the exponentials (rows past
        # Sq have P = 0 whatever their delta)
        delta = _step_rows(delta_bufs, slot, DELTA, row_base, rows, Sq, 0.0, ROWS_TMA)
        dpT = warpgroup_mma_wait(1, deps=(dpT,))
        dsT_op = gl.convert_layout((pT * (dpT - delta[None, :])).to(dtype), op_layout)
        dk = warpgroup_mma(dsT_op, q_i, dk, is_async=True)
        # the register operands stay live until their MMAs are done
        dv, dk, pT_op, dsT_op = warpgroup_mma_wait(0, deps=(dv, dk, pT_op, dsT_op))
        # slot `slot` is free: fetch step t + STAGES into it
        nxt = t + STAGES
        h_n, m_n, _, _ = _query_step(nxt, per_head, hk, GROUP, lo, full_lo, full_hi, list_base, count, BLOCKS,
                                     PARTIAL, BLOCK_M, BLOCK_SPARSE, MB_Q, HAS_BAND)
        _issue_step(q_desc, q_bufs, q_ready, do_desc, do_bufs, do_ready, lse_desc, lse_bufs, delta_desc, delta_bufs,
                    b, h_n, m_n, slot, nxt < steps, ROWS_TMA)

    invalidate_rings(kv_ready, q_ready, do_ready, STAGES)
    # dK = scale * sum dS^T Q, dV = sum P^T dO, out through K's and V's buffers (every MMA is
    # done); TMA clips the store at Sk
    k.store((dk * scale).to(dtype))
    v.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, n0, 0], k_buf)
    tma.async_copy_shared_to_global(dv_desc, [b, hk, n0, 0], v_buf)
    tma.store_wait(0)


@gluon.jit
def _o_tile(O, sob, soh, som, b, h, m0, Sq, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, blocked: gl.constexpr):
    """A query tile's rows of O (for delta), loaded from global memory before the wait for Q and
    dO so that the two latencies overlap (it is O's only read in the backward)."""
    r = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blocked))
    c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blocked))
    o_rows = O + b.to(gl.int64) * sob + h.to(gl.int64) * soh + r[:, None].to(gl.int64) * som
    return gl.load(o_rows + c[None, :], mask=(r < Sq)[:, None], other=0.0)


@gluon.jit
def _row_delta(o, do_tile, m0, Sq, DELTA, row_base, BLOCK_M: gl.constexpr, blocked: gl.constexpr,
               rows_layout: gl.constexpr):
    """delta = rowsum(O * dO) of a query tile's rows (o from _o_tile, dO from the tile already
    in shared memory), stored for the dK/dV kernel that runs next. Bytes: 2 * D a row read, 4
    written."""
    delta = gl.sum(o.to(gl.float32) * do_tile.load(blocked).to(gl.float32), 1)
    r = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blocked))
    gl.store(DELTA + row_base + r, delta, mask=r < Sq)
    return gl.convert_layout(delta, rows_layout)


@gluon.jit
def dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE, DELTA, O, sob, soh, som,
              COUNTS, BLOCKS, PARTIAL, WORDS, scb, sch, sbb, sbh, NUM_MB_K,
              H, GROUP, Sq, Sk, off, LEFT, RIGHT, qk_scale, scale,
              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_SPARSE: gl.constexpr, MB_Q: gl.constexpr,
              MB_K: gl.constexpr, FUSE_DELTA: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    HAS_BAND: gl.constexpr = HAS_LEFT or HAS_RIGHT
    dtype: gl.constexpr = q_desc.dtype

    pid_bh, b, h, hk, m0 = query_tile_program(H, GROUP, BLOCK_M)
    lo, tiles, full_lo, full_hi, count, list_base = key_walk(b, h, m0, COUNTS, scb, sch, sbb, sbh, NUM_MB_K, Sq, Sk,
                                                             off, LEFT, RIGHT, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                                                             BLOCK_SPARSE, MB_Q, MB_K)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)

    # Q and dO come once, on one barrier; K and V stream through rings
    q_buf, do_buf, qdo_ready, k_bufs, k_ready, v_bufs, v_ready = _pair_and_two_rings(q_desc, do_desc, k_desc, v_desc,
                                                                                     b, h, m0, STAGES)
    for st in gl.static_range(STAGES):
        n_st, _, _ = walk_tile(st, lo, full_lo, full_hi, list_base, count, BLOCKS, PARTIAL, BLOCK_N, BLOCK_SPARSE,
                                MB_K, HAS_BAND)
        issue_tile(k_desc, k_bufs, k_ready, b, hk, n_st, st, st < tiles)
        issue_tile(v_desc, v_bufs, v_ready, b, hk, n_st, st, st < tiles)

    q = q_buf.reshape([BLOCK_M, HEAD_DIM])
    do = do_buf.reshape([BLOCK_M, HEAD_DIM])
    rows = m0 + gl.arange(0, BLOCK_M, layout=s_rows)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    row_base = pid_bh.to(gl.int64) * Sq
    lse2 = _lse2(LSE, row_base, rows, Sq)
    if not FUSE_DELTA:
        delta = gl.load(DELTA + row_base + rows, mask=rows < Sq, other=0.0)
    else:  # this launch computes delta (dK/dV runs after it)
        o_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        o = _o_tile(O, sob, soh, som, b, h, m0, Sq, BLOCK_M, HEAD_DIM, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(qdo_ready, 0)
    if FUSE_DELTA:
        delta = _row_delta(o, do, m0, Sq, DELTA, row_base, BLOCK_M, o_layout, s_rows)

    for j in range(tiles):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        n0, partial_id, edge = walk_tile(j, lo, full_lo, full_hi, list_base, count, BLOCKS, PARTIAL, BLOCK_N,
                                          BLOCK_SPARSE, MB_K, HAS_BAND)
        k_j = k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
        mbarrier.wait(k_ready.index(slot), phase)
        s = warpgroup_mma(q, k_j.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(slot), phase)
        dp = warpgroup_mma(do, v_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                           use_acc=False, is_async=True)
        words = tile_words(WORDS, partial_id, m0, n0, rows - m0, BLOCK_SPARSE, MB_Q, MB_K)
        s = warpgroup_mma_wait(1, deps=(s,))
        if edge:
            ok = tile_visible(rows[:, None], n0 + cols[None, :], words, cols[None, :], partial_id, Sq, Sk, off, LEFT,
                               RIGHT, HAS_LEFT, HAS_RIGHT, BLOCK_SPARSE, False)
            s = gl.where(ok, s, float("-inf"))
        p = gl.exp2(s * qk_scale - lse2[:, None])
        dp = warpgroup_mma_wait(0, deps=(dp,))
        # V slot `slot` is free: fetch tile j + STAGES into it (K and V on one barrier, both
        # fetched here, was slower)
        n_ahead, _, _ = walk_tile(j + STAGES, lo, full_lo, full_hi, list_base, count, BLOCKS, PARTIAL, BLOCK_N,
                                   BLOCK_SPARSE, MB_K, HAS_BAND)
        issue_tile(v_desc, v_bufs, v_ready, b, hk, n_ahead, slot, j + STAGES < tiles)
        ds_op = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), op_layout)
        dq = warpgroup_mma(ds_op, k_j, dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))
        issue_tile(k_desc, k_bufs, k_ready, b, hk, n_ahead, slot, j + STAGES < tiles)

    invalidate_rings(qdo_ready, k_ready, v_ready, STAGES)
    q.store((dq * scale).to(dtype))  # dQ leaves through Q's buffer (every MMA is done)
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [b, h, m0, 0], q_buf)
    tma.store_wait(0)


# ----------------------------------------------------------------------------- launcher
def may_take(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility, capability) -> bool:
    """Whether this backward runs these inputs, but for the output gradient's dtype and every
    tensor's alignment (takes): an sm_90 GPU; no attn_mask; any band (a window, causal or none),
    or a BlockMask (while ENABLED["block_mask_backward"]) of tiles that are multiples of 64 on
    each side whose lists do not differ between the q heads of a kv head; fp16 / bf16 with head
    dims 64 or 128; non-empty. Reads no data pointer: also what torch.compile's tracing asks."""
    bm = vis.block_mask
    if bm is not None:  # dK/dV reads one list per kv head: the mask's lists must not differ within a group
        region = (ENABLED["block_mask_backward"] and bm.block_q % BLOCK_M == 0 and bm.block_k % BLOCK_N == 0
                  and (bm.q_counts.shape[1] == 1 or k.shape[1] == q.shape[1]))
    else:
        region = ENABLED["backward"]
    return (region and vis.attn_mask is None and vis.seqlens is None and capability == (9, 0)
            and q.dtype in DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
            and q.shape[-1] in HEAD_DIMS and v.shape[-1] == q.shape[-1] and q.shape[2] > 0 and k.shape[2] > 0)


def takes(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility,
          capability) -> bool:
    """Whether this backward runs these inputs: may_take, the output's gradient in q's dtype, and
    q, k, v and the output's gradient TMA-able."""
    return (may_take(q, k, v, vis, capability) and grad_out.dtype == q.dtype
            and tma_ready(q, k, v, grad_out))


def _input_descriptors(q, k, v, grad_out, block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> tuple:
    """TMA descriptors of q, k, v and the output's gradient, which both kernels read the same
    way: built once a backward (~3 us of host time each)."""
    return (tma_descriptor(q, block_m), tma_descriptor(k, block_n), tma_descriptor(v, block_n),
            tma_descriptor(grad_out, block_m))


def _row_descriptors(lse: torch.Tensor, delta: torch.Tensor, block: int) -> tuple | None:
    """3-D TMA descriptors over the contiguous (B, H, Sq) float32 lse and delta, `block` rows a
    load, or None where TMA cannot read them (row strides not a multiple of 16 bytes, a base not
    16-byte aligned): dK/dV then loads them."""
    if lse.shape[-1] % 4 or any(t.data_ptr() % 16 for t in (lse, delta)):
        return None
    return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block], ROW_LAYOUT.value)
                 for t in (lse, delta))


def _arguments(kernel_out: tuple, q, k, v, grad_out, lse, delta, scale: float, vis: Visibility,
               block_m: int = BLOCK_M, block_n: int = BLOCK_N, stages: int = STAGES, num_warps: int = NUM_WARPS,
               out=None, inputs=None):
    """Arguments and constexprs of dkdv_kernel (kernel_out = (dk, dv): a BlockMask's lists per
    key tile) or dq_kernel (kernel_out = (dq,): its lists per query tile; given the forward's
    `out`, it computes delta too); `inputs`: _input_descriptors' result where the caller has it.
    The tile shape and pipeline depth are parameters for the experiment."""
    H, Sq, Hkv, Sk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    dkdv = len(kernel_out) == 2
    inputs = inputs or _input_descriptors(q, k, v, grad_out, block_m, block_n)
    outs = tuple(tma_descriptor(t, block_n if dkdv else block_m) for t in kernel_out)
    lists, mb_q, mb_k = list_arguments(vis.block_mask, "q" if dkdv else "kv", lse)
    if vis.block_mask is None:
        mb_q, mb_k = block_m, block_n
    if dkdv:  # lse and delta ride the Q and dO rings where TMA can read them (_issue_step)
        descriptors = _row_descriptors(lse, delta, block_m)
        rows = (*(descriptors or (lse, delta)), lse, delta)
    else:
        rows = (lse, delta, *((lse, 0, 0, 0) if out is None else (out, *out.stride()[:3])))
    args = (*inputs, *outs, *rows, *lists, H, H // Hkv, Sq, Sk, Sk - Sq,
            vis.left if vis.left is not None else 0, vis.right if vis.right is not None else 0, scale * LOG2E, scale)
    constexprs = dict(HAS_LEFT=vis.left is not None, HAS_RIGHT=vis.right is not None,
                      BLOCK_SPARSE=vis.block_mask is not None, MB_Q=mb_q, MB_K=mb_k, STAGES=stages,
                      num_warps=num_warps)
    if dkdv:
        constexprs["ROWS_TMA"] = descriptors is not None
    else:
        constexprs["FUSE_DELTA"] = out is not None
    return args, constexprs


def backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, delta: torch.Tensor, scale: float, vis: Visibility):
    """(dq, dk, dv) from the forward's out and lse; `takes` having agreed. delta (B, H, Sq)
    float32 holds rowsum(O * dO) already, or with FUSE_DELTA is filled here by the dQ launch,
    which then runs first."""
    B, H, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    inputs = _input_descriptors(q, k, v, grad_out)
    dq_launch = _arguments((dq,), q, k, v, grad_out, lse, delta, scale, vis, stages=ring_stages(q.shape[-1], vis),
                           out=out if FUSE_DELTA else None, inputs=inputs)
    if FUSE_DELTA:
        launch(dq_kernel, (cdiv(Sq, BLOCK_M), B * H), *dq_launch[0], **dq_launch[1])
    args, constexprs = _arguments((dk, dv), q, k, v, grad_out, lse, delta, scale, vis, inputs=inputs)
    launch(dkdv_kernel, (cdiv(Sk, BLOCK_N), B * Hkv), *args, **constexprs)
    if not FUSE_DELTA:
        launch(dq_kernel, (cdiv(Sq, BLOCK_M), B * H), *dq_launch[0], **dq_launch[1])
    return dq, dk, dv


def compile_for_sm90(head_dim: int, dtype: torch.dtype, has_right: bool, kernels=("dkdv", "dq"),
                     block_sparse: bool = False, **config) -> dict:
    """sm90_usage of the kernels named ({"dkdv": ..., "dq": ..., "dq_fuse_delta": ...}) on a
    window of 512 (or that window as a BlockMask of 64 x 64 tiles), at the library's tiles or at
    `config` (block_m, block_n, stages, num_warps)."""
    t = torch.zeros(1, 2, 1000, head_dim, dtype=dtype)
    rows = torch.zeros(1, 2, 1000)
    if block_sparse:
        from kernelforge.block_mask import sliding_window_block_mask
        vis = Visibility(None, 0 if has_right else None, block_mask=sliding_window_block_mask(1000, 1000, 512))
    else:
        vis = Visibility(512, 0 if has_right else None)
    dq_config = {"stages": ring_stages(head_dim, vis), **config}
    builds = {"dkdv": (dkdv_kernel, (t, t), None), "dq": (dq_kernel, (t,), None),
              "dq_fuse_delta": (dq_kernel, (t,), t)}
    return {name: sm90_usage(builds[name][0], *_arguments(builds[name][1], t, t, t, t, rows, rows, 0.1, vis,
                                                          out=builds[name][2],
                                                          **(config if name == "dkdv" else dq_config)))
            for name in kernels}
