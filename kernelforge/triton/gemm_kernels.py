"""Triton GEMM with a fused epilogue: out = act(a @ b + bias) + residual, batched.

Work per (batch) matrix: 2*M*N*K FLOPs. Bytes: a and b once each from HBM when the tiles
that share them run close together in time (the grouped order below keeps GROUP_M rows of
tiles on the same columns of b, so b's panels stay in L2), c written once; with the
epilogue, + the bias (N), + the residual read (M*N), + preact written (M*N) when the
backward needs it. Compute bound from a few hundred in every dim up (H100/H200 ridge:
~250-300 FLOP/byte at bf16).

Persistent: a grid of about one program per SM (times a few) walks the tiles of every
batch in a grid-stride loop, so short tails and many small batches do not pay a launch
per tile and the next tile's loads start while the last one finishes.

Operands are read through their strides (transposed or sliced views need no copy; Triton
specializes a unit stride, so the common layouts load in 16-byte vectors), converted in
registers to the compute dtype (COMPUTE: fp16 / bf16 operands of fp32 inputs are rounded
there, not in a separate pass) and multiplied with tl.dot at PRECISION ("ieee" for fp32,
"tf32", or the 16-bit tensor-core path), accumulating in float32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernelforge.triton.activations import _activation


@triton.jit
def _tile_coordinates(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(batch, tile row, tile column) of a linear tile index: within a batch, GROUP_M tile
    rows are walked column by column, so consecutive programs share b's column panel."""
    per_batch = tiles_m * tiles_n
    batch = tile // per_batch
    t = tile % per_batch
    per_group = GROUP_M * tiles_n
    first_m = (t // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % rows_in_group
    pid_n = (t % per_group) // rows_in_group
    return batch, pid_m, pid_n


@triton.jit
def _operand(x, COMPUTE: tl.constexpr):
    """x in the multiply's dtype (a register conversion; the tensor cores round nothing else)."""
    if COMPUTE == "fp16":
        return x.to(tl.float16)
    elif COMPUTE == "bf16":
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def gemm_kernel(
    A, B, C, BIAS, RES, PRE,
    M, N, K,
    sab, sam, sak, sbb, sbk, sbn, scb, scm, scn, srb, srm, srn, spb, spm, spn,
    BATCH, M_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SAVE_PREACT: tl.constexpr,
    PRECISE: tl.constexpr,
):
    # M_BUCKET (M rounded up to a power of two) is only the autotuner's key: one tuning per
    # bucket, not one per distinct token count.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = BATCH * tiles_m * tiles_n
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        batch, pid_m, pid_n = _tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows / columns past the edge read row 0 / column 0 instead of masking every load:
        # their results are never stored, and the loads stay unmasked along M and N.
        rows = tl.where(offs_m < M, offs_m, 0)
        cols = tl.where(offs_n < N, offs_n, 0)
        a_ptrs = A + batch.to(tl.int64) * sab + rows[:, None].to(tl.int64) * sam + offs_k[None, :] * sak
        b_ptrs = B + batch.to(tl.int64) * sbb + offs_k[:, None] * sbk + cols[None, :].to(tl.int64) * sbn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
            acc = tl.dot(_operand(a, COMPUTE), _operand(b, COMPUTE), acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * sak
            b_ptrs += BLOCK_K * sbk
        inside = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if SAVE_PREACT:
            tl.store(PRE + batch.to(tl.int64) * spb + offs_m[:, None].to(tl.int64) * spm + offs_n[None, :] * spn,
                     acc.to(PRE.dtype.element_ty), mask=inside)
        z = acc
        if HAS_BIAS:
            z += tl.load(BIAS + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if ACTIVATION != "none":
            z = _activation(z, ACTIVATION, PRECISE)
        if HAS_RESIDUAL:
            z += tl.load(RES + batch.to(tl.int64) * srb + offs_m[:, None].to(tl.int64) * srm + offs_n[None, :] * srn,
                         mask=inside, other=0.0).to(tl.float32)
        tl.store(C + batch.to(tl.int64) * scb + offs_m[:, None].to(tl.int64) * scm + offs_n[None, :] * scn,
                 z.to(C.dtype.element_ty), mask=inside)
