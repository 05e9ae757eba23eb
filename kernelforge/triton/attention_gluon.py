"""Hopper flash-attention forward for a band of keys (sliding window) or a BlockMask, in Gluon.

Why a second forward next to attention_kernels.py: on a short band (a causal window of 512
keys: nine 64-key tiles a query tile) the Triton kernel computes at ~37% of the H200's bf16
peak, against ~49% on dense rows. Triton 3.6 issues each tile's two MMAs and its softmax
one after another, so the tensor cores idle while the exponentials run (a 64x64 score tile
costs about half as long on the SFU as its two MMAs on the tensor cores at d = 128). Gluon
gives the schedule to the kernel writer. This kernel keeps, per tile j (FlashAttention-3's
order inside one warpgroup):

    issue S_j = Q K_j^T            (async wgmma)
    issue O  += P_{j-1} V_{j-1}    (async wgmma, P from registers)
    wait for S_j; refill its K slot by TMA; softmax(S_j) -> P_j, alpha_j  (under the PV MMA)
    wait for the PV MMA; refill its V slot by TMA; O *= alpha_j

One warpgroup (4 warps) owns a 64-row query tile; two or more programs fit an SM (registers
and shared memory), so one program's softmax also runs under the others' MMAs. K and V tiles
stream through a ring of STAGES shared-memory buffers filled by TMA (mbarrier completion);
Q comes once by TMA, and its buffer stages O for the TMA store. 4-D TMA descriptors over
(batch, heads, seq, dim) take any strides with a unit last dim and 16-byte rows, return
zeros past the sequence ends and clip the store there.

Which key tiles a query tile walks: a band's run of tiles from its first, or a BlockMask's
list for the query tile's row of mask tiles (full tiles first; each mask tile, a multiple of
64 on each side, cut into 64 x 64 kernel tiles). The same pipeline runs either way; only the
key index of tile j and its masking differ (walk_tile).

Work per (batch, head): FLOPs 4 * Sq * (keys walked) * D, bytes Q, O once and K, V once per
query tile (from L2: neighbouring tiles share most of their keys). Scores are in log2 units
as in attention_kernels.py. Masking runs on edge tiles only, under a run-time branch: a
band's first and last tiles (the band and the key tail), a BlockMask's partial tiles (their
bits, BlockMask.partial_words: one 64-bit word a row, loaded before the wait for the scores),
every tile when a band comes on top of a BlockMask. Rows that see no key get out = 0,
lse = -inf, as the Triton forward gives.

Measured (H200, bf16, 2 x 16 heads x 8192, d128):
- causal window 512 (bb0baf0-gluon-window/): 0.187 ms against the Triton forward's 0.211
  and FlexAttention's 0.284; 0.174 ms with a one-stage ring at d128 (three programs an SM,
  ring_stages). Deeper rings, 128-key or 32-key tiles, 128-row tiles on 8 warps and a
  persistent grid were each slower (gluon-window-experiment/).
- BlockMasks (block-mask-experiment/, 64 x 64 mask tiles): the same window 205 us, Longformer
  local + global 319 us, a dilated window (every tile partial) 401 us, against Flex's 283,
  575 and 497 us on the same mask functions; the Triton forward took 333 us on that window
  with 128 x 128 tiles.

Only sm_90 has wgmma; kernelforge/triton/attention.py sends a call here when `takes` says so
and keeps the Triton forward for everything else (attn_mask, mask tiles under 64, other
GPUs, fp32, other head dims). The backward is in Gluon too (attention_gluon_backward.py), for
causal and full attention as well; a BlockMask that differs between the q heads of a kv group
takes the Triton one. Both backwards read (out, lse) as the Triton forward writes them.
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernelforge.reference.attention import Visibility
from kernelforge.triton._launch import cdiv, launch
from kernelforge.triton.attention_visibility import in_band, row_range

HEAD_DIMS = (64, 128)
DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
BLOCK_M = 64  # one warpgroup's wgmma height
BLOCK_N = 64  # the band's waste grows with the key tile; 64 keys is the Triton forward's best too
STAGES = 2
# a one-stage ring at d128 without a BlockMask (ring_stages), forward and dQ: three programs an
# SM (~49 KB of shared memory and ~150 registers a thread each) instead of two hide more latency
# than the deeper ring (H200 bf16, 2 x 16 x 8192, causal window 512: forward 188 -> 174 us, dQ
# 219 -> 213; dQ causal 1342 -> 1331, every key 2630 -> 2506). At d64 two stages already fit
# four programs; a BlockMask's kernels (180+ registers) fit two either way.
ONE_STAGE_HEAD_DIM = 128
NUM_WARPS = 4
LOG2E = 1.4426950408889634
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)
# Off switches for experiments and tests (the Gluon window experiment timed both forwards:
# docs/notes/attention.md);
# "backward" and "block_mask_backward" are attention_gluon_backward.py's.
ENABLED = {"window": True, "block_mask": True, "backward": True, "block_mask_backward": True}


@gluon.jit
def _band_tiles(m0, Sq, Sk, off, LEFT, RIGHT, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """Key range of query rows [m0, m0 + BLOCK_M): first key tile `lo`, tile count (at least
    one: a tile past every visible key is fully masked), and [full_lo, full_hi), the tiles
    inside every bound: the Triton kernels' row_range (scalar integer math, which Gluon
    traces as Triton does)."""
    lo, full_lo, full_hi, hi = row_range(m0, Sq, Sk, off, LEFT, RIGHT, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    lo = gl.minimum(lo, gl.maximum(Sk - 1, 0) // BLOCK_N * BLOCK_N)  # keep the (masked) first tile in range
    tiles = gl.maximum(gl.cdiv(hi - lo, BLOCK_N), 1)
    return lo, tiles, full_lo, full_hi


@gluon.jit
def key_walk(b, h, m0, COUNTS, scb, sch, sbb, sbh, NUM_MB_K, Sq, Sk, off, LEFT, RIGHT, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_SPARSE: gl.constexpr,
             MB_Q: gl.constexpr, MB_K: gl.constexpr):
    """The key tiles query rows [m0, m0 + BLOCK_M) of (b, h) walk (the forward's and dQ's):
    (lo, tile count, full_lo, full_hi) of a band (_band_tiles), or the BlockMask's list for the
    mask row holding them (its entry count and base; a tile count of at least one: nothing
    listed walks one stand-in tile, all hidden)."""
    if BLOCK_SPARSE:
        lo = 0
        full_lo = 0
        full_hi = 0
        count = gl.load(COUNTS + b * scb + h * sch + m0 // MB_Q)
        list_base = b * sbb + h * sbh + (m0 // MB_Q) * NUM_MB_K
        tiles = gl.maximum(count * (MB_K // BLOCK_N), 1)
    else:
        lo, tiles, full_lo, full_hi = _band_tiles(m0, Sq, Sk, off, LEFT, RIGHT, BLOCK_M, BLOCK_N, HAS_LEFT,
                                                  HAS_RIGHT)
        count = 0
        list_base = 0
    return lo, tiles, full_lo, full_hi, count, list_base


@gluon.jit
def issue_tile(desc, bufs, ready, b, head, row0, slot, pred):
    """TMA load of the tile of rows [row0, row0 + block) of (b, head) into ring slot `slot`,
    completing on its barrier (here K and V tiles: each has its own ring, as the S MMA needs
    only K and frees it first)."""
    mbarrier.expect(ready.index(slot), desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [b, head, row0, 0], ready.index(slot), bufs.index(slot), pred=pred)


@gluon.jit
def query_tile_program(H, GROUP, BLOCK_M: gl.constexpr):
    """A program of a (query tile, batch * head) grid: (batch * head, batch, head, kv head,
    first row)."""
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    m0 = gl.program_id(0) * BLOCK_M
    return pid_bh, b, h, hk, m0


@gluon.jit
def one_and_two_rings(one_desc, a_desc, b_desc, STAGES: gl.constexpr):
    """Shared memory for one tile loaded once (one_desc's block) and two rings of STAGES tiles
    (a_desc's and b_desc's), each with its TMA completion barriers, initialized: (one buffer,
    its barrier, ring a, its barriers, ring b, its barriers)."""
    dtype: gl.constexpr = one_desc.dtype
    one = gl.allocate_shared_memory(dtype, one_desc.block_type.shape, one_desc.layout)
    ring_a = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    ring_b = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    one_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(one_ready, count=1)
    for st in gl.static_range(STAGES):
        mbarrier.init(a_ready.index(st), count=1)
        mbarrier.init(b_ready.index(st), count=1)
    return one, one_ready, ring_a, a_ready, ring_b, b_ready


@gluon.jit
def invalidate_rings(one_ready, a_ready, b_ready, STAGES: gl.constexpr):
    """Invalidate the barriers of one_and_two_rings once every TMA load on them has landed."""
    mbarrier.invalidate(one_ready)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(a_ready.index(st))
        mbarrier.invalidate(b_ready.index(st))


@gluon.jit
def walk_tile(t, lo, full_lo, full_hi, list_base, count, BLOCKS, PARTIAL, BLOCK: gl.constexpr,
               BLOCK_SPARSE: gl.constexpr, MB: gl.constexpr, HAS_BAND: gl.constexpr):
    """The t-th tile of a program's walk (key tiles of a query tile in the forward and dQ,
    query tiles of a key tile in dK/dV): its first index, its partial-tile id (-1: none; -2:
    the stand-in tile of a query row with nothing listed, every pair hidden) and whether it
    needs per-element masking. A band's tiles run from `lo`; a BlockMask's come from its list
    (full tiles first), each mask tile (MB wide along the walk) cut into MB / BLOCK kernel
    tiles. Past the list the id is -2 too: such tiles are only ever prefetched under a false
    predicate."""
    if BLOCK_SPARSE:
        SUB: gl.constexpr = MB // BLOCK
        entry = t // SUB
        listed = entry < count
        mb = gl.load(BLOCKS + list_base + entry, mask=listed, other=0)
        partial_id = gl.load(PARTIAL + list_base + entry, mask=listed, other=-2)
        start = mb * MB + (t % SUB) * BLOCK
        if HAS_BAND:  # a band on top of the block mask: every tile checks it
            edge = partial_id > -3
        else:  # full tiles lie inside Sq x Sk: only partial ones (tails included) need checks
            edge = partial_id != -1
    else:
        start = lo + t * BLOCK
        partial_id = -1
        edge = (start < full_lo) | (start >= full_hi)
    return start, partial_id, edge


@gluon.jit
def tile_words(WORDS, partial_id, r0, c0, tile_rows, BLOCK_SPARSE: gl.constexpr, MB_R: gl.constexpr,
                MB_C: gl.constexpr):
    """A partial tile's bits, one 64-bit word a tile row: BlockMask.partial_words for tiles with
    query rows [r0, ...) and keys [c0, c0 + 64) (the forward's, dQ's), partial_words_t for tiles
    with key rows and query columns (dK/dV's); MB_R x MB_C is the mask tile in that orientation.
    The kernel tile lies inside one mask tile, 64 columns wide, so each row is one word and every
    index is in bounds. Loaded only for a partial tile, two loads a thread, issued before the
    wait for the tile's scores so their latency hides under the MMAs."""
    if BLOCK_SPARSE:
        WORDS_A_ROW: gl.constexpr = MB_C // 64
        base = (WORDS + partial_id.to(gl.int64) * (MB_R * WORDS_A_ROW) + (r0 % MB_R) * WORDS_A_ROW
                + (c0 % MB_C) // 64)
        return gl.load(base + tile_rows * WORDS_A_ROW, mask=partial_id >= 0, other=-1)
    else:
        return 0


@gluon.jit
def tile_visible(i, j, words, bit, partial_id, Sq, Sk, off, LEFT, RIGHT, HAS_LEFT: gl.constexpr,
                  HAS_RIGHT: gl.constexpr, BLOCK_SPARSE: gl.constexpr, HALVES: gl.constexpr):
    """Which (query i, key j) pairs of an edge tile are seen (broadcastable index tiles, either
    orientation): the band and the tails, and a partial tile's bits (bit `bit` of the tile row's
    word, `words` one a tile row; none of the stand-in tile's pairs). HALVES tests the bit in
    the word's 32-bit halves: dK/dV at d128, whose registers are full, spills 280 bytes on the
    64-bit shifts and 28 on the halves (compiled for sm_90a); the forward keeps the 64-bit
    shift it was measured with."""
    ok = in_band(i, j, Sq, Sk, off, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT)
    if BLOCK_SPARSE:
        if HALVES:
            half = gl.where(bit < 32, words.to(gl.int32)[:, None], (words >> 32).to(gl.int32)[:, None])
            seen = (half >> (bit % 32)) & 1
        else:
            seen = (words[:, None] >> bit.to(gl.int64)) & 1
        ok = ok & (seen != 0) & (partial_id != -2)
    return ok


@gluon.jit
def _tile_softmax(s, m_i, l_i, n0, partial_id, edge, words, rows, cols, Sq, Sk, off, LEFT, RIGHT, qk_scale,
                  HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_SPARSE: gl.constexpr):
    """Online softmax of one raw score tile: the masks of an edge tile (band, tails, a
    partial tile's bits), the new running max (log2 units) and sum, P, and
    alpha = exp2(m_old - m_new) for the accumulator."""
    if edge:  # bit c of a row's word: key n0 + c
        ok = tile_visible(rows[:, None], n0 + cols[None, :], words, cols[None, :], partial_id, Sq, Sk, off, LEFT,
                           RIGHT, HAS_LEFT, HAS_RIGHT, BLOCK_SPARSE, False)
        s = gl.where(ok, s, float("-inf"))
    # qk_scale > 0: max(s) * scale is the max of the scaled scores; s * scale - m is one FMA
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    p = gl.exp2(s * qk_scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def forward_kernel(q_desc, k_desc, v_desc, o_desc, LSE, COUNTS, BLOCKS, PARTIAL, WORDS, scb, sch, sbb, sbh, NUM_MB_K,
                   H, GROUP, Sq, Sk, off, LEFT, RIGHT, qk_scale,
                   HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_SPARSE: gl.constexpr, MB_Q: gl.constexpr,
                   MB_K: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
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
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_buf, q_ready, k_bufs, k_ready, v_bufs, v_ready = one_and_two_rings(q_desc, k_desc, v_desc, STAGES)

    mbarrier.expect(q_ready, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], q_ready, q_buf)
    for st in gl.static_range(STAGES):
        n0, partial_id, edge = walk_tile(st, lo, full_lo, full_hi, list_base, count, BLOCKS, PARTIAL, BLOCK_N,
                                         BLOCK_SPARSE, MB_K, HAS_BAND)
        issue_tile(k_desc, k_bufs, k_ready, b, hk, n0, st, st < tiles)
        issue_tile(v_desc, v_bufs, v_ready, b, hk, n0, st, st < tiles)

    q = q_buf.reshape([BLOCK_M, HEAD_DIM])
    rows = m0 + gl.arange(0, BLOCK_M, layout=s_rows)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    tile_rows = rows - m0
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

    # key tile 0: its S alone, then its softmax
    mbarrier.wait(q_ready, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q, k_bufs.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                      use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    n_ahead, _, _ = walk_tile(STAGES, lo, full_lo, full_hi, list_base, count, BLOCKS, PARTIAL, BLOCK_N,
                              BLOCK_SPARSE, MB_K, HAS_BAND)
    issue_tile(k_desc, k_bufs, k_ready, b, hk, n_ahead, 0, STAGES < tiles)  # K slot 0 is free
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, s_rows)
    n0, partial_id, edge = walk_tile(0, lo, full_lo, full_hi, list_base, count, BLOCKS, PARTIAL, BLOCK_N,
                                     BLOCK_SPARSE, MB_K, HAS_BAND)
    words = tile_words(WORDS, partial_id, m0, n0, tile_rows, BLOCK_SPARSE, MB_Q, MB_K)
    p, m_i, l_i, alpha = _tile_softmax(s, m_i, l_i, n0, partial_id, edge, words, rows, cols, Sq, Sk, off, LEFT,
                                       RIGHT, qk_scale, HAS_LEFT, HAS_RIGHT, BLOCK_SPARSE)
    p = gl.convert_layout(p.to(dtype), p_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    for j in range(1, tiles):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
        s = warpgroup_mma(q, k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        n0, partial_id, edge = walk_tile(j, lo, full_lo, full_hi, list_base, count, BLOCKS, PARTIAL, BLOCK_N,
                                         BLOCK_SPARSE, MB_K, HAS_BAND)
        words = tile_words(WORDS, partial_id, m0, n0, tile_rows, BLOCK_SPARSE, MB_Q, MB_K)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p, v_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))
        # S_j is done with K slot `stage`: refill it with K tile j + STAGES under the softmax
        n_ahead, _, _ = walk_tile(j + STAGES, lo, full_lo, full_hi, list_base, count, BLOCKS, PARTIAL, BLOCK_N,
                                  BLOCK_SPARSE, MB_K, HAS_BAND)
        issue_tile(k_desc, k_bufs, k_ready, b, hk, n_ahead, stage, j + STAGES < tiles)
        p_next, m_i, l_i, alpha = _tile_softmax(s, m_i, l_i, n0, partial_id, edge, words, rows, cols, Sq, Sk, off,
                                                LEFT, RIGHT, qk_scale, HAS_LEFT, HAS_RIGHT, BLOCK_SPARSE)
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        # P_{j-1} V_{j-1} is done with V slot `prev`: refill it with V tile j - 1 + STAGES
        n_ahead, _, _ = walk_tile(j - 1 + STAGES, lo, full_lo, full_hi, list_base, count, BLOCKS, PARTIAL, BLOCK_N,
                                  BLOCK_SPARSE, MB_K, HAS_BAND)
        issue_tile(v_desc, v_bufs, v_ready, b, hk, n_ahead, prev, j - 1 + STAGES < tiles)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        p = gl.convert_layout(p_next.to(dtype), p_layout)

    last = (tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((tiles - 1) // STAGES) & 1)
    acc = warpgroup_mma(p, v_bufs.index(last).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))

    invalidate_rings(q_ready, k_ready, v_ready, STAGES)

    # epilogue: out = acc / l (0 for a row that saw nothing), lse = (m + log2 l) * ln 2 or -inf;
    # O leaves through Q's buffer (every S MMA has completed)
    l_o = gl.convert_layout(l_i, o_rows)
    seen = l_o != 0  # l = 0: no key seen; a NaN l (a NaN score) reaches out and lse
    out = gl.where(seen[:, None], acc / gl.where(seen, l_o, 1.0)[:, None], 0.0)
    q.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, m0, 0], q_buf)
    seen_s = l_i != 0
    lse = gl.where(seen_s, (m_i + gl.log2(gl.where(seen_s, l_i, 1.0))) * LN2, float("-inf"))
    gl.store(LSE + pid_bh.to(gl.int64) * Sq + rows, lse, mask=rows < Sq)
    tma.store_wait(0)


# ----------------------------------------------------------------------------- launcher
def _tma_ready(t: torch.Tensor) -> bool:
    """A 4-D TMA descriptor needs a 16-byte aligned base and 16-byte multiples as strides; a
    broadcast dimension (stride 0, as an expanded tensor or autograd's gradient of a sum
    gives) is left to the Triton kernels, which read it in place."""
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((s * size) % 16 == 0 and (s > 0 or n == 1) for s, n in zip(t.stride()[:-1], t.shape[:-1])))


def may_take(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility, capability) -> bool:
    """Whether this forward runs these inputs, but for their memory's alignment (tma_ready): an
    sm_90 GPU; a band with a bounded left reach, or a BlockMask whose tiles are multiples of the
    kernel's 64 x 64 (with or without a band); no attn_mask, no KV cache lengths; fp16 / bf16 with
    head dims 64 or 128; non-empty. Reads no data pointer: also what torch.compile's tracing asks."""
    bm = vis.block_mask
    if bm is not None:
        region = ENABLED["block_mask"] and bm.block_q % BLOCK_M == 0 and bm.block_k % BLOCK_N == 0
    else:
        region = ENABLED["window"] and vis.left is not None
    return (region and capability == (9, 0) and vis.attn_mask is None and vis.seqlens is None
            and q.dtype in DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
            and q.shape[-1] in HEAD_DIMS and v.shape[-1] == q.shape[-1] and q.shape[2] > 0 and k.shape[2] > 0)


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can read every one of these tensors (_tma_ready)."""
    return all(_tma_ready(t) for t in tensors)


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility, capability) -> bool:
    """Whether this forward runs these inputs: may_take, and q, k, v TMA-able."""
    return may_take(q, k, v, vis, capability) and tma_ready(q, k, v)


@functools.lru_cache(maxsize=None)
def _shared_layout(rows: int, head_dim: int, dtype: torch.dtype):
    # building the layout costs ~7 us of host time; there are a handful of them
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], DTYPES[dtype])


def tma_descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, t.shape[-1]],
                            _shared_layout(rows, t.shape[-1], t.dtype))


def list_arguments(bm, per: str, stand_in: torch.Tensor):
    """A BlockMask's lists for a kernel walking key tiles per query tile (per="kv": the forward,
    dQ) or query tiles per key tile (per="q": dK/dV): (counts, blocks, partial ids, partial
    words in the walk's orientation, the counts' and the blocks' (batch, head) strides, 0 where
    broadcast, row length), and the mask tile (block_q, block_k). Without a BlockMask:
    stand-ins the band's trace never reads, and the kernel tile."""
    if bm is None:
        return (stand_in, stand_in, stand_in, stand_in, 0, 0, 0, 0, 0), BLOCK_M, BLOCK_N
    counts, blocks, partial, words = ((bm.kv_counts, bm.kv_blocks, bm.kv_partial, bm.partial_words) if per == "kv"
                                      else (bm.q_counts, bm.q_blocks, bm.q_partial, bm.partial_words_t))
    lists = (counts, blocks, partial, words,
             *(0 if counts.shape[d] == 1 else counts.stride(d) for d in (0, 1)),
             *(0 if blocks.shape[d] == 1 else blocks.stride(d) for d in (0, 1)), blocks.shape[-1])
    return lists, bm.block_q, bm.block_k


def _arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               scale: float, vis: Visibility):
    """forward_kernel's arguments and constexprs (the BlockMask's per-query-tile lists, or
    stand-ins the band's trace never reads)."""
    H, Sq, Hkv, Sk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    bm = vis.block_mask
    lists, mb_q, mb_k = list_arguments(bm, "kv", lse)
    args = (tma_descriptor(q, BLOCK_M), tma_descriptor(k, BLOCK_N), tma_descriptor(v, BLOCK_N),
            tma_descriptor(out, BLOCK_M), lse, *lists, H, H // Hkv, Sq, Sk, Sk - Sq, vis.left if vis.left is not None else 0,
            vis.right if vis.right is not None else 0, scale * LOG2E)
    constexprs = dict(HAS_LEFT=vis.left is not None, HAS_RIGHT=vis.right is not None, BLOCK_SPARSE=bm is not None,
                      MB_Q=mb_q, MB_K=mb_k, STAGES=ring_stages(q.shape[-1], vis), num_warps=NUM_WARPS)
    return args, constexprs


def ring_stages(head_dim: int, vis: Visibility) -> int:
    """The ring depth of the forward and of the backward's dQ (ONE_STAGE_HEAD_DIM says why)."""
    return 1 if head_dim == ONE_STAGE_HEAD_DIM and vis.block_mask is None else STAGES


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, vis: Visibility):
    """(out, lse); q, k, v as (B, H, S, D) with a unit last stride, `takes` having agreed."""
    B, H, Sq, D = q.shape
    out = torch.empty(B, H, Sq, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    args, constexprs = _arguments(q, k, v, out, lse, scale, vis)
    launch(forward_kernel, (cdiv(Sq, BLOCK_M), B * H), *args, **constexprs)
    return out, lse


# ----------------------------------------------------------------------------- build check
def sm90_usage(kernel, values: tuple, constexprs: dict) -> dict:
    """Compile a Gluon kernel for sm_90a without a GPU (Triton's own ptxas) on these launch
    arguments and report its registers a thread, spilled bytes and shared memory."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    signature = {name: mangle_type(arg) for name, arg in zip(kernel.arg_names, values)}
    signature.update({name: "constexpr" for name in constexprs})
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": constexprs["num_warps"]})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = f"{tmp}/kernel.ptx"
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", ptx, "-o", f"{tmp}/kernel.cubin"],
                                capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores", report)
    return {"registers": int(re.search(r"Used (\d+) registers", report).group(1)),
            "spills": int(spills.group(1)) if spills else 0, "shared": compiled.metadata.shared}


def compile_for_sm90(head_dim: int, dtype: torch.dtype, has_right: bool, block_sparse: bool = False) -> dict:
    """sm90_usage of the forward on a window of 512 (or that window as a BlockMask): the test
    suite's check that this Triton still builds it within the programs an SM it is launched for."""
    q = torch.zeros(1, 2, 1000, head_dim, dtype=dtype)
    lse = torch.zeros(1, 2, 1000)
    if block_sparse:  # the benchmark's mask: a causal window of 512 keys on 128 x 128 tiles
        from kernelforge.block_mask import sliding_window_block_mask
        vis = Visibility(None, 0 if has_right else None, block_mask=sliding_window_block_mask(1000, 1000, 512))
    else:
        vis = Visibility(512, 0 if has_right else None)
    return sm90_usage(forward_kernel, *_arguments(q, q, q, q, lse, 0.1, vis))
