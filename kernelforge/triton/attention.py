"""Launchers of the Triton flash-attention kernels (kernelforge/triton/attention_kernels.py).

flash_forward(q, k, v, scale, vis) -> (out, lse) and flash_backward(...) -> (dq, dk, dv), the
backend interface of kernelforge/ops/attention.py. A few query tokens against a long cache
take the split-key decode kernels (kernelforge/triton/attention_decode.py); a sliding window or a
BlockMask on an sm_90 GPU takes the Gluon forward (kernelforge/triton/attention_gluon.py) where
it applies, and a backward without attn_mask or BlockMask the Gluon one (attention_gluon_backward.py).
Inputs may have any strides whose last dimension is unit (else one copy); outputs are dense.
Masks are read through their strides (a broadcast mask is never materialized). A KV cache's
filled lengths (vis.seqlens) are read by the decode and forward kernels on the device (no host
read: a decode step can be captured in a CUDA graph); the backward does not take them. Launches
run on the current CUDA stream of q's device, and on CPU tensors under TRITON_INTERPRET=1.
A paged cache (vis.block_table; k and v page pools) is decoded from its pages in place where the
decode kernel takes the call (attention_decode.takes: up to MAX_ROWS query rows a kv head); any
other paged call (more query rows) gathers the pages into a contiguous cache first
(kernelforge.reference.attention.unpage: a copy of every page the table names) and runs as a
contiguous cache of the table's capacity.

`traceable(q, k, v, vis, backward)` says whether a call launches only plain @triton.jit kernels
through kernelforge.triton._launch.launch (what torch.compile can trace into), decided from
shapes, dtypes, options and the device, never from data pointers: False wherever a Gluon kernel
(Hopper; host-side TMA descriptors) may run. The launchers take the Gluon kernels only where it
is False, so a traced call never reaches them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernelforge.reference.attention import Visibility, unpage
from kernelforge.triton import attention_decode, interpreter_enabled
from kernelforge.triton._launch import cdiv, device_capability, gluon_module, launch, next_power_of_2, on_device
from kernelforge.triton.attention_kernels import (backward_delta_kernel, flash_backward_dkdv_kernel,
                                                  flash_backward_dq_kernel, flash_forward_kernel)

MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634  # the kernels take scores in log2 units


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _pow2(n: int) -> int:
    # int(): a constexpr; under torch.compile's dynamic shapes a head dim or row count is specialized
    return max(16, next_power_of_2(int(n)))


# Forward tiles by padded head dim. Each program keeps a BLOCK_M x D query tile and a
# BLOCK_M x Dv accumulator in registers and streams BLOCK_N x D key / value tiles through
# shared memory (num_stages deep). Measured on an H200, bf16, B*S = 16384, 16 heads
# (benchmarks/results/nvidia-h200/0.1.0/attention/6891cfa/attention_sweep.json): for d = 64 and 128,
# 128x64 tiles with 8 warps and 3 stages are the best or within 3% of the best of eight
# candidates at every S in 1024..8192, causal or not (d128 S8192: 482 TFLOP/s; 4 warps
# with the same tiles: 294). d <= 32 and d = 256 are not swept: 32 takes the same tiles
# with 4 warps (half the registers), 256 halves the query tile to fit registers.
FORWARD_TILES = {
    16: TileConfig(128, 64, 4, 3),
    32: TileConfig(128, 64, 4, 3),
    64: TileConfig(128, 64, 8, 3),
    128: TileConfig(128, 64, 8, 3),
    256: TileConfig(64, 64, 4, 2),
}
# Backward: the dK/dV kernel holds K, V, dK, dV tiles of BLOCK_N rows and streams query
# tiles; the dQ kernel mirrors the forward. Five dot products share the registers, so the
# tiles are smaller: 64x64 with 4 warps was the best of seven at every swept shape (d128
# S8192: 382 TFLOP/s counting 2.5x the forward's FLOPs; 64x128 with 8 warps: 283), 2 stages
# for d128 and 3 for d64 (within 3% of each other).
BACKWARD_TILES = {
    16: TileConfig(64, 64, 4, 3),
    32: TileConfig(64, 64, 4, 3),
    64: TileConfig(64, 64, 4, 3),
    128: TileConfig(64, 64, 4, 2),
    256: TileConfig(32, 64, 4, 1),
}
# A bounded left reach (sliding window) leaves each query tile a short run of key tiles, and
# the rows of a tile reach (window + BLOCK_M) keys for window useful ones: 64-row tiles waste
# half as much as 128-row ones. Causal window 512 at S = 8192, d128 (H200): 64x64 / 4 warps
# 272 TFLOP/s counting the window's pairs, 128x64 / 8 warps 231 (attention_sweep.json).
WINDOW_FORWARD_TILE = TileConfig(64, 64, 4, 3)
# Pipeline depth of the block-sparse backward: mask tiles cut into several kernel tiles (an
# unrolled sub-tile loop inside the list loop) lose to deeper pipelining, whole ones gain.
# Window-512 BlockMask, S=8192, d128, H200 (benchmarks/results/nvidia-h200/0.1.0/attention/
# block-mask-experiment/run3-085bc50-backward-stages.log): 128 x 128 mask tiles 0.95 ms at 1
# stage, 1.28 at 2; 64 x 64 (one kernel tile each) 0.83 ms at 1 stage, 0.75 at 2, 0.77 at 3.
BLOCK_SPARSE_BACKWARD_STAGES = {"whole": 2, "cut": 1}
INTERPRETER_TILE = TileConfig(32, 32, 4, 1)  # the CPU interpreter: small tiles, few wasted rows
# A bounded left reach, no attn_mask, no block mask: the kernels can walk the band as one loop
# and check the band on its edge tiles under a run-time branch (EDGE_AT_RUN_TIME in the
# kernels) instead of three loops. Measured by the window experiment (docs/notes/attention.md; causal
# window 512, S = 8192, d128, bf16, H200): forward 211 against 253 us, backward 682 against 804 us.
# Per direction, so an experiment can time both ways.
ONE_LOOP_WINDOW = {"forward": True, "backward": True}


def why_not(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return f"the Triton kernels take head dims up to {MAX_HEAD_DIM}, got {q.shape[-1]} (q, k) and {v.shape[-1]} (v)"
    return None


def _config(table, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility) -> TileConfig:
    if interpreter_enabled() and q.device.type == "cpu":
        cfg = INTERPRETER_TILE
    else:
        dim = max(_pow2(q.shape[-1]), _pow2(v.shape[-1]))
        cfg = table[dim]
        if table is FORWARD_TILES and vis.left is not None and dim <= 128:
            cfg = WINDOW_FORWARD_TILE
    if vis.block_mask is not None:  # kernel tiles must divide the mask's tiles
        bm = vis.block_mask
        stages = cfg.num_stages
        if table is BACKWARD_TILES:
            whole = bm.block_q <= cfg.block_m and bm.block_k <= cfg.block_n
            stages = BLOCK_SPARSE_BACKWARD_STAGES["whole" if whole else "cut"]
        cfg = TileConfig(min(cfg.block_m, bm.block_q), min(cfg.block_n, bm.block_k), cfg.num_warps, stages)
    return cfg


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _broadcast_strides(t: torch.Tensor, dims) -> tuple:
    """t's strides over `dims`, 0 where the size is 1: a broadcast dim is read in place."""
    return tuple(0 if t.shape[d] == 1 else t.stride(d) for d in dims)


def _mask_args(q: torch.Tensor, vis: Visibility):
    """(tensor, strides (b, h, i, j), kind): kind 0 none, 1 bool, 2 additive."""
    mask = vis.attn_mask
    if mask is None:
        return q, (0, 0, 0, 0), 0
    strides = _broadcast_strides(mask, range(4))
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), strides, 1
    return mask, strides, 2


def _block_args(q: torch.Tensor, vis: Visibility, backward_lists: bool):
    """(counts, full counts, blocks, partial, bits, counts strides (b, h), lists strides (b, h),
    row length, block_q, block_k): the forward's / dQ's per-query-tile lists, or the dK/dV pass's
    per-key-tile lists."""
    bm = vis.block_mask
    if bm is None:
        return (q, q, q, q, q, 0, 0, 0, 0, 1, 16, 16)
    if backward_lists:
        counts, full, blocks, partial = bm.q_counts, bm.q_full, bm.q_blocks, bm.q_partial
    else:
        counts, full, blocks, partial = bm.kv_counts, bm.kv_full, bm.kv_blocks, bm.kv_partial
    return (counts, full, blocks, partial, bm.partial_masks, *_broadcast_strides(counts, (0, 1)),
            *_broadcast_strides(blocks, (0, 1)), blocks.shape[-1],
            bm.block_q, bm.block_k)


def _band(vis: Visibility):
    return (vis.left if vis.left is not None else 0, vis.right if vis.right is not None else 0,
            vis.left is not None, vis.right is not None)


def _one_loop(vis: Visibility, mask_kind: int, direction: str) -> bool:
    return ONE_LOOP_WINDOW[direction] and vis.left is not None and mask_kind == 0 and vis.block_mask is None


def _precision(q: torch.Tensor) -> str:
    # float32 inputs keep full float32 products (tf32 would cost ~1e-3 relative error)
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility):
    """attention_gluon where its forward may run these inputs (a sliding window or a BlockMask on
    Hopper, not a decode; everything but the data pointers' alignment checked), else None."""
    if not q.is_cuda or (vis.left is None and vis.block_mask is None) or vis.seqlens is not None:
        return None
    gluon = gluon_module("attention_gluon")
    if gluon is None or not gluon.may_take(q, k, v, vis, device_capability(q.device)):
        return None
    return None if attention_decode.takes(q, k, vis) else gluon


def _gluon_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility):
    """attention_gluon_backward where it may run these inputs (as _gluon_forward), else None."""
    if not q.is_cuda:
        return None
    gluon = gluon_module("attention_gluon_backward")
    if gluon is None or not gluon.may_take(q, k, v, vis, device_capability(q.device)):
        return None
    return gluon


def traceable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility, backward: bool = False) -> bool:
    """Whether flash_forward (flash_backward) on these inputs launches only plain @triton.jit
    kernels through launch, which torch.compile traces (module docstring)."""
    return (_gluon_backward if backward else _gluon_forward)(q, k, v, vis) is None


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, vis: Visibility):
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    if attention_decode.takes(q, k, vis):  # a few queries, a long (or paged) cache: split the keys
        return attention_decode.decode_forward(q, k, v, scale, vis, _mask_args(q, vis), _band(vis), _precision(q),
                                               _pow2, LOG2E)
    k, v, vis = unpage(k, v, vis)  # a paged call the decode kernel does not take: a contiguous copy
    gluon = _gluon_forward(q, k, v, vis)  # a sliding window or a BlockMask on Hopper (attention_gluon.py)
    if gluon is not None and gluon.tma_ready(q, k, v):
        with on_device(q):
            return gluon.forward(q, k, v, scale, vis)
    B, H, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    out = torch.empty(B, H, Sq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    cfg = _config(FORWARD_TILES, q, k, v, vis)
    mask, mstr, mask_kind = _mask_args(q, vis)
    counts, full, blocks, partial, bits, scb, sch, sbb, sbh, nkb, mb_q, mb_k = _block_args(q, vis, False)
    left, right, has_left, has_right = _band(vis)
    grid = (cdiv(Sq, cfg.block_m), B * H)
    with on_device(q):
        launch(
            flash_forward_kernel, grid,
            q, k, v, out, lse, mask, counts, full, blocks, partial, bits, q if vis.seqlens is None else vis.seqlens,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
            *mstr, scb, sch, sbb, sbh,
            H, H // Hkv, Sq, Sk, Sk - Sq, left, right, scale * LOG2E, nkb,
            HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=_pow2(D), BLOCK_DV=_pow2(Dv),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_LEFT=has_left, HAS_RIGHT=has_right,
            HAS_BAND=has_left or has_right or vis.seqlens is not None, MASK_KIND=mask_kind,
            BLOCK_SPARSE=vis.block_mask is not None, MB_Q=mb_q, MB_K=mb_k, PRECISION=_precision(q),
            ONE_LOOP=_one_loop(vis, mask_kind, "forward"), HAS_SEQLENS=vis.seqlens is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out, lse


def flash_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, scale: float, vis: Visibility):
    q, k, v, out, grad_out = (_unit_last(t) for t in (q, k, v, out, grad_out))
    lse = lse.contiguous()
    B, H, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    delta = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    gluon = _gluon_backward(q, k, v, vis)  # Hopper: attention_gluon_backward.py
    if gluon is not None and not gluon.takes(grad_out, q, k, v, vis, device_capability(q.device)):
        gluon = None
    with on_device(q):
        if gluon is None or not gluon.FUSE_DELTA:
            delta_rows = 64
            launch(
                backward_delta_kernel, (cdiv(Sq, delta_rows), B * H),
                out, grad_out, delta, *out.stride()[:3], *grad_out.stride()[:3], H, Sq,
                HEAD_DIM_V=Dv, BLOCK_M=delta_rows, BLOCK_DV=_pow2(Dv))
        if gluon is not None:
            return gluon.backward(grad_out, q, k, v, out, lse, delta, scale, vis)
    cfg = _config(BACKWARD_TILES, q, k, v, vis)
    mask, mstr, mask_kind = _mask_args(q, vis)
    left, right, has_left, has_right = _band(vis)
    dq = torch.empty(B, H, Sq, D, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, Hkv, Sk, D, dtype=k.dtype, device=k.device)
    dv = torch.empty(B, Hkv, Sk, Dv, dtype=v.dtype, device=v.device)
    common = dict(HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=_pow2(D), BLOCK_DV=_pow2(Dv),
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_LEFT=has_left, HAS_RIGHT=has_right,
                  HAS_BAND=has_left or has_right, MASK_KIND=mask_kind, BLOCK_SPARSE=vis.block_mask is not None,
                  PRECISION=_precision(q), ONE_LOOP=_one_loop(vis, mask_kind, "backward"),
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    with on_device(q):
        counts, full, blocks, partial, bits, scb, sch, sbb, sbh, nqb, mb_q, mb_k = _block_args(q, vis, True)
        launch(
            flash_backward_dkdv_kernel, (cdiv(Sk, cfg.block_n), B * Hkv),
            q, k, v, grad_out, lse, delta, dk, dv, mask, counts, full, blocks, partial, bits,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3],
            *dk.stride()[:3], *dv.stride()[:3], *mstr, scb, sch, sbb, sbh,
            H, Hkv, H // Hkv, Sq, Sk, Sk - Sq, left, right, scale * LOG2E, scale, nqb,
            MB_Q=mb_q, MB_K=mb_k, **common)
        counts, full, blocks, partial, bits, scb, sch, sbb, sbh, nkb, mb_q, mb_k = _block_args(q, vis, False)
        launch(
            flash_backward_dq_kernel, (cdiv(Sq, cfg.block_m), B * H),
            q, k, v, grad_out, lse, delta, dq, mask, counts, full, blocks, partial, bits,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3], *dq.stride()[:3],
            *mstr, scb, sch, sbb, sbh,
            H, H // Hkv, Sq, Sk, Sk - Sq, left, right, scale * LOG2E, scale, nkb,
            MB_Q=mb_q, MB_K=mb_k, **common)
    return dq, dk, dv
