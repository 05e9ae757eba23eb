"""Triton cross-entropy kernels and their launchers, over (rows, classes) logits.

Forward, one program a row: one walk over the row's logits keeps a running max and a rescaled
running sum of exponentials (and the row's sum for label smoothing), then reads the target's
logit. Bytes: the logits once (rows * C * elt), 16 bytes a row (an int64 target, loss, lse). FLOPs: an
exp2 and ~4 others an element. The logits stay in their dtype: no float32 copy of them is made
(the usual `F.cross_entropy(logits.float(), t)` writes and re-reads one of twice their size, and
keeps log-softmax's float32 output for the backward).

Backward, one program a row: gradient = g * (exp(x - lse) - (1 - eps) [c == t] - eps / C) from the
saved lse, so the row is read once and the gradient written once: rows * C * elt each way. An
ignored row reads nothing and writes zeros.

So forward + backward move 3 * rows * C * elt bytes, the minimum for a gradient that is a new
tensor. Accumulation is in float32 whatever the logits' dtype; the gradient is rounded once.

Fused linear cross-entropy (kernelforge.ops.linear_cross_entropy) runs the same two kernels on its
chunks of logits, with what a language model's head adds: logit softcapping c * tanh(z / c)
(SOFTCAP: the loss sees the capped logits; the gradient gets the cap's derivative 1 - tanh^2) and
a z-loss z_loss * lse^2 a row (Z_LOSS), and the backward over a slice of the vocabulary
[first_class, first_class + width) of rows whose lse is known, writing the gradient over the
slice's logits in place (no second buffer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kernelforge.triton import interpreter_enabled
from kernelforge.triton._launch import launch, next_power_of_2, on_device
from kernelforge.triton.masks import block_and_scalar
from kernelforge.triton.softmax import LOG2E, natural_log

# Elements of a row one step of the walk holds at most (16 KB of bf16): 8192 measured no faster.
BLOCK_CLASSES = 4096


@triton.jit
def _capped(x, softcap):
    """(softcap * tanh(x / softcap), the tanh) in float32: tanh from one exp2, exact in sign, its
    absolute error a few float32 ulps (the interpreter has no libdevice tanh)."""
    y = x / softcap
    e = tl.exp2(tl.abs(y) * (-2.0 * LOG2E))  # the constant on the right: see activations.SQRT1_2
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(y < 0, -t, t)
    return softcap * t, t


@triton.jit
def cross_entropy_forward_kernel(
    LOGITS, TARGET, LOSS, LSE, n_classes, row_stride, ignore_index, label_smoothing, softcap, z_loss,
    BLOCK: tl.constexpr, SMOOTHING: tl.constexpr, PRECISE: tl.constexpr, SOFTCAP: tl.constexpr,
    Z_LOSS: tl.constexpr,
):
    # Inductor passes a Python float as fp64 (eager Triton as fp32): float32 math either way
    label_smoothing = tl.cast(label_smoothing, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * row_stride
    cols = tl.arange(0, BLOCK)
    target = tl.load(TARGET + row).to(tl.int64)
    ignored = target == ignore_index
    # The row's running max and sum: one exp2 an element (the max moves by whole blocks). Keeping a
    # max and sum per lane instead (no reduction inside the walk, two exp2 an element) measured
    # slower at every shape of benchmarks/tuning/cross_entropy_sweep.py, and so did pipelining stages.
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    row_total = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n_classes, BLOCK):
        mask = start + cols < n_classes
        x = tl.load(base + start + cols, mask=mask, other=float("-inf"), eviction_policy="evict_first")
        x = tl.cast(x, tl.float32)
        if SOFTCAP:  # the padding stays -inf (capped it would be -softcap)
            x = tl.where(mask, _capped(x, softcap)[0], float("-inf"))
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        # a row of -inf so far keeps new_max -inf: shift by 0 then, not by -inf (NaN)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp2((running_max - shift) * LOG2E) + tl.sum(tl.exp2((x - shift) * LOG2E), 0)
        running_max = new_max
        if SMOOTHING:
            row_total += tl.where(mask, x, 0.0)
    lse = running_max + natural_log(running_sum, PRECISE)
    in_range = (target >= 0) & (target < n_classes)
    target_logit = tl.load(base + target, mask=in_range & ~ignored, other=0.0).to(tl.float32)
    if SOFTCAP:
        target_logit, _ = _capped(target_logit, softcap)
    loss = lse - target_logit
    if SMOOTHING:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - tl.sum(row_total, 0) / n_classes)
    if Z_LOSS:
        loss += tl.cast(z_loss, tl.float32) * lse * lse
    loss = tl.where(ignored, 0.0, tl.where(in_range, loss, float("nan")))
    tl.store(LOSS + row, loss)
    tl.store(LSE + row, lse)


@triton.jit
def cross_entropy_backward_kernel(
    GRAD_LOSS, grad_loss_stride, LOGITS, TARGET, LSE, GRAD, width, n_classes, first_class, row_stride,
    grad_row_stride, ignore_index, label_smoothing, softcap, z_loss,
    BLOCK: tl.constexpr, SOFTCAP: tl.constexpr, Z_LOSS: tl.constexpr,
):
    """Columns [0, width) of the rows' logits, classes [first_class, first_class + width) of
    n_classes; GRAD may be LOGITS (each element is read before it is written, by one program)."""
    # Inductor passes a Python float as fp64 (eager Triton as fp32): float32 math either way
    label_smoothing = tl.cast(label_smoothing, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * row_stride
    out = GRAD + row * grad_row_stride
    cols = tl.arange(0, BLOCK)
    target = tl.load(TARGET + row).to(tl.int64)
    ignored = target == ignore_index
    in_range = (target >= 0) & (target < n_classes)
    scale = tl.load(GRAD_LOSS + row * grad_loss_stride).to(tl.float32)
    scale = tl.where(ignored, 0.0, tl.where(in_range, scale, float("nan")))
    lse = tl.load(LSE + row)
    local_target = target - first_class
    softmax_scale = 1.0
    if Z_LOSS:  # d(z_loss lse^2) / dx = 2 z_loss lse softmax(x)
        softmax_scale = 1.0 + 2.0 * tl.cast(z_loss, tl.float32) * lse
    for start in range(0, width, BLOCK):
        idx = start + cols
        mask = idx < width
        # an ignored row reads nothing: exp2(-inf) = 0 and its scale is 0
        x = tl.load(base + idx, mask=block_and_scalar(mask, ~ignored), other=float("-inf"),
                    eviction_policy="evict_first")
        x = x.to(tl.float32)
        if SOFTCAP:
            x, t = _capped(x, softcap)
        p = tl.exp2((x - lse) * LOG2E)
        grad = p * softmax_scale - tl.where(idx == local_target, 1.0 - label_smoothing, 0.0)
        grad -= label_smoothing / n_classes
        grad = grad * scale
        if SOFTCAP:
            grad = grad * (1.0 - t * t)
        tl.store(out + idx, grad.to(GRAD.dtype.element_ty), mask=mask, cache_modifier=".cs")


@dataclass(frozen=True)
class LaunchConfig:
    block: int  # elements of a row one step of the walk holds
    num_warps: int


def default_config(n_classes: int, backward: bool = False) -> LaunchConfig:
    """The H200 sweep's best or within 3% of it (benchmarks/tuning/cross_entropy_sweep.py, bf16, 256 to
    128256 classes): forward 4 warps on blocks of up to 4096 (4.06-4.09 TB/s of logits read at 32000
    and 128256 classes; 32 warps reached 1.3 TB/s); backward 16 warps on a 4096 block (3.9 TB/s read
    + write), 4 on short rows (256 classes: 4 warps 18 us, 32 warps 86 us).

    Under torch.compile's dynamic shapes n_classes is a SymInt: a count of at least BLOCK_CLASSES
    only adds a guard; a smaller one is specialized, as its block must be."""
    block = BLOCK_CLASSES if n_classes >= BLOCK_CLASSES else max(16, next_power_of_2(int(n_classes)))
    return LaunchConfig(block, max(4, block // 256) if backward else 4)


def cross_entropy_forward_rows(logits2d: torch.Tensor, target: torch.Tensor, ignore_index: int,
                               label_smoothing: float, softcap: float = 0.0, z_loss: float = 0.0,
                               config: Optional[LaunchConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row loss, per-row lse), (rows,) float32 each, of logits2d (unit column stride); softcap
    c > 0: of c * tanh(logits / c); z_loss: z_loss * lse^2 added to each row's loss."""
    rows, n_classes = logits2d.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits2d.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits2d.device)
    if rows == 0:
        return loss, lse
    cfg = config or default_config(n_classes)
    with on_device(logits2d):
        launch(cross_entropy_forward_kernel, (rows,), logits2d, target, loss, lse, n_classes, logits2d.stride(0),
               ignore_index, float(label_smoothing), float(softcap or 1.0), float(z_loss), BLOCK=cfg.block,
               SMOOTHING=label_smoothing != 0, PRECISE=not interpreter_enabled(), SOFTCAP=bool(softcap),
               Z_LOSS=z_loss != 0, num_warps=cfg.num_warps)
    return loss, lse


def _launch_backward(grad_loss, logits2d, target, lse, grad, n_classes, first_class, ignore_index, label_smoothing,
                     softcap, z_loss, config):
    rows, width = logits2d.shape
    if rows == 0 or width == 0:
        return
    cfg = config or default_config(width, backward=True)
    with on_device(logits2d):
        launch(cross_entropy_backward_kernel, (rows,), grad_loss, grad_loss.stride(0), logits2d, target, lse, grad,
               width, n_classes, first_class, logits2d.stride(0), grad.stride(0), ignore_index,
               float(label_smoothing), float(softcap or 1.0), float(z_loss), BLOCK=cfg.block,
               SOFTCAP=bool(softcap), Z_LOSS=z_loss != 0, num_warps=cfg.num_warps)


def cross_entropy_backward_rows(grad_loss: torch.Tensor, logits2d: torch.Tensor, target: torch.Tensor,
                                lse: torch.Tensor, ignore_index: int, label_smoothing: float,
                                config: Optional[LaunchConfig] = None) -> torch.Tensor:
    """The logits' gradient, (rows, classes) dense in their dtype; grad_loss (rows,) may have stride
    0 (the mean's scalar gradient, expanded)."""
    grad = torch.empty(logits2d.shape, dtype=logits2d.dtype, device=logits2d.device)
    _launch_backward(grad_loss, logits2d, target, lse, grad, logits2d.shape[1], 0, ignore_index, label_smoothing,
                     0.0, 0.0, config)
    return grad


def cross_entropy_slice_backward_(grad_loss: torch.Tensor, logits_slice: torch.Tensor, target: torch.Tensor,
                                  lse: torch.Tensor, first_class: int, n_classes: int, ignore_index: int,
                                  label_smoothing: float, softcap: float = 0.0, z_loss: float = 0.0,
                                  config: Optional[LaunchConfig] = None) -> torch.Tensor:
    """The gradient over classes [first_class, first_class + width) of (rows, width) logits (unit
    column stride) of rows of n_classes whose lse (of the capped logits) is known, written over
    logits_slice in place and returned. softcap / z_loss as the forward's."""
    _launch_backward(grad_loss, logits_slice, target, lse, logits_slice, n_classes, first_class, ignore_index,
                     label_smoothing, softcap, z_loss, config)
    return logits_slice
