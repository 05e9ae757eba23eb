"""Fused linear cross-entropy: loss = CE(softcap(x @ W^T + b), target) (+ z-loss) without the
(tokens x vocabulary) logits ever existing whole. Schemas, checks, fakes, autograd, defined once
(kernelforge.ops._opdef).

Registered ops (each with a fake; the first with autograd):
    kernelforge::linear_cross_entropy(Tensor x, Tensor weight, Tensor target, Tensor? bias,
        SymInt ignore_index, float label_smoothing, float softcap, float z_loss, int chunk_rows)
        -> (Tensor loss, Tensor lse)          per row, float32 (float64 for float64 x)
    kernelforge::linear_cross_entropy_backward(Tensor grad_loss, Tensor x, Tensor weight,
        Tensor target, Tensor? bias, Tensor lse, SymInt ignore_index, float label_smoothing,
        float softcap, float z_loss, int chunk_rows) -> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)

Both walk the rows in chunks of chunk_rows: a chunk's logits z = x_c W^T + b (kf.gemm), capped
(c tanh(z / c), Gemma 2's softcapping, in float32), go through the cross-entropy kernels (loss and
lse forward; the logits' gradient backward, with the z-loss term z_loss * lse^2 and the cap's
derivative 1 - tanh^2 applied to it), then the backward's two GEMMs: grad_x of the chunk's rows,
and grad_weight accumulated in float32 through the GEMM's residual epilogue. The backward computes
the chunk's logits again rather than keeping them: memory is one chunk's logits (and its
gradient), not the whole (rows x vocabulary), at the price of a fourth GEMM of the head's three.
Bytes a chunk: W once per GEMM (V x H), the chunk's logits written and read a few times (C x V);
FLOPs 2 C V H per GEMM.

The backends are those of kf.gemm and kf.cross_entropy (each picks its own: use_backend forces
both); on a CPU their references. Not yet one kernel: the chunk's logits make a round trip
through memory between the GEMM and the loss kernels, and softcap / z-loss add torch passes over
the chunk.
"""
from __future__ import annotations

from typing import Optional

import torch

from kernelforge.ops._common import FLOAT_DTYPES, check_floating, check_same, require
from kernelforge.ops._opdef import define_op
from kernelforge.ops.cross_entropy import REDUCTIONS, TARGET_DTYPES, cross_entropy_backward_op, cross_entropy_op
from kernelforge.ops.gemm import gemm
from kernelforge.reference._accumulation import accumulation_dtype

NAME = "fused_linear_cross_entropy"


MIN_CHUNK_LOGITS = 1 << 24  # 32 MiB of bf16 logits: below this, chunking saves little and costs launches


def default_chunk_rows(rows: int, vocab: int, hidden: int) -> int:
    """Rows whose logits fit the larger of x's own size (rows x hidden) and MIN_CHUNK_LOGITS, a
    power of two (at most the rows): the chunk's logits cost no more memory than the activations
    already held, and the GEMMs stay large."""
    budget = max(rows * hidden, MIN_CHUNK_LOGITS) // max(vocab, 1)
    return max(1, min(rows, 1 << (budget.bit_length() - 1) if budget else 1))


# ----------------------------------------------------------------------------- checks
def _check(name, x, weight, target, bias, label_smoothing, softcap, z_loss, chunk_rows) -> None:
    check_floating(name, "x", x, FLOAT_DTYPES)
    check_same(name, "dtype", ("x", "weight"), (x.dtype, weight.dtype))
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"kernelforge.{name}: x must be (rows, hidden) and weight (vocab, hidden), got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(f"kernelforge.{name}: target must be class indices of dtype int64 or int32, got {target.dtype}")
    devices = (x.device, weight.device, target.device) + (() if bias is None else (bias.device,))
    check_same(name, "device", ("x", "weight", "target", "bias")[:len(devices)], devices)
    require(weight.shape[1] == x.shape[1], lambda: f"kernelforge.{name}: weight must be (vocab, {x.shape[1]}) for x "
                                                   f"of hidden size {x.shape[1]}, got {tuple(weight.shape)}")
    require(weight.shape[0] >= 1, lambda: f"kernelforge.{name}: weight needs at least one class (row), got shape "
                                          f"{tuple(weight.shape)}")
    require(target.dim() == 1 and target.shape[0] == x.shape[0],
            lambda: f"kernelforge.{name}: target must be ({x.shape[0]},), one class a row of x, got "
                    f"{tuple(target.shape)}")
    if bias is not None:
        check_floating(name, "bias", bias, FLOAT_DTYPES)
        require(bias.dim() == 1 and bias.shape[0] == weight.shape[0],
                lambda: f"kernelforge.{name}: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"kernelforge.{name}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if not softcap >= 0.0:
        raise ValueError(f"kernelforge.{name}: softcap must be positive (0: none), got {softcap}")
    if not z_loss >= 0.0:
        raise ValueError(f"kernelforge.{name}: z_loss must be >= 0, got {z_loss}")
    if chunk_rows < 1:
        raise ValueError(f"kernelforge.{name}: chunk_rows must be >= 1, got {chunk_rows}")


# ----------------------------------------------------------------------------- one chunk
def _logits(x_c, weight, bias, softcap: float):
    """(the chunk's logits as the loss sees them, tanh(z / cap) or None)."""
    z = gemm(x_c, weight.t(), bias=bias)  # W read transposed in place
    if not softcap:
        return z, None
    t = torch.tanh(z.to(accumulation_dtype(z.dtype)) / softcap)
    return softcap * t, t


def _forward(x, weight, target, bias, ignore_index: int, label_smoothing: float, softcap: float, z_loss: float,
             chunk_rows: int):
    _check(NAME, x, weight, target, bias, label_smoothing, softcap, z_loss, chunk_rows)
    acc = accumulation_dtype(x.dtype)
    loss = torch.empty(x.shape[0], dtype=acc, device=x.device)
    lse = torch.empty_like(loss)
    for start in range(0, x.shape[0], chunk_rows):
        rows = slice(start, min(start + chunk_rows, x.shape[0]))
        z, _ = _logits(x[rows], weight, bias, softcap)
        loss_c, lse_c = cross_entropy_op(z, target[rows], ignore_index, label_smoothing)
        if z_loss:
            loss_c = loss_c + torch.where(target[rows] == ignore_index, 0.0, z_loss * lse_c * lse_c)
        loss[rows] = loss_c
        lse[rows] = lse_c
    return loss, lse


def _backward(grad_loss, x, weight, target, bias, lse, ignore_index: int, label_smoothing: float, softcap: float,
              z_loss: float, chunk_rows: int):
    _check(f"{NAME}_backward", x, weight, target, bias, label_smoothing, softcap, z_loss, chunk_rows)
    acc = accumulation_dtype(x.dtype)
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=x.device)
    grad_bias = torch.zeros(weight.shape[0], dtype=acc, device=x.device)
    for start in range(0, x.shape[0], chunk_rows):
        rows = slice(start, min(start + chunk_rows, x.shape[0]))
        x_c, target_c, g_c, lse_c = x[rows], target[rows], grad_loss[rows], lse[rows]
        z, t = _logits(x_c, weight, bias, softcap)
        dz = cross_entropy_backward_op(g_c, z, target_c, lse_c, ignore_index, label_smoothing)
        if z_loss:  # d(z_loss lse^2) / dz = 2 z_loss lse softmax(z)
            scale = torch.where(target_c == ignore_index, 0.0, 2 * z_loss * g_c * lse_c)
            dz = dz.to(acc) + scale[:, None] * torch.exp(z.to(acc) - lse_c[:, None])
        if softcap:  # d(c tanh(z / c)) / dz = 1 - tanh^2
            dz = dz.to(acc) * (1 - t * t)
        dz = dz.to(x.dtype)
        grad_x[rows] = gemm(dz, weight)
        grad_weight = gemm(dz.t(), x_c, residual=grad_weight, out_dtype=acc)
        grad_bias += dz.sum(0, dtype=acc)
    return grad_x, grad_weight.to(weight.dtype), grad_bias.to(weight.dtype if bias is None else bias.dtype)


def _fake_forward(x, weight, target, bias, ignore_index, label_smoothing, softcap, z_loss, chunk_rows):
    _check(NAME, x, weight, target, bias, label_smoothing, softcap, z_loss, chunk_rows)
    loss = x.new_empty(x.shape[0], dtype=accumulation_dtype(x.dtype))
    return loss, torch.empty_like(loss)


def _fake_backward(grad_loss, x, weight, target, bias, lse, ignore_index, label_smoothing, softcap, z_loss,
                   chunk_rows):
    _check(f"{NAME}_backward", x, weight, target, bias, label_smoothing, softcap, z_loss, chunk_rows)
    return (torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight),
            weight.new_empty(weight.shape[0], dtype=weight.dtype if bias is None else bias.dtype))


def _save(ctx, inputs, output):
    x, weight, target, bias, *options = inputs
    ctx.save_for_backward(x, weight, target, bias, output[1])
    ctx.mark_non_differentiable(output[1])  # lse: the backward's helper
    ctx.options = options


def _gradient(ctx, grad_loss, _grad_lse):
    x, weight, target, bias, lse = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = linear_cross_entropy_backward_op(grad_loss, x, weight, target, bias, lse,
                                                                      *ctx.options)
    return grad_x, grad_weight, None, None if bias is None else grad_bias, None, None, None, None, None


linear_cross_entropy_backward_op = define_op(
    "kernelforge::linear_cross_entropy_backward(Tensor grad_loss, Tensor x, Tensor weight, Tensor target, "
    "Tensor? bias, Tensor lse, SymInt ignore_index, float label_smoothing, float softcap, float z_loss, "
    "int chunk_rows) -> (Tensor, Tensor, Tensor)",
    impl=_backward, fake=_fake_backward)

linear_cross_entropy_op = define_op(
    "kernelforge::linear_cross_entropy(Tensor x, Tensor weight, Tensor target, Tensor? bias, SymInt ignore_index, "
    "float label_smoothing, float softcap, float z_loss, int chunk_rows) -> (Tensor, Tensor)",
    impl=_forward, fake=_fake_forward, setup_context=_save, backward=_gradient)


def fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: Optional[torch.Tensor] = None, *, ignore_index: int = -100,
                               reduction: str = "mean", label_smoothing: float = 0.0,
                               softcap: Optional[float] = None, z_loss: float = 0.0,
                               chunk_rows: Optional[int] = None) -> torch.Tensor:
    """F.cross_entropy(x @ weight.T + bias, target) without the logits: a language model's head and
    loss in one call, for a vocabulary too large for (tokens x vocabulary) logits to be cheap.

    x (..., hidden) in float32/float16/bfloat16 (float64 on a CPU), weight (vocab, hidden) in x's
    dtype (a Linear's weight, read transposed in place), bias (vocab,) or None, target class
    indices shaped like x without its last dim. ignore_index, reduction ("mean" over the targets
    that are not ignored, "sum", "none") and label_smoothing as in torch; softcap c: the logits
    become c * tanh(logits / c) first (Gemma 2); z_loss: adds z_loss * logsumexp(logits)^2 to each
    row's loss (PaLM's z-loss). The loss is float32 (float64 for float64 x), accumulated in it;
    gradients of x, weight and bias in their dtypes, added to .grad as any gradient is (gradient
    accumulation over micro-batches works as with the unfused head). chunk_rows: rows of logits
    alive at once (default: about x's own size in logits, 2^24 at least: default_chunk_rows). A target outside
    [0, vocab) that is not ignore_index gives a NaN loss."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"kernelforge.{NAME}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    for name, t in (("x", x), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"kernelforge.{NAME}: {name} must be a tensor, got {type(t).__name__}")
    if x.dim() < 1 or tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"kernelforge.{NAME}: target must have x's shape without its last dim, "
                         f"{tuple(x.shape[:-1])}, got {tuple(target.shape)}")
    x2d, target1d = x.reshape(-1, x.shape[-1]), target.reshape(-1)
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(x2d.shape[0], weight.shape[0] if weight.dim() == 2 else 1, x2d.shape[1])
    loss = linear_cross_entropy_op(x2d, weight, target1d, bias, ignore_index, float(label_smoothing),
                                   float(softcap or 0.0), float(z_loss), int(chunk_rows))[0]
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target1d != ignore_index).sum()


__all__ = ["default_chunk_rows", "fused_linear_cross_entropy"]
