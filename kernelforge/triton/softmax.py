"""Triton softmax / log-softmax kernels and their launchers, over (rows, n) row views.

Two forward paths, chosen by row length n:
  fused  (n <= FUSED_MAX_COLS): a tile of BLOCK_M rows is loaded once, reduced, written.
         Bytes: read n + write n elements per row, the minimum. One tile per program: a
         persistent grid-stride variant (with and without software pipelining) measured
         no faster on an H200 (benchmarks/tuning/softmax_sweep.py), so the simpler form stays.
  online (longer rows): one program per row walks the row in BLOCK_N chunks keeping a
         running max and a rescaled running sum (one read gives both), then a second
         walk re-reads x and writes y. Bytes: read 2n + write n from DRAM at worst; the
         first walk asks L2 to keep the row (evict_last) and the output streams past it,
         so that the second read is served by L2 as often as the rows in flight fit.
Backward likewise: fused reads y and dy once; the long-row path reads them twice.
FLOPs are a handful per element (sub, exp2, add, mul); exp2 runs on the SFU, one per
element per pass, well under the memory time on H100/H200.

Every kernel accumulates in float32 whatever the storage dtype and rounds once on store.
Launchers run on the current CUDA stream of the input's device (Triton's launcher asks
torch for it), and on CPU tensors under TRITON_INTERPRET=1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernelforge.triton import interpreter_enabled
from kernelforge.triton._launch import cdiv, launch, next_power_of_2, on_device, warps_for

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * log2(e)): exp2 is the SFU's native op
LN2 = tl.constexpr(0.6931471805599453)

# Longest row kept whole in registers: 32768 fp32 values over 32 warps is 32 registers a
# thread; beyond that the compiler spills (checked with cuobjdump --dump-resource-usage on
# sm_90 cubins), so longer rows take the online path. Backward holds two rows (dy and y),
# so its limit is half.
FUSED_MAX_COLS = 32768
FUSED_MAX_COLS_BACKWARD = 16384
# Elements one program of the fused kernel holds (BLOCK_M rows x BLOCK_N columns) when
# rows are short: several rows per program amortize the per-program reductions.
ROW_TILE_ELEMS = 4096
# Chunk of the long-row kernels and its warps (32 elements a thread): best or within 1% of
# best for 65536 and 262144 columns, bf16 and fp32, in the H200 sweep.
ONLINE_BLOCK_N = 16384
ONLINE_NUM_WARPS = 16


# ----------------------------------------------------------------------------- kernels
# exp2 / log2 (MUFU, ~2 ulp) are right wherever a result is rounded at the output's scale.
# log_softmax's gradient multiplies exp(y) by sum(dy), which can be hundreds, so an error
# in y (from the forward's log of the row sum) or in exp(y) is amplified: those two take
# libdevice's exp and log (torch's accuracy; one log per row, one exp per element of a
# memory-bound kernel). The interpreter has no libdevice, hence PRECISE is off there.
@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp2(x * LOG2E)


@triton.jit
def natural_log(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.log(x)
    else:
        return tl.log2(x) * LN2


@triton.jit
def _softmax_fwd_fused_kernel(
    x_ptr, y_ptr, n_rows, n_cols, x_row_stride, y_row_stride,
    LOG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISE: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_N)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask,
                other=-float("inf")).to(tl.float32)
    # Rows past n_rows are all -inf: shift them by 0 so they make no NaNs (never stored).
    row_max = tl.where(rows < n_rows, tl.max(x, axis=1), 0.0)
    shifted = x - row_max[:, None]
    e = tl.exp2(shifted * LOG2E)
    denom = tl.sum(e, axis=1)
    if LOG:
        y = shifted - natural_log(denom, PRECISE)[:, None]
    else:
        y = e * (1.0 / denom)[:, None]
    tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_fwd_online_kernel(
    x_ptr, y_ptr, n_cols, x_row_stride, y_row_stride,
    LOG: tl.constexpr, BLOCK_N: tl.constexpr, PRECISE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    y_row = y_ptr + row * y_row_stride
    cols = tl.arange(0, BLOCK_N)
    # Pass 1: running max m and sum s of exp(x - m), rescaled whenever m grows.
    m = tl.max(tl.full((BLOCK_N,), float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros((BLOCK_N,), tl.float32), axis=0)
    for start in range(0, n_cols, BLOCK_N):
        x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=-float("inf"),
                    eviction_policy="evict_last").to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # While every value so far is -inf, shift by 0 so exp2 sees -inf, not -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp2((m - m_safe) * LOG2E) + tl.sum(tl.exp2((x - m_safe) * LOG2E), axis=0)
        m = m_new
    # Pass 2: normalize. An all -inf row gives NaN, as torch.softmax does.
    inv_s = 1.0 / s
    log_s = natural_log(s, PRECISE)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if LOG:
            y = x - m - log_s
        else:
            y = tl.exp2((x - m) * LOG2E) * inv_s
        tl.store(y_row + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask, cache_modifier=".cs")


@triton.jit
def _softmax_bwd_fused_kernel(
    g_ptr, y_ptr, dx_ptr, n_rows, n_cols, g_row_stride, y_row_stride, dx_row_stride,
    LOG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISE: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_N)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    g = tl.load(g_ptr + rows[:, None] * g_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + rows[:, None] * y_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if LOG:  # dx = dy - exp(y) * sum(dy)
        dx = g - _exp(y, PRECISE) * tl.sum(g, axis=1)[:, None]
    else:  # dx = y * (dy - sum(dy * y))
        dx = y * (g - tl.sum(g * y, axis=1)[:, None])
    tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_two_pass_kernel(
    g_ptr, y_ptr, dx_ptr, n_cols, g_row_stride, y_row_stride, dx_row_stride,
    LOG: tl.constexpr, BLOCK_N: tl.constexpr, PRECISE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g_row = g_ptr + row * g_row_stride
    y_row = y_ptr + row * y_row_stride
    dx_row = dx_ptr + row * dx_row_stride
    cols = tl.arange(0, BLOCK_N)
    # Pass 1: the row's dot product (softmax) or sum (log_softmax), lane-wise then reduced once.
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        g = tl.load(g_row + start + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if LOG:
            acc += g
        else:
            acc += g * tl.load(y_row + start + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    total = tl.sum(acc, axis=0)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        g = tl.load(g_row + start + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        y = tl.load(y_row + start + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if LOG:
            dx = g - _exp(y, PRECISE) * total
        else:
            dx = y * (g - total)
        tl.store(dx_row + start + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask, cache_modifier=".cs")


# ----------------------------------------------------------------------------- launch configs
@dataclass(frozen=True)
class RowConfig:
    """How one launch is shaped: the fused kernels take BLOCK_M x BLOCK_N tiles (one per
    program); the long-row kernels walk rows in BLOCK_N chunks."""

    fused: bool
    block_m: int
    block_n: int
    num_warps: int


def default_config(n_rows: int, n_cols: int, backward: bool = False) -> RowConfig:
    if n_cols <= (FUSED_MAX_COLS_BACKWARD if backward else FUSED_MAX_COLS):
        block_n = next_power_of_2(n_cols)
        block_m = max(1, min(ROW_TILE_ELEMS // block_n, next_power_of_2(n_rows)))
        return RowConfig(True, block_m, block_n, warps_for(block_m * block_n))
    return RowConfig(False, 1, ONLINE_BLOCK_N, ONLINE_NUM_WARPS)


# ----------------------------------------------------------------------------- launchers
def softmax_forward_rows(x2d: torch.Tensor, log: bool, config: Optional[RowConfig] = None) -> torch.Tensor:
    """(log-)softmax of each row of x2d (unit column stride) into a new dense tensor."""
    n_rows, n_cols = x2d.shape
    y = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
    if y.numel() == 0:
        return y
    cfg = config or default_config(n_rows, n_cols)
    precise = log and not interpreter_enabled()
    with on_device(x2d):
        if cfg.fused:
            launch(
                _softmax_fwd_fused_kernel, (cdiv(n_rows, cfg.block_m),),
                x2d, y, n_rows, n_cols, x2d.stride(0), y.stride(0),
                LOG=log, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PRECISE=precise, num_warps=cfg.num_warps,
            )
        else:
            launch(
                _softmax_fwd_online_kernel, (n_rows,),
                x2d, y, n_cols, x2d.stride(0), y.stride(0),
                LOG=log, BLOCK_N=cfg.block_n, PRECISE=precise, num_warps=cfg.num_warps,
            )
    return y


def softmax_backward_rows(
    grad2d: torch.Tensor, out2d: torch.Tensor, log: bool, config: Optional[RowConfig] = None
) -> torch.Tensor:
    """Input gradient of (log-)softmax per row, from dy and the forward output y."""
    n_rows, n_cols = out2d.shape
    dx = torch.empty((n_rows, n_cols), dtype=out2d.dtype, device=out2d.device)
    if dx.numel() == 0:
        return dx
    cfg = config or default_config(n_rows, n_cols, backward=True)
    precise = log and not interpreter_enabled()
    with on_device(out2d):
        if cfg.fused:
            launch(
                _softmax_bwd_fused_kernel, (cdiv(n_rows, cfg.block_m),),
                grad2d, out2d, dx, n_rows, n_cols, grad2d.stride(0), out2d.stride(0), dx.stride(0),
                LOG=log, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PRECISE=precise,
                num_warps=cfg.num_warps,
            )
        else:
            launch(
                _softmax_bwd_two_pass_kernel, (n_rows,),
                grad2d, out2d, dx, n_cols, grad2d.stride(0), out2d.stride(0), dx.stride(0),
                LOG=log, BLOCK_N=cfg.block_n, PRECISE=precise, num_warps=cfg.num_warps,
            )
    return dx
