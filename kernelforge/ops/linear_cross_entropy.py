"""Fused linear cross-entropy: loss = CE(softcap(x @ W^T + b), target) (+ z-loss) without the
(tokens x vocabulary) logits ever existing whole. Schemas, checks, fakes, autograd, defined once
(kernelforge.ops._opdef).

Registered ops (each with a fake; the first two with autograd):
    kernelforge::linear_cross_entropy(Tensor x, Tensor weight, Tensor target, Tensor? bias,
        SymInt ignore_index, float label_smoothing, float softcap, float z_loss, int chunk_rows)
        -> (Tensor loss, Tensor lse)          per row, float32 (float64 for float64 x)
    kernelforge::linear_cross_entropy_backward(Tensor grad_loss, Tensor x, Tensor weight,
        Tensor target, Tensor? bias, Tensor lse, SymInt ignore_index, float label_smoothing,
        float softcap, float z_loss, int chunk_rows) -> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)
    kernelforge::linear_cross_entropy_reduced(Tensor x, Tensor weight, Tensor target, Tensor? bias,
        SymInt ignore_index, float label_smoothing, float softcap, float z_loss, int chunk_rows,
        bool mean, bool grad_x, bool grad_weight, bool grad_bias)
        -> (Tensor loss, Tensor grad_x, Tensor grad_weight, Tensor grad_bias)
        the summed (or mean) loss, a 0-dim tensor, and its gradients computed in the same pass
        (empty where not asked for); the backward scales them by the loss's gradient.

Two ways to the gradients, picked by the public function:

- A reduced loss ("mean", "sum") with a gradient to come (grad mode on, an input requiring it):
  the gradients are computed in the forward, three GEMMs of 2 R V H (the head's own count). A
  row chunk's logits z = x_c W^T + b (kf.gemm) go through the cross-entropy forward kernel (loss
  and lse a row: it caps them, c tanh(z / c), Gemma 2's softcapping, and adds the z-loss as it
  reads them), then the backward kernel turns them into their gradient in place (the loss's
  gradient a row is 1, or 1 / the count of targets for the mean); grad_x of the chunk is then
  dz W (complete: rounded once), grad_W += dz^T x_c (in place, torch's addmm_: float32 inside,
  rounded to W's dtype once a chunk, so grad_W's error grows with the number of chunks, as a GEMM
  over all rows split into that many parts would; the chunks are at least grad_W's size in logits,
  default_chunk_rows, so there are few), grad_b += the column sums of dz. The backward multiplies
  them by the loss's gradient in place. Memory: one chunk's logits, and grad_x and grad_W held from
  the forward to the backward (the backward would allocate them anyway). Bytes: W read three times
  a chunk, grad_W read and written once a chunk, the logits written once, read twice and written
  again.
  This is the path a language model's training step takes.
- Otherwise (reduction "none", whose rows' gradients are only known in the backward; or no
  gradient asked for) the forward computes the loss and lse a row, chunk by chunk as above, and
  the backward computes the logits again rather than keeping them, one slice of the vocabulary at
  a time, over every row (blocks of rows only where the rows alone would exceed the memory):
  z_s = x W_s^T + b_s; the cross-entropy backward kernel writes the logits' gradient over z_s in
  place; then grad_W_s = dz_s^T x, a GEMM over all rows that accumulates in float32 and is
  rounded once, and grad_x += dz_s W_s into a float32 accumulator (rows x H). Four GEMMs of
  2 R V H (the forward's, the recomputation, grad_W, grad_x); W read once a forward chunk and
  three times a backward slice.

The backends are those of kf.gemm and of the cross-entropy kernels (kernelforge.ops.cross_entropy's
choice; use_backend forces both); on a CPU their references.
"""
from __future__ import annotations

from typing import Optional

import torch

from kernelforge import backends
from kernelforge.ops._common import FLOAT_DTYPES, as_float, check_floating, check_same, follows_autocast, require
from kernelforge.ops._opdef import define_op, is_traced
from kernelforge.ops.cross_entropy import OP as CROSS_ENTROPY_OP
from kernelforge.ops.cross_entropy import REDUCTIONS, TARGET_DTYPES
from kernelforge.ops.gemm import OP as GEMM_OP
from kernelforge.ops.gemm import gemm, resolve_compute
from kernelforge.reference._accumulation import accumulation_dtype

NAME = "fused_linear_cross_entropy"


MIN_CHUNK_LOGITS = 1 << 26  # 128 MiB of bf16 logits: a chunk of 512 rows at a 128k vocabulary, where the
# GEMM streaming W for it is at its compute peak (measured: 256 rows 0.85x the rate of 1024)
MIN_SLICE_CLASSES = 4096  # the backward's vocabulary slices: narrower ones make the GEMMs' grad_x sum slow


def default_chunk_rows(rows: int, vocab: int, hidden: int, *, gradients_in_forward: bool = False) -> int:
    """Rows whose logits fit the larger of x's own size (rows x hidden) and MIN_CHUNK_LOGITS, a
    power of two (at most the rows): the chunk's logits cost little memory next to the
    activations already held, and the GEMMs stay large. gradients_in_forward: the budget is at
    least grad_W's own size (vocab x hidden), which the chunks are summed into: each chunk reads
    and writes grad_W once, so smaller chunks would cost more traffic than their logits (measured
    at Llama-3.2-1B's head, 8192 x 2048 x 128256 on an H200: 25.6 ms forward+backward in chunks of
    512 rows, 21.5 in chunks of 2048), and the logits no more memory than grad_W."""
    budget = max(rows * hidden, MIN_CHUNK_LOGITS, vocab * hidden if gradients_in_forward else 0) // max(vocab, 1)
    return max(1, min(rows, 1 << (budget.bit_length() - 1) if budget else 1))


def backward_blocks(rows: int, vocab: int, chunk_rows: int) -> tuple[int, int]:
    """(rows, classes) of the backward's blocks of logits: chunk_rows x vocab elements at most
    (the forward's memory), all rows in one block where a slice of MIN_SLICE_CLASSES allows it
    (grad_W is then written once, not accumulated), slices a multiple of 128 classes."""
    budget = max(chunk_rows, 1) * vocab
    if rows * vocab <= budget:
        return rows, vocab
    min_classes = min(vocab, MIN_SLICE_CLASSES)
    blocks = -(-rows // max(1, budget // min_classes))  # as few row blocks as the budget allows, of even size
    row_block = -(-rows // blocks)
    classes = budget // row_block
    return row_block, min(vocab, max(min_classes, classes - classes % 128))


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


# ----------------------------------------------------------------------------- forward, backward
def _kernels(logits: torch.Tensor):
    return backends.select(CROSS_ENTROPY_OP, logits).implementation.launchers()


def _choose(x, weight, *rest) -> backends.Choice:
    """The GEMM's choice decides how torch.compile takes the op: whole (an opaque GEMM: the op runs
    at run time) or decomposed (the reference's torch ops)."""
    return backends.select(GEMM_OP, x, weight, compute=resolve_compute(x, weight, "auto"))  # no view: traced tensors


def _chunk_loss(x_c, weight, target_c, bias, ignore_index, label_smoothing, softcap, z_loss):
    """A row chunk's logits (x_c W^T + b: W read transposed in place) and their loss and lse a row."""
    z = gemm(x_c, weight.t(), bias=bias)
    return (z, *_kernels(z).cross_entropy_forward_rows(z, target_c, ignore_index, label_smoothing, softcap, z_loss))


def _forward(x, weight, target, bias, ignore_index: int, label_smoothing: float, softcap: float, z_loss: float,
             chunk_rows: int):
    _check(NAME, x, weight, target, bias, label_smoothing, softcap, z_loss, chunk_rows)
    acc = accumulation_dtype(x.dtype)
    loss = torch.empty(x.shape[0], dtype=acc, device=x.device)
    lse = torch.empty_like(loss)
    target = target.contiguous()
    for start in range(0, x.shape[0], chunk_rows):
        rows = slice(start, min(start + chunk_rows, x.shape[0]))
        _, loss[rows], lse[rows] = _chunk_loss(x[rows], weight, target[rows], bias, ignore_index, label_smoothing,
                                               softcap, z_loss)
    return loss, lse


def _forward_with_gradients(x, weight, target, bias, ignore_index: int, label_smoothing: float, softcap: float,
                            z_loss: float, chunk_rows: int, mean: bool, need_x: bool, need_weight: bool,
                            need_bias: bool):
    """The reduced loss and its gradients (of a loss gradient of 1), in one walk over row chunks."""
    _check(NAME, x, weight, target, bias, label_smoothing, softcap, z_loss, chunk_rows)
    acc = accumulation_dtype(x.dtype)
    n_rows, vocab = x.shape[0], weight.shape[0]
    target = target.contiguous()
    # each row's gradient: 1 for the sum, 1 / count for the mean (inf for none counted: then every
    # row is ignored and its gradient 0, as the unfused mean's); a stride-0 view
    count = (target != ignore_index).sum()
    scale = 1.0 / count.to(acc) if mean else torch.ones((), dtype=acc, device=x.device)
    grad_rows = scale.expand(n_rows)
    losses = torch.empty(n_rows, dtype=acc, device=x.device)
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else x.new_empty(0)
    grad_weight = None
    grad_bias = torch.zeros(vocab if need_bias else 0, dtype=acc, device=x.device)
    for start in range(0, n_rows, chunk_rows):
        rows = slice(start, min(start + chunk_rows, n_rows))
        x_c, target_c = x[rows], target[rows]
        z, losses[rows], lse = _chunk_loss(x_c, weight, target_c, bias, ignore_index, label_smoothing, softcap,
                                           z_loss)
        dz = _kernels(z).cross_entropy_slice_backward_(grad_rows[rows], z, target_c, lse, 0, vocab, ignore_index,
                                                       label_smoothing, softcap, z_loss)
        if need_x:
            grad_x[rows] = gemm(dz, weight)
        if need_weight and grad_weight is None:
            grad_weight = gemm(dz.t(), x_c)
        elif need_weight:  # in place (torch's GEMM: kf.gemm's output is a new tensor, a second grad_W)
            grad_weight.addmm_(dz.t(), x_c)
        if need_bias:
            grad_bias += dz.sum(0, dtype=acc)
    loss = losses.sum()
    if mean:
        loss = loss / count
    if grad_weight is None:
        grad_weight = weight.new_empty(0 if not need_weight else weight.shape)
        if need_weight:  # no rows
            grad_weight.zero_()
    grad_bias = grad_bias.to(bias.dtype) if need_bias else x.new_empty(0)
    return loss, grad_x, grad_weight, grad_bias


def _backward(grad_loss, x, weight, target, bias, lse, ignore_index: int, label_smoothing: float, softcap: float,
              z_loss: float, chunk_rows: int):
    _check(f"{NAME}_backward", x, weight, target, bias, label_smoothing, softcap, z_loss, chunk_rows)
    acc = accumulation_dtype(x.dtype)
    vocab = weight.shape[0]
    row_block, class_block = backward_blocks(x.shape[0], vocab, chunk_rows)
    # grad_W written once a slice, else summed over row blocks (from zeros: no rows, no terms)
    one_block = 0 < x.shape[0] <= row_block
    grad_weight = torch.empty_like(weight) if one_block else torch.zeros(weight.shape, dtype=acc, device=x.device)
    grad_bias = torch.zeros(vocab if bias is not None else 0, dtype=acc, device=x.device)
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    target, lse = target.contiguous(), lse.contiguous()
    for start in range(0, x.shape[0], max(row_block, 1)):
        rows = slice(start, min(start + row_block, x.shape[0]))
        x_b = x[rows]
        grad_x_b = None  # float32 sum over the vocabulary's slices
        for first in range(0, vocab, class_block):
            classes = slice(first, min(first + class_block, vocab))
            w_s = weight[classes]
            z = gemm(x_b, w_s.t(), bias=None if bias is None else bias[classes])
            dz = _kernels(z).cross_entropy_slice_backward_(grad_loss[rows], z, target[rows], lse[rows], first, vocab,
                                                           ignore_index, label_smoothing, softcap, z_loss)
            if one_block:
                grad_weight[classes] = gemm(dz.t(), x_b)
            else:
                grad_weight[classes] = gemm(dz.t(), x_b, residual=grad_weight[classes], out_dtype=acc)
            grad_x_b = gemm(dz, w_s, residual=grad_x_b, out_dtype=acc)
            if bias is not None:
                grad_bias[classes] += dz.sum(0, dtype=acc)
        grad_x[rows] = grad_x_b
    return (grad_x, grad_weight.to(weight.dtype),
            grad_bias.to(bias.dtype) if bias is not None else weight.new_zeros(vocab))


def _fake_forward(x, weight, target, bias, ignore_index, label_smoothing, softcap, z_loss, chunk_rows):
    _check(NAME, x, weight, target, bias, label_smoothing, softcap, z_loss, chunk_rows)
    loss = x.new_empty(x.shape[0], dtype=accumulation_dtype(x.dtype))
    return loss, torch.empty_like(loss)


def _fake_backward(grad_loss, x, weight, target, bias, lse, ignore_index, label_smoothing, softcap, z_loss,
                   chunk_rows):
    _check(f"{NAME}_backward", x, weight, target, bias, label_smoothing, softcap, z_loss, chunk_rows)
    return (torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight),
            weight.new_empty(weight.shape[0], dtype=weight.dtype if bias is None else bias.dtype))


def _fake_forward_with_gradients(x, weight, target, bias, ignore_index, label_smoothing, softcap, z_loss, chunk_rows,
                                 mean, need_x, need_weight, need_bias):
    _check(NAME, x, weight, target, bias, label_smoothing, softcap, z_loss, chunk_rows)
    loss = x.new_empty((), dtype=accumulation_dtype(x.dtype))
    return (loss, torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else x.new_empty(0),
            torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else weight.new_empty(0),
            bias.new_empty(bias.shape) if need_bias else x.new_empty(0))


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


def _save_gradients(ctx, inputs, output):
    ctx.save_for_backward(*output[1:])
    ctx.mark_non_differentiable(*output[1:])
    ctx.needs = inputs[10:13]  # grad_x, grad_weight, grad_bias asked for
    ctx.used = False


def _scaled_gradients(ctx, grad_loss, *_unused):
    """The forward's gradients times the loss's gradient: in place in plain eager mode (they are
    nobody else's; a second backward through the same loss is refused), out of place under tracing."""
    traced = is_traced(grad_loss)
    if not traced:
        if torch.is_grad_enabled():
            raise RuntimeError(f"kernelforge.{NAME}: create_graph=True through a 'mean' or 'sum' loss is not "
                               "supported (its gradients are computed in the forward, without a graph); use "
                               "reduction='none' and reduce the rows yourself")
        if ctx.used:
            raise RuntimeError(f"kernelforge.{NAME}: a second backward through the same 'mean' or 'sum' loss "
                               "(retain_graph=True) is not supported: its gradients are computed in the forward and "
                               "scaled in place by the first; use reduction='none' and reduce the rows yourself")
        ctx.used = True

    # the loss's gradient, a 0-dim tensor on the device, in the gradients' dtype: t.mul_(g) would run
    # torch's generic elementwise kernel (a broadcast operand: 0.7 ms for a bf16 grad_W of 0.5 GB);
    # the foreach multiply reads the scalar from memory in its vectorized kernel. The gradient is 1,
    # or a power of two under loss scaling or gradient accumulation: exact in any dtype
    grads = []
    for t, need in zip(ctx.saved_tensors, ctx.needs):
        if not need:
            grads.append(None)
        elif traced:
            grads.append(t * grad_loss.to(t.dtype))
        else:
            torch._foreach_mul_([t], grad_loss.to(t.dtype))
            grads.append(t)
    return grads[0], grads[1], None, grads[2], None, None, None, None, None, None, None, None, None


linear_cross_entropy_backward_op = define_op(
    "kernelforge::linear_cross_entropy_backward(Tensor grad_loss, Tensor x, Tensor weight, Tensor target, "
    "Tensor? bias, Tensor lse, SymInt ignore_index, float label_smoothing, float softcap, float z_loss, "
    "int chunk_rows) -> (Tensor, Tensor, Tensor)",
    impl=_backward, fake=_fake_backward, choose=lambda grad_loss, x, weight, *rest: _choose(x, weight))

linear_cross_entropy_op = define_op(
    "kernelforge::linear_cross_entropy(Tensor x, Tensor weight, Tensor target, Tensor? bias, SymInt ignore_index, "
    "float label_smoothing, float softcap, float z_loss, int chunk_rows) -> (Tensor, Tensor)",
    impl=_forward, fake=_fake_forward, choose=_choose, setup_context=_save, backward=_gradient,
    helper_outputs=(1,))

linear_cross_entropy_reduced_op = define_op(
    "kernelforge::linear_cross_entropy_reduced(Tensor x, Tensor weight, Tensor target, Tensor? bias, "
    "SymInt ignore_index, float label_smoothing, float softcap, float z_loss, int chunk_rows, bool mean, "
    "bool grad_x, bool grad_weight, bool grad_bias) -> (Tensor, Tensor, Tensor, Tensor)",
    impl=_forward_with_gradients, fake=_fake_forward_with_gradients, choose=_choose,
    setup_context=_save_gradients, backward=_scaled_gradients, helper_outputs=(1, 2, 3))


@follows_autocast("x", "weight", "bias")  # the logits' GEMMs, as F.linear's; the loss in float32 still
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
    alive at once (default_chunk_rows: about x's own size in logits, 2^26 at least, and the
    weight's size at least when the gradients are computed in the forward). A target outside
    [0, vocab) that is not ignore_index gives a NaN loss.

    A "mean" or "sum" loss computed with a gradient to come (grad mode on, an input requiring a
    gradient) computes its gradients in the forward, where the logits are at hand (three GEMMs,
    the unfused head's count, not four), and holds them until the backward scales them by the
    loss's gradient: so its backward runs once (no retain_graph second pass, no create_graph).
    reduction "none" computes the logits again in the backward.

    Under torch.autocast: x, weight and bias in autocast's dtype (as F.linear's logits would be),
    the loss still accumulated in float32; float32 parameters get float32 gradients."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"kernelforge.{NAME}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    for name, t in (("x", x), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"kernelforge.{NAME}: {name} must be a tensor, got {type(t).__name__}")
    if x.dim() < 1 or tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"kernelforge.{NAME}: target must have x's shape without its last dim, "
                         f"{tuple(x.shape[:-1])}, got {tuple(target.shape)}")
    x2d, target1d = x.reshape(-1, x.shape[-1]), target.reshape(-1)
    needs = [torch.is_grad_enabled() and t is not None and t.requires_grad for t in (x, weight, bias)]
    gradients_in_forward = reduction != "none" and any(needs)  # (the module docstring)
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(x2d.shape[0], weight.shape[0] if weight.dim() == 2 else 1, x2d.shape[1],
                                        gradients_in_forward=gradients_in_forward and needs[1])
    options = (ignore_index, as_float(NAME, "label_smoothing", label_smoothing),
               as_float(NAME, "softcap", softcap or 0.0), as_float(NAME, "z_loss", z_loss), int(chunk_rows))
    if gradients_in_forward:
        return linear_cross_entropy_reduced_op(x2d, weight, target1d, bias, *options, reduction == "mean", *needs)[0]
    loss = linear_cross_entropy_op(x2d, weight, target1d, bias, *options)[0]
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target1d != ignore_index).sum()


__all__ = ["default_chunk_rows", "fused_linear_cross_entropy"]
