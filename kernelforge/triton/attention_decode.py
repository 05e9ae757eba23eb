"""Flash-decoding: a few query tokens against a long KV cache, split along the keys.

The query-tiled forward gives each (batch, head) one program per 128 query rows; with one
query token and B * H of a few dozen, most SMs idle while each program walks the whole
cache. Here the keys are cut into `splits` ranges, one program per (range, batch, kv head),
and a second kernel merges the partial results by their log-sum-exp.

The q heads that share a kv head (GQA) and their query tokens form the rows of one tile
(row r: head h = kv_head * GROUP + r // Sq, token i = r % Sq), so each K / V tile is read
from memory once for the whole group: the cache dominates the bytes, 2 * B * Hkv * Sk * D
elements, read once; FLOPs 4 * B * H * Sq * Sk * D. Memory bound: the rows pad to 16 for
the tensor cores, the masks are applied on every tile (their cost hides under the loads).

A KV cache's filled lengths (vis.seqlens, (B,) on the device) are read by the split kernel: a
range past batch b's length runs no tile, and the band aligns to that length. Nothing about
them reaches the host, so a decode step can be captured in a CUDA graph and replayed with new
lengths written into the same tensor; the split count follows the cache's capacity Sk.

A paged cache (vis.block_table (B, max_blocks), with seqlens): k and v are page pools
(num_blocks, Hkv, page_size, D), read through their strides (FlashAttention's (num_blocks,
page_size, Hkv, D) pool as a .transpose(1, 2) view, no copy), and the same kernel, PAGED set,
walks batch b's logical keys 0 .. capacity = max_blocks * page_size as the contiguous cache does:
for a key tile it looks up the pages in the block table and hands forward_tile base pointers
shifted so that its `base + key * stride` lands on slot key % page_size of page
block_table[b, key // page_size] (page_bases). Tiles start at multiples of BLOCK_N (so do the
key ranges), so where page_size is a multiple of BLOCK_N a tile never straddles pages: one table
entry a tile and scalar bases (WHOLE_PAGES). Any other page size (1, 7, 16 under BLOCK_N = 64)
takes the entry of each key row (BLOCK_N small loads from one table row, cached) and a base per
row: no restriction on the page size, one kernel either way. Only the entries of tiles below the
filled length are read (a padded table's unused entries may hold anything), and no key past it
is loaded. Bytes: the filled keys' K and V rows, Hkv * (D + Dv) elements a key over the sum_b
L[b] filled keys (each key range's last tile rounded up to BLOCK_N rows, the rows past the length
masked off, not loaded), the table's entries of the filled pages (one a tile, or one a key row:
4 or 8 bytes each), q, and the partials (splits * (Dv + 1) floats a row) written and merged:
memory bound as the contiguous cache is, the pages adding no bytes of K or V. FLOPs: 2 * H * Sq *
(D + Dv) a filled key (the rows padded to 16 for the tensor cores compute too, unused).
Capacity, not the lengths, sets the split count (what a CUDA graph's replays share).
The decode kernel takes every paged call of up to MAX_ROWS rows a kv head, however short the
cache (a contiguous copy would cost more than the split kernel's short walk).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernelforge.reference.attention import Visibility
from kernelforge.triton._launch import cdiv, launch, next_power_of_2, on_device, sm_count
from kernelforge.triton.attention_kernels import LN2, finish_rows, forward_tile

MAX_ROWS = 64  # GROUP * Sq rows of one tile; beyond this the query-tiled forward is as good
MIN_KEYS = 512  # shorter caches: one query-tiled program walks them quickly enough
# At least this many keys a program (a tile's worth): at batch 1 and a short cache the split
# count, not the merge, limits the pace. H200, B1 H16 D128, in a CUDA graph of 16 layers
# (benchmarks/tuning/decode_step_sweep.py): 601 of 768 rows 8.62 -> 7.15 us from 256 keys, 1501 of 2048
# and 4001 of 4096 within 1% (the programs-per-SM bound sets the split count there).
KEYS_PER_SPLIT = 64
# Key ranges are cut while B * Hkv * splits stays within this many programs an SM, the split
# count rounded down (two fit at once; a memory-bound 4-warp program needs the company to keep
# loads in flight). H200, the attention_decode suite (results/nvidia-h200/0.1.0/attention/decode-two-per-sm/),
# device time against one program an SM rounded up (85ad993): B1 H32/8 Sk65536 91 -> 79 us
# (17 splits had put 136 programs on 132 SMs), B8 H32/8 Sk65536 493 -> 484 us, B1 H32/32
# Sk65536 267 -> 251 us, no shape slower. Rounding down at one an SM (68f35e4) had left
# bandwidth unused (B8 H32/8 Sk65536: 532 us).
PROGRAMS_PER_SM = 2
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3


def takes(q: torch.Tensor, k: torch.Tensor, vis: Visibility) -> bool:
    """Whether flash_forward should decode these inputs by splitting the keys."""
    group = q.shape[1] // k.shape[1]
    rows_fit = vis.block_mask is None and q.shape[2] * group <= MAX_ROWS
    return rows_fit and (vis.block_table is not None or k.shape[2] >= MIN_KEYS)


@triton.jit
def page_bases(K, V, BLOCK_TABLE, b, hk, n0, offs_n, stop, sbtb, sbtn, page_size, skp, skh, skn, svp, svh, svn,
               WHOLE_PAGES: tl.constexpr):
    """(K base, V base) of the key tile n0 + offs_n of batch b, kv head hk, in page pools: bases such
    that base + key * skn (svn) addresses slot key % page_size of page BLOCK_TABLE[b, key // page_size]
    (forward_tile adds key * stride to what it is given). WHOLE_PAGES: the tile lies in one page,
    scalar bases from one entry; else one entry and one base a key row ([BLOCK_N, 1] pointers),
    the rows from `stop` on (never loaded) reading no entry."""
    row = BLOCK_TABLE + b.to(tl.int64) * sbtb
    if WHOLE_PAGES:
        blk = n0 // page_size
        page = tl.load(row + blk * sbtn).to(tl.int64)
        first = (blk * page_size).to(tl.int64)  # the page's slot 0 is this logical key
        k = K + (page * skp + hk.to(tl.int64) * skh - first * skn)
        v = V + (page * svp + hk.to(tl.int64) * svh - first * svn)
    else:
        cols = n0 + offs_n
        blk = cols // page_size
        page = tl.load(row + blk * sbtn, mask=cols < stop, other=0).to(tl.int64)
        first = (blk * page_size).to(tl.int64)
        k = K + (page * skp + hk.to(tl.int64) * skh - first * skn)[:, None]
        v = V + (page * svp + hk.to(tl.int64) * svh - first * svn)[:, None]
    return k, v


@triton.jit
def decode_split_kernel(
    Q, K, V, O_PART, LSE_PART, MASK, SEQLENS, BLOCK_TABLE,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
    smb, smh, smm, smn, sbtb, sbtn,
    H, HKV, GROUP, Sq, Sk, off, LEFT, RIGHT, qk_scale, keys_per_split, page_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, PRECISION: tl.constexpr, HAS_SEQLENS: tl.constexpr, PAGED: tl.constexpr,
    WHOLE_PAGES: tl.constexpr,
):
    """Partial attention of every (q head of the group, query) row over one key range:
    normalized out (float32) and lse in log2 units (-inf when the range shows the row nothing).
    HAS_SEQLENS: batch b's keys end at SEQLENS[b] (clamped to [0, Sk]), its band aligns there.
    PAGED: K and V are page pools (skb / svb their page strides), Sk the table's capacity, and each
    tile's keys are found through BLOCK_TABLE (page_bases; the module docstring)."""
    # Inductor passes a Python float as fp64 (eager Triton as fp32): float32 math either way
    qk_scale = tl.cast(qk_scale, tl.float32)
    split = tl.program_id(0)
    pid = tl.program_id(1)
    b = pid // HKV
    hk = pid % HKV
    if HAS_SEQLENS:
        Sk = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), Sk).to(tl.int32)
        off = Sk - Sq
    r = tl.arange(0, ROWS)
    g = r // Sq
    row_ok = g < GROUP
    i = tl.where(row_ok, r % Sq, Sq)  # padded rows get an out-of-range token: every key hidden
    h = hk * GROUP + tl.where(row_ok, g, 0)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + b.to(tl.int64) * sqb + h[:, None].to(tl.int64) * sqh + i[:, None] * sqm + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_base = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    mask_base = MASK + b.to(tl.int64) * smb + h[:, None].to(tl.int64) * smh

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_DV], tl.float32)
    start = split * keys_per_split
    stop = tl.minimum(start + keys_per_split, Sk)
    for n0 in range(start, stop, BLOCK_N):  # every tile masked: the range end, the band, the mask
        if PAGED:
            k_tile, v_tile = page_bases(K, V, BLOCK_TABLE, b, hk, n0, offs_n, stop, sbtb, sbtn, page_size,
                                        skb, skh, skn, svb, svh, svn, WHOLE_PAGES)
        else:
            k_tile, v_tile = k_base, v_base
        acc, m_i, l_i = forward_tile(
            acc, m_i, l_i, q, k_tile, v_tile, skn, svn, n0, i, offs_n, offs_d, offs_dv, Sq, stop, off, LEFT, RIGHT,
            qk_scale, mask_base, smm, smn, MASK, -1, True, HEAD_DIM, HEAD_DIM_V, True, HAS_LEFT, HAS_RIGHT, MASK_KIND,
            False, 16, 16, PRECISION)
    out, lse2 = finish_rows(acc, m_i, l_i)
    # partial buffers: (splits, B, H, Sq[, Dv]) float32, dense
    row = ((split * (tl.num_programs(1) // HKV) + b) * H + h).to(tl.int64) * Sq + i
    tl.store(LSE_PART + row, lse2, mask=row_ok)
    tl.store(O_PART + row[:, None] * HEAD_DIM_V + offs_dv[None, :], out,
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def decode_merge_kernel(O_PART, LSE_PART, O, LSE, rows, splits, sob, soh, som, H, Sq,
                        HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr):
    """out = sum_s w_s out_s / sum_s w_s with w_s = exp2(lse_s - max lse): one program per
    (batch, head, token) row. Bytes: the partials, splits * (Dv + 1) floats a row."""
    row = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_ok = offs_s < splits
    lse = tl.load(LSE_PART + offs_s.to(tl.int64) * rows + row, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top_use = tl.where(top == float("-inf"), 0.0, top)
    w = tl.math.exp2(lse - top_use)
    total = tl.sum(w, 0)
    parts = tl.load(O_PART + (offs_s[:, None].to(tl.int64) * rows + row) * HEAD_DIM_V + offs_dv[None, :],
                    mask=s_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    seen = total != 0  # NaN (a split's NaN) is seen: it reaches out and lse
    out = tl.sum(parts * w[:, None], 0) / tl.where(seen, total, 1.0)
    bh = row // Sq
    i = row % Sq
    b = bh // H
    h = bh % H
    tl.store(O + b.to(tl.int64) * sob + h.to(tl.int64) * soh + i * som + offs_dv, out.to(O.dtype.element_ty),
             mask=offs_dv < HEAD_DIM_V)
    tl.store(LSE + row, tl.where(seen, (top_use + tl.math.log2(tl.where(seen, total, 1.0))) * LN2, float("-inf")))


def decode_forward(q, k, v, scale: float, vis: Visibility, mask_args, band, precision: str, pow2, log2e: float):
    """(out, lse) of q (B, H, Sq, D) over the cache k, v (B, Hkv, Sk, D), or over the page pools k, v
    (num_blocks, Hkv, page_size, D) of vis.block_table; the arguments after vis are flash_forward's
    already-derived launch arguments."""
    B, H, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    table = vis.block_table
    page_size = Sk
    if table is not None:
        Sk = table.shape[1] * page_size  # the capacity: logical keys 0 .. Sk - 1 of each sequence
    group = H // Hkv
    mask, mstr, mask_kind = mask_args
    left, right, has_left, has_right = band
    programs = B * Hkv
    # int(): a launch size and a constexpr (BLOCK_S); under torch.compile's dynamic shapes, a guard
    splits = int(max(1, min(PROGRAMS_PER_SM * sm_count(q.device) // programs, cdiv(Sk, KEYS_PER_SPLIT))))
    keys_per_split = cdiv(cdiv(Sk, splits), BLOCK_N) * BLOCK_N
    splits = int(cdiv(Sk, keys_per_split))
    o_part = torch.empty(splits, B, H, Sq, Dv, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(splits, B, H, Sq, dtype=torch.float32, device=q.device)
    out = torch.empty(B, H, Sq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    rows = B * H * Sq
    merge_args = (o_part, lse_part, out, lse, rows, splits, *out.stride()[:3], H, Sq)
    merge_meta = dict(HEAD_DIM_V=Dv, BLOCK_DV=pow2(Dv), BLOCK_S=max(2, next_power_of_2(splits)), num_warps=4)
    # Everything for both launches is ready before the first: the merge is queued right
    # behind the split kernel (6.6 us at B1 H32/8 Sk4096), not after more host work.
    with on_device(q):
        launch(
            decode_split_kernel, (splits, programs),
            q, k, v, o_part, lse_part, mask, q if vis.seqlens is None else vis.seqlens, q if table is None else table,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *mstr, *((0, 0) if table is None else table.stride()),
            H, Hkv, group, Sq, Sk, Sk - Sq, left, right, scale * log2e, keys_per_split,
            page_size if table is not None else 1,  # 1: unused, a constant (no kernel variant a cache length)
            HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=pow2(D), BLOCK_DV=pow2(Dv), ROWS=pow2(group * Sq),
            BLOCK_N=BLOCK_N, HAS_LEFT=has_left, HAS_RIGHT=has_right, MASK_KIND=mask_kind, PRECISION=precision,
            HAS_SEQLENS=vis.seqlens is not None, PAGED=table is not None,
            WHOLE_PAGES=table is not None and int(page_size) % BLOCK_N == 0,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES)
        launch(decode_merge_kernel, (rows,), *merge_args, **merge_meta)
    return out, lse
