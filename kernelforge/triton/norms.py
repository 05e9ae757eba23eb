"""Triton layer-norm / RMS-norm kernels (with optional residual add) and their launchers.

One kernel family serves both norms: constexpr flags pick RMS vs layer norm, residual,
weight and bias, so there is one copy of each kernel and no per-dtype variants. Math
is in float32 whatever the storage dtype; each output is rounded once on store. E is the
element size of x; n the row length; rows R.

Forward, chosen by n:
  fused (n <= FUSED_MAX_COLS): a BLOCK_M x BLOCK_N tile of rows in registers; statistics
      in two register passes (mean, then the sum of squared deviations: no cancellation).
      Bytes: R*n*E read + R*n*E written (+ R*n*E read and written for the residual
      variant), + 4-8 bytes of statistics a row; weight/bias once per program.
      FLOPs: ~8 per element, negligible against the memory time.
  two-pass (longer rows): one program per row walks it in chunks, merging per-chunk mean
      and squared deviations (Chan et al.), then re-reads the row to normalize it. The
      first walk asks L2 to keep the row, so the re-read is usually served from L2;
      from DRAM at worst 2*R*n*E read.
Backward (dh = rstd * (g - mean(g) - xhat * mean(g*xhat)), g = dy * w; RMS drops mean(g)):
  fused (n <= FUSED_MAX_COLS_BACKWARD): a persistent grid of about 4 programs per SM, each
      walking a contiguous range of row tiles; it reads dy and h once, writes dh, and keeps
      the weight/bias gradient partials of its rows in registers, stored once as a
      (programs, n) float32 buffer that partial_sums.sum_partials sums in a fixed order (no atomics).
      Bytes: 2*R*n*E read + R*n*E written + 2 * programs*n*4 for the partials.
  chunked (longer rows): a row-dots kernel reads dy and h to get mean(g) and mean(g*xhat)
      per row; then a 2-D grid of (column chunk, row group) programs re-reads dy and h,
      writes dh and accumulates the partials of its chunk. Bytes: 4*R*n*E read + R*n*E
      written at worst (the price of rows longer than registers hold).
The launchers only allocate outputs and partial buffers and launch plain @triton.jit kernels
through kernelforge.triton._launch.launch: torch.compile traces them (kernelforge.ops._opdef),
and Inductor launches the kernels itself. Keep them so (no data_ptr, .item(), in-place writes
to inputs or host syncs), else register the backend non-traceable.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kernelforge.triton._launch import cdiv, launch, next_power_of_2, on_device, sm_count, warps_for
from kernelforge.triton.partial_sums import sum_partials

# Longest row one program holds in registers: as for softmax, 32768 float32 values over 32
# warps; backward holds dy and h, so half.
FUSED_MAX_COLS = 32768
FUSED_MAX_COLS_BACKWARD = 16384
# Layer norm's fused backward also keeps a bias-gradient accumulator: at 16384 columns its
# four row-wide float32 arrays spilled (H100: 2.9 ms against the chunked path's ~0.5 ms at
# 8192x16384), so its rows past 8192 take the chunked path.
FUSED_MAX_COLS_BACKWARD_LAYER_NORM = 8192
ROW_TILE_ELEMS = 4096  # elements of one fused tile when rows are short (several rows a program)
CHUNK_COLS = 8192  # chunk of the long-row forward and row-dots kernels
CHUNK_WARPS = 16
BACKWARD_TILE = (4, 1024)  # rows x columns of the long-row backward's 2-D grid programs
PROGRAMS_PER_SM = 4  # persistent backward grids: enough programs in flight to hide latency


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _rstd(sum_sq, n_cols, eps):
    # IEEE sqrt and division (not the ~2-ulp rsqrt): one per row, free, and float32 results
    # then carry no more error than torch's.
    return 1.0 / tl.sqrt_rn(sum_sq / n_cols + eps)


@triton.jit
def _norm_fwd_fused_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, res_out_ptr, mean_ptr, rstd_ptr,
    n_rows, n_cols, x_row_stride, res_row_stride, eps, offset,
    RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Inductor passes a Python float as fp64 (eager Triton as fp32): float32 math either way
    eps, offset = tl.cast(eps, tl.float32), tl.cast(offset, tl.float32)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    h = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(res_ptr + rows[:, None] * res_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # The new residual is stored in x's dtype and the norm sees exactly what is stored.
        h = h.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows[:, None] * n_cols + cols[None, :], h, mask=mask)
        h = tl.cast(h, tl.float32)
    if RMS:
        rstd = _rstd(tl.sum(h * h, axis=1), n_cols, eps)
        xhat = h * rstd[:, None]
    else:
        mean = tl.sum(h, axis=1) / n_cols
        centered = tl.where(mask, h - mean[:, None], 0.0)
        rstd = _rstd(tl.sum(centered * centered, axis=1), n_cols, eps)
        xhat = centered * rstd[:, None]
        tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    y = xhat
    if HAS_WEIGHT:
        y *= tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :] + offset
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * n_cols + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_fwd_two_pass_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, res_out_ptr, mean_ptr, rstd_ptr,
    n_cols, x_row_stride, res_row_stride, eps, offset,
    RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Inductor passes a Python float as fp64 (eager Triton as fp32): float32 math either way
    eps, offset = tl.cast(eps, tl.float32), tl.cast(offset, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    # Pass 1: statistics. Layer norm merges each chunk's exact mean and squared deviations
    # into the running ones (Chan et al.): one read, no sum-of-squares cancellation.
    count = 0.0
    mean = 0.0
    sq = 0.0  # RMS: sum of squares; layer norm: sum of squared deviations from the mean
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        h = tl.load(x_ptr + row * x_row_stride + start + cols, mask=mask, other=0.0,
                    eviction_policy="evict_last").to(tl.float32)
        if HAS_RESIDUAL:
            h += tl.load(res_ptr + row * res_row_stride + start + cols, mask=mask, other=0.0).to(tl.float32)
            h = h.to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * n_cols + start + cols, h, mask=mask, eviction_policy="evict_last")
            h = tl.cast(h, tl.float32)
        if RMS:
            sq += tl.sum(h * h, axis=0)
        else:
            chunk_count = tl.minimum(n_cols - start, BLOCK_N).to(tl.float32)
            chunk_mean = tl.sum(h, axis=0) / chunk_count
            d = tl.where(mask, h - chunk_mean, 0.0)
            delta = chunk_mean - mean
            total = count + chunk_count
            mean += delta * (chunk_count / total)
            sq += tl.sum(d * d, axis=0) + delta * delta * (count * chunk_count / total)
            count = total
    rstd = _rstd(sq, n_cols, eps)
    tl.store(rstd_ptr + row, rstd)
    if not RMS:
        tl.store(mean_ptr + row, mean)
    # Pass 2: normalize, re-reading h (the stored residual when there is one).
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        if HAS_RESIDUAL:
            h = tl.load(res_out_ptr + row * n_cols + start + cols, mask=mask, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
        else:
            h = tl.load(x_ptr + row * x_row_stride + start + cols, mask=mask, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
        y = h * rstd if RMS else (h - mean) * rstd
        if HAS_WEIGHT:
            y *= tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32) + offset
        if HAS_BIAS:
            y += tl.load(b_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n_cols + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask, cache_modifier=".cs")


@triton.jit
def _load_tile_for_backward(
    dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, rows, cols, row_mask, col_mask,
    dy_row_stride, h_row_stride, offset, RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr,
):
    """A tile's dy, normalized input xhat (0 outside the tile's mask), g = dy * w, and rstd."""
    mask = row_mask[:, None] & col_mask[None, :]
    dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + rows[:, None] * h_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    if RMS:
        xhat = h * rstd[:, None]
    else:
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
    g = dy
    if HAS_WEIGHT:
        g = dy * (tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :] + offset)
    return dy, xhat, g, rstd


@triton.jit
def _store_grad_h(dh_ptr, dres_ptr, dh, rows, cols, row_mask, col_mask, n_cols, dres_row_stride,
                  HAS_DRES: tl.constexpr):
    mask = row_mask[:, None] & col_mask[None, :]
    if HAS_DRES:  # the gradient reaching residual_out joins the one through the norm
        dh += tl.load(dres_ptr + rows[:, None] * dres_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(dh_ptr + rows[:, None] * n_cols + cols[None, :], dh.to(dh_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _accumulate_param_grads(dw_acc, db_acc, dy, xhat, WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr):
    """Add a tile's weight (dy * xhat) and bias (dy) gradient column sums to a program's partials."""
    if WEIGHT_GRAD:
        dw_acc += tl.sum(dy * xhat, axis=0)
    if BIAS_GRAD:
        db_acc += tl.sum(dy, axis=0)
    return dw_acc, db_acc


@triton.jit
def _store_param_partials(dw_part_ptr, db_part_ptr, partial_row, cols, col_mask, n_cols, dw_acc, db_acc,
                          WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr):
    """A program's partials into row `partial_row` of the (programs, n) float32 buffers."""
    if WEIGHT_GRAD:
        tl.store(dw_part_ptr + partial_row * n_cols + cols, dw_acc, mask=col_mask)
    if BIAS_GRAD:
        tl.store(db_part_ptr + partial_row * n_cols + cols, db_acc, mask=col_mask)


@triton.jit
def _norm_bwd_fused_kernel(
    dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, dres_ptr, dh_ptr, dw_part_ptr, db_part_ptr,
    n_rows, n_cols, dy_row_stride, h_row_stride, dres_row_stride, offset, tiles_per_program,
    RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DRES: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Inductor passes a Python float as fp64 (eager Triton as fp32): float32 math either way
    offset = tl.cast(offset, tl.float32)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    dw_acc = tl.zeros((BLOCK_N,), tl.float32)
    db_acc = tl.zeros((BLOCK_N,), tl.float32)
    for t in range(tiles_per_program):  # a contiguous range of row tiles per program
        rows = (pid * tiles_per_program + t).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        dy, xhat, g, rstd = _load_tile_for_backward(
            dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, rows, cols, row_mask, col_mask,
            dy_row_stride, h_row_stride, offset, RMS, HAS_WEIGHT)
        dh = g - xhat * (tl.sum(g * xhat, axis=1) / n_cols)[:, None]
        if not RMS:
            dh -= (tl.sum(g, axis=1) / n_cols)[:, None]
        _store_grad_h(dh_ptr, dres_ptr, dh * rstd[:, None], rows, cols, row_mask, col_mask, n_cols,
                      dres_row_stride, HAS_DRES)
        dw_acc, db_acc = _accumulate_param_grads(dw_acc, db_acc, dy, xhat, WEIGHT_GRAD, BIAS_GRAD)
    _store_param_partials(dw_part_ptr, db_part_ptr, pid, cols, col_mask, n_cols, dw_acc, db_acc, WEIGHT_GRAD, BIAS_GRAD)


@triton.jit
def _norm_bwd_row_dots_kernel(
    dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, dots_ptr, n_cols, dy_row_stride, h_row_stride, offset,
    RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Long rows, step 1: mean(g * xhat) and mean(g) of each row into dots (rows, 2)."""
    # Inductor passes a Python float as fp64 (eager Triton as fp32): float32 math either way
    offset = tl.cast(offset, tl.float32)
    row = tl.program_id(0).to(tl.int64) + tl.zeros((1,), tl.int64)
    row_mask = row >= 0
    cols = tl.arange(0, BLOCK_N)
    g_xhat_acc = tl.zeros((1, BLOCK_N), tl.float32)
    g_acc = tl.zeros((1, BLOCK_N), tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        dy, xhat, g, rstd = _load_tile_for_backward(
            dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, row, start + cols, row_mask, start + cols < n_cols,
            dy_row_stride, h_row_stride, offset, RMS, HAS_WEIGHT)
        g_xhat_acc += g * xhat
        g_acc += g
    tl.store(dots_ptr + 2 * row, tl.sum(g_xhat_acc, axis=1) / n_cols)
    tl.store(dots_ptr + 2 * row + 1, tl.sum(g_acc, axis=1) / n_cols)


@triton.jit
def _norm_bwd_chunked_kernel(
    dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, dots_ptr, dres_ptr, dh_ptr, dw_part_ptr, db_part_ptr,
    n_rows, n_cols, dy_row_stride, h_row_stride, dres_row_stride, offset, rows_per_group,
    RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DRES: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Long rows, step 2: program (chunk, group) writes dh for one column chunk of a group
    of rows and that chunk's weight/bias partials for the group."""
    # Inductor passes a Python float as fp64 (eager Triton as fp32): float32 math either way
    offset = tl.cast(offset, tl.float32)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(1)
    col_mask = cols < n_cols
    dw_acc = tl.zeros((BLOCK_N,), tl.float32)
    db_acc = tl.zeros((BLOCK_N,), tl.float32)
    first_row = group.to(tl.int64) * rows_per_group
    for offset_in_group in range(0, rows_per_group, BLOCK_M):
        rows = first_row + offset_in_group + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        dy, xhat, g, rstd = _load_tile_for_backward(
            dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, rows, cols, row_mask, col_mask,
            dy_row_stride, h_row_stride, offset, RMS, HAS_WEIGHT)
        mean_g_xhat = tl.load(dots_ptr + 2 * rows, mask=row_mask, other=0.0)
        dh = g - xhat * mean_g_xhat[:, None]
        if not RMS:
            dh -= tl.load(dots_ptr + 2 * rows + 1, mask=row_mask, other=0.0)[:, None]
        _store_grad_h(dh_ptr, dres_ptr, dh * rstd[:, None], rows, cols, row_mask, col_mask, n_cols,
                      dres_row_stride, HAS_DRES)
        dw_acc, db_acc = _accumulate_param_grads(dw_acc, db_acc, dy, xhat, WEIGHT_GRAD, BIAS_GRAD)
    _store_param_partials(dw_part_ptr, db_part_ptr, group, cols, col_mask, n_cols, dw_acc, db_acc, WEIGHT_GRAD,
                          BIAS_GRAD)


# ----------------------------------------------------------------------------- launch configs
@dataclass(frozen=True)
class NormConfig:
    """How one launch is shaped: fused kernels take BLOCK_M x BLOCK_N tiles of whole rows;
    the long-row kernels walk BLOCK_N-column chunks."""

    fused: bool
    block_m: int
    block_n: int
    num_warps: int


@functools.lru_cache(maxsize=4096)  # on every launch; a pure function of a few ints
def default_config(n_rows: int, n_cols: int, backward: bool = False, rms: bool = True) -> NormConfig:
    if not backward:
        fused_max = FUSED_MAX_COLS
    else:
        fused_max = FUSED_MAX_COLS_BACKWARD if rms else FUSED_MAX_COLS_BACKWARD_LAYER_NORM
    if n_cols <= fused_max:
        block_n = next_power_of_2(n_cols)
        block_m = max(1, min(ROW_TILE_ELEMS // block_n, next_power_of_2(n_rows)))
        return NormConfig(True, block_m, block_n, warps_for(block_m * block_n))
    if backward:
        block_m, block_n = BACKWARD_TILE
        return NormConfig(False, block_m, block_n, warps_for(block_m * block_n))
    return NormConfig(False, 1, CHUNK_COLS, CHUNK_WARPS)


def _config_sizes(n_rows, n_cols) -> tuple[int, int]:
    """(n_rows, n_cols) as default_config reads them, plain ints. Under torch.compile's dynamic
    shapes the sizes are symbolic (and hash into no lru_cache). A config depends on n_rows only
    through min(next_power_of_2(n_rows), ROW_TILE_ELEMS // block_n), found here by comparisons:
    guards on that bucket, not on n_rows. n_cols fixes the tile width, a constexpr: specialized."""
    n_cols = n_cols if type(n_cols) is int else int(n_cols)
    if type(n_rows) is not int:
        cap = ROW_TILE_ELEMS // next_power_of_2(n_cols)
        bucket = 1
        while bucket < cap and bucket < n_rows:
            bucket *= 2
        n_rows = bucket
    return n_rows, n_cols


# ----------------------------------------------------------------------------- launchers
def _or(t: Optional[torch.Tensor], stand_in: torch.Tensor) -> torch.Tensor:
    # Absent operands are switched off by a constexpr flag; the kernel still wants a pointer.
    return stand_in if t is None else t


def norm_forward_rows(x2d, residual2d, weight, bias, eps: float, rms: bool, offset: float,
                      config: Optional[NormConfig] = None):
    """(y, residual_out or None, mean or None, rstd) for rows of x2d (unit column stride);
    the launcher contract of kernelforge.reference.norms."""
    n_rows, n_cols = x2d.shape
    if n_rows == 0 or n_cols == 0:
        from kernelforge.reference.norms import norm_forward_rows as reference

        return reference(x2d, residual2d, weight, bias, eps, rms, offset)
    device = x2d.device
    y = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=device)
    residual_out = None if residual2d is None else torch.empty_like(y)
    mean = None if rms else torch.empty(n_rows, dtype=torch.float32, device=device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=device)
    cfg = config or default_config(*_config_sizes(n_rows, n_cols))
    operands = (x2d, _or(residual2d, x2d), _or(weight, x2d), _or(bias, x2d), y, _or(residual_out, y),
                _or(mean, rstd), rstd)
    flags = dict(RMS=rms, HAS_RESIDUAL=residual2d is not None, HAS_WEIGHT=weight is not None,
                 HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
    res_row_stride = 0 if residual2d is None else residual2d.stride(0)
    with on_device(x2d):
        if cfg.fused:
            launch(
                _norm_fwd_fused_kernel, (cdiv(n_rows, cfg.block_m),),
                *operands, n_rows, n_cols, x2d.stride(0), res_row_stride, eps, offset,
                BLOCK_M=cfg.block_m, **flags)
        else:
            launch(
                _norm_fwd_two_pass_kernel, (n_rows,),
                *operands, n_cols, x2d.stride(0), res_row_stride, eps, offset, **flags)
    return y, residual_out, mean, rstd


def norm_backward_rows(grad_y2d, grad_residual2d, h2d, weight, bias_dtype: Optional[torch.dtype], mean, rstd,
                       rms: bool, offset: float, need_weight_grad: bool, config: Optional[NormConfig] = None):
    """(grad_h, grad_weight or None, grad_bias or None); the launcher contract of
    kernelforge.reference.norms. Weight and bias gradients: per-program float32 partials
    summed by partial_sums.sum_partials (deterministic: no atomics anywhere)."""
    n_rows, n_cols = h2d.shape
    if n_rows == 0 or n_cols == 0:
        from kernelforge.reference.norms import norm_backward_rows as reference

        return reference(grad_y2d, grad_residual2d, h2d, weight, bias_dtype, mean, rstd, rms, offset,
                         need_weight_grad)
    device = h2d.device
    dh = torch.empty((n_rows, n_cols), dtype=h2d.dtype, device=device)
    weight_grad = need_weight_grad and weight is not None
    bias_grad = need_weight_grad and bias_dtype is not None
    cfg = config or default_config(*_config_sizes(n_rows, n_cols), backward=True, rms=rms)
    target_programs = PROGRAMS_PER_SM * sm_count(device)
    if cfg.fused:
        n_tiles = cdiv(n_rows, cfg.block_m)
        tiles_per_program = cdiv(n_tiles, min(n_tiles, target_programs))
        programs = cdiv(n_tiles, tiles_per_program)
    else:
        chunks = cdiv(n_cols, cfg.block_n)
        groups = max(1, min(cdiv(target_programs, chunks), cdiv(n_rows, cfg.block_m)))
        rows_per_group = cdiv(cdiv(n_rows, groups), cfg.block_m) * cfg.block_m
        programs = cdiv(n_rows, rows_per_group)
    partial = lambda wanted: (torch.empty((programs, n_cols), dtype=torch.float32, device=device)  # noqa: E731
                              if wanted else rstd)
    dw_part, db_part = partial(weight_grad), partial(bias_grad)
    loads = (grad_y2d, h2d, _or(weight, h2d), _or(mean, rstd), rstd)
    strides = (grad_y2d.stride(0), h2d.stride(0))
    dres_row_stride = 0 if grad_residual2d is None else grad_residual2d.stride(0)
    flags = dict(RMS=rms, HAS_WEIGHT=weight is not None, HAS_DRES=grad_residual2d is not None,
                 WEIGHT_GRAD=weight_grad, BIAS_GRAD=bias_grad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                 num_warps=cfg.num_warps)
    with on_device(h2d):
        if cfg.fused:
            launch(
                _norm_bwd_fused_kernel, (programs,),
                *loads, _or(grad_residual2d, dh), dh, dw_part, db_part, n_rows, n_cols, *strides,
                dres_row_stride, offset, tiles_per_program, **flags)
        else:
            dots = torch.empty((n_rows, 2), dtype=torch.float32, device=device)
            launch(
                _norm_bwd_row_dots_kernel, (n_rows,),
                *loads, dots, n_cols, *strides, offset, RMS=rms, HAS_WEIGHT=weight is not None,
                BLOCK_N=CHUNK_COLS, num_warps=CHUNK_WARPS)
            launch(
                _norm_bwd_chunked_kernel, (cdiv(n_cols, cfg.block_n), programs),
                *loads, dots, _or(grad_residual2d, dh), dh, dw_part, db_part, n_rows, n_cols, *strides,
                dres_row_stride, offset, rows_per_group, **flags)
    grad_weight = torch.empty(n_cols, dtype=weight.dtype, device=device) if weight_grad else None
    grad_bias = torch.empty(n_cols, dtype=bias_dtype, device=device) if bias_grad else None
    wanted = [(part, out) for part, out in ((dw_part, grad_weight), (db_part, grad_bias)) if out is not None]
    if wanted:
        with on_device(h2d):
            sum_partials(*wanted[0], *(wanted[1] if len(wanted) > 1 else ()))
    return dh, grad_weight, grad_bias
