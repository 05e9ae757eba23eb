"""cross_entropy: schemas, input checks, fake implementations, autograd, dispatch.

Ops (kernelforge.ops._opdef.define_op: a fake, autograd, the lean eager call):
    kernelforge::cross_entropy(Tensor logits, Tensor target, SymInt ignore_index, float label_smoothing)
        -> (Tensor loss, Tensor lse)
    kernelforge::cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor target, Tensor lse,
        SymInt ignore_index, float label_smoothing) -> Tensor      (its own gradient: the double backward)

Both take (rows, classes) logits and (rows,) targets and work per row: loss and lse are (rows,),
float32 (float64 for float64 logits). The public `cross_entropy` maps torch's layouts onto rows
((C,), (N, C), (N, C, d1, ...)) and applies the reduction with plain torch ops, so the mean's
division by the count of targets that are not ignored is differentiated by autograd.

Every backend implements the row launchers of kernelforge.reference.cross_entropy:
`cross_entropy_forward_rows` and `cross_entropy_backward_rows`, and for fused linear
cross-entropy (kernelforge.ops.linear_cross_entropy) the forward's softcap / z-loss options and
`cross_entropy_slice_backward_` (a slice of the vocabulary, in place). Both backends are traceable: under
torch.compile the ops decompose into the Triton kernels (which Inductor launches) or the reference's
torch ops.
"""
from __future__ import annotations

import torch

from kernelforge import backends
from kernelforge.ops._common import (FLOAT_DTYPES, any_inputs, as_float, check_floating, check_same, require,
                                     triton_floats)
from kernelforge.ops._opdef import define_op
from kernelforge.reference._accumulation import accumulation_dtype
from kernelforge.reference.cross_entropy import target_masks

OP = "cross_entropy"
NAME = "cross_entropy"
TARGET_DTYPES = (torch.int64, torch.int32)
REDUCTIONS = ("mean", "sum", "none")


# ----------------------------------------------------------------------------- dispatch
def _preference(logits: torch.Tensor):
    if logits.device.type != "cuda":
        return ("reference",), "the reference is the CPU implementation"
    return ("triton", "reference"), (
        "the Triton kernels read the logits in their dtype once forward and once backward; the reference "
        "makes float32 copies")


def _choice_key(logits: torch.Tensor):
    return logits.device.type, logits.dtype


backends.register(OP, "triton", "kernelforge.triton.cross_entropy", triton_floats)
backends.register(OP, "reference", "kernelforge.reference.cross_entropy", any_inputs)
backends.set_preference(OP, _preference, _choice_key)


# ----------------------------------------------------------------------------- checks
def _check_rows(name: str, logits: torch.Tensor, target: torch.Tensor, label_smoothing: float) -> None:
    check_floating(name, "logits", logits, FLOAT_DTYPES)
    if logits.dim() != 2:
        raise ValueError(f"kernelforge.{name}: logits must be (rows, classes), got shape {tuple(logits.shape)}")
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(f"kernelforge.{name}: target must be class indices of dtype int64 or int32, got {target.dtype}")
    if target.dim() != 1:
        raise ValueError(f"kernelforge.{name}: target must be (rows,), got shape {tuple(target.shape)}")
    check_same(name, "device", ("logits", "target"), (logits.device, target.device))
    require(target.shape[0] == logits.shape[0], lambda: (
        f"kernelforge.{name}: expected one target a row of logits, got logits {tuple(logits.shape)} "
        f"and target {tuple(target.shape)}"))
    require(logits.shape[1] >= 1, lambda: f"kernelforge.{name}: logits need at least one class, got "
                                          f"shape {tuple(logits.shape)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"kernelforge.{name}: label_smoothing must be in [0, 1], got {label_smoothing}")


def _check_backward(grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                    label_smoothing: float) -> None:
    name = f"{NAME}_backward"
    _check_rows(name, logits, target, label_smoothing)
    rows = (logits.shape[0],)
    for arg, t in (("grad_loss", grad_loss), ("lse", lse)):
        check_floating(name, arg, t, (accumulation_dtype(logits.dtype),))
        require(tuple(t.shape) == rows, lambda: f"kernelforge.{name}: {arg} must be (rows,) = {rows}, got shape "
                                                f"{tuple(t.shape)}")
    check_same(name, "device", ("grad_loss", "logits", "lse"), (grad_loss.device, logits.device, lse.device))


def _rows_with_unit_stride(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(1) == 1 or logits.shape[1] == 1 else logits.contiguous()


def _choose(logits: torch.Tensor) -> backends.Choice:
    return backends.select(OP, logits)


def _forward(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float):
    _check_rows(NAME, logits, target, label_smoothing)
    logits = _rows_with_unit_stride(logits)
    return _choose(logits).implementation.launchers().cross_entropy_forward_rows(
        logits, target.contiguous(), ignore_index, label_smoothing)


def _backward(grad_loss, logits, target, lse, ignore_index: int, label_smoothing: float) -> torch.Tensor:
    _check_backward(grad_loss, logits, target, lse, label_smoothing)
    logits = _rows_with_unit_stride(logits)
    return _choose(logits).implementation.launchers().cross_entropy_backward_rows(
        grad_loss, logits, target.contiguous(), lse.contiguous(), ignore_index, label_smoothing)


def _fake_forward(logits, target, ignore_index, label_smoothing):
    _check_rows(NAME, logits, target, label_smoothing)
    rows = logits.new_empty((logits.shape[0],), dtype=accumulation_dtype(logits.dtype))
    return rows, torch.empty_like(rows)


def _fake_backward(grad_loss, logits, target, lse, ignore_index, label_smoothing):
    _check_backward(grad_loss, logits, target, lse, label_smoothing)
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------- double backward
def _save_backward_inputs(ctx, inputs, output):
    grad_loss, logits, target, _, ignore_index, label_smoothing = inputs
    ctx.save_for_backward(grad_loss, logits, target)
    ctx.ignore_index, ctx.label_smoothing = ignore_index, label_smoothing


def _double_backward(ctx, grad_grad):
    """Gradients of the backward op (for create_graph=True), in plain differentiable ops. With
    p = softmax(x), s_i the row's scale (g_i, 0 if ignored) and G = s * (p - (1 - eps) e_t - eps / C):
        dG/dg (against v) = sum_c v_c (p_c - (1 - eps) [c == t] - eps / C), where the row is not ignored;
        dG/dx (against v) = s * p * (v - <v, p>).
    lse gets none: it is a function of the logits, and dx above already differentiates through it."""
    grad_loss, logits, target = ctx.saved_tensors
    eps, n_classes = ctx.label_smoothing, logits.shape[1]
    acc = accumulation_dtype(logits.dtype)
    v, x = grad_grad.to(acc), logits.to(acc)
    p = torch.softmax(x, dim=1)
    ignored, bad, safe = target_masks(target, n_classes, ctx.ignore_index)
    along = (v * p).sum(1) - (1 - eps) * v.gather(1, safe[:, None])[:, 0] - eps / n_classes * v.sum(1)
    d_grad_loss = torch.where(ignored, 0.0, along).masked_fill(bad, float("nan"))
    scale = torch.where(ignored, 0.0, grad_loss.to(acc)).masked_fill(bad, float("nan"))
    d_logits = scale[:, None] * p * (v - (v * p).sum(1, keepdim=True))
    return d_grad_loss.to(grad_loss.dtype), d_logits.to(logits.dtype), None, None, None, None


# ----------------------------------------------------------------------------- definitions
cross_entropy_backward_op = define_op(
    "kernelforge::cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor target, Tensor lse, "
    "SymInt ignore_index, float label_smoothing) -> Tensor",
    impl=_backward, fake=_fake_backward,
    choose=lambda grad_loss, logits, target, lse, ignore_index, label_smoothing: _choose(logits),
    setup_context=_save_backward_inputs, backward=_double_backward)


def _save_forward(ctx, inputs, output):
    logits, target, ignore_index, label_smoothing = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.mark_non_differentiable(output[1])  # lse: the backward's helper, not a result to differentiate
    ctx.ignore_index, ctx.label_smoothing = ignore_index, label_smoothing


def _gradient(ctx, grad_loss, _grad_lse):
    logits, target, lse = ctx.saved_tensors
    grad = cross_entropy_backward_op(grad_loss, logits, target, lse, ctx.ignore_index, ctx.label_smoothing)
    return grad, None, None, None


cross_entropy_op = define_op(
    "kernelforge::cross_entropy(Tensor logits, Tensor target, SymInt ignore_index, float label_smoothing) "
    "-> (Tensor, Tensor)",
    impl=_forward, fake=_fake_forward,
    choose=lambda logits, target, ignore_index, label_smoothing: _choose(logits),
    setup_context=_save_forward, backward=_gradient, helper_outputs=(1,))


# ----------------------------------------------------------------------------- public function
def _as_rows(logits: torch.Tensor, target: torch.Tensor):
    """torch's layouts as (rows, classes) logits and (rows,) targets: (C,) with a 0-d target,
    (N, C) with (N,), (N, C, d1, ...) with (N, d1, ...) (classes along dim 1; a copy moves them
    innermost)."""
    if logits.dim() == 1:
        if target.dim() != 0:
            raise ValueError(f"kernelforge.{NAME}: unbatched logits (C,) take a 0-d target, got target shape "
                             f"{tuple(target.shape)}")
        return logits[None], target.reshape(1)
    if logits.dim() == 0:
        raise ValueError(f"kernelforge.{NAME}: logits must be (C,), (N, C) or (N, C, d1, ...), got a 0-d tensor")
    expected = (logits.shape[0],) + tuple(logits.shape[2:])
    if tuple(target.shape) != expected:
        raise ValueError(f"kernelforge.{NAME}: target must have shape {expected} for logits of shape "
                         f"{tuple(logits.shape)} (classes along dim 1), got {tuple(target.shape)}")
    if logits.dim() == 2:
        return logits, target
    require(logits.shape[1] >= 1, lambda: f"kernelforge.{NAME}: logits need at least one class, got "
                                          f"shape {tuple(logits.shape)}")
    return logits.movedim(1, -1).reshape(-1, logits.shape[1]), target.reshape(-1)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """torch.nn.functional.cross_entropy with class-index targets, from logits in their own dtype.

    logits (C,), (N, C) or (N, C, d1, ...) float32/float16/bfloat16 (float64 on the reference);
    target of class indices, int64 or int32, shaped like logits without the class dim.
    reduction "mean" (over the targets that are not ignore_index: NaN when all are), "sum" or
    "none" (target's shape). label_smoothing in [0, 1] as in torch.

    The loss is float32 (float64 for float64 logits) whatever the logits' dtype: torch returns
    the logits' dtype, but a bfloat16 loss carries a 0.4% rounding, and the usual remedy,
    `F.cross_entropy(logits.float(), target)`, makes a float32 copy of the logits; here the
    kernels read bfloat16 logits directly and accumulate in float32. The logits' gradient is in
    their dtype. A target outside [0, C) that is not ignore_index gives a NaN loss (torch raises);
    differentiable, double backward included; works under torch.compile."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"kernelforge.{NAME}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(f"kernelforge.{NAME}: logits and target must be tensors, got {type(logits).__name__} and "
                        f"{type(target).__name__}")
    if target.is_floating_point():
        raise TypeError(f"kernelforge.{NAME}: target must hold class indices (int64 or int32); probability targets "
                        f"are not supported, got {target.dtype}")
    logits2d, target1d = _as_rows(logits, target)
    loss = cross_entropy_op(logits2d, target1d, ignore_index, as_float(NAME, "label_smoothing", label_smoothing))[0]
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target1d != ignore_index).sum()
