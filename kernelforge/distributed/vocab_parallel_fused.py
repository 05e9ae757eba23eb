"""The fused linear cross-entropy over a vocabulary-sharded head, and the head's gathered logits:
each rank's GEMMs on its classes, row chunk by row chunk, the logits never whole
(vocab_parallel_fused_linear_cross_entropy); the whole logits for generation and evaluation
(vocab_parallel_logits). The algorithm, its statistics and the logits-based loss they share:
kernelforge/distributed/vocab_parallel.py."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from kernelforge.distributed.vocab_parallel import (FUSED_NAME, Layout, Options, check_options, check_target,
                                                    check_tensor, global_losses, make_layout, mesh_layout_start,
                                                    reduce_rows, replicated, slice_gradient_, unwrap_dtensor)
from kernelforge.ops._common import FLOAT_DTYPES, follows_autocast
from kernelforge.ops.gemm import gemm
from kernelforge.ops.linear_cross_entropy import default_chunk_rows
from kernelforge.reference._accumulation import accumulation_dtype


def walk_chunks(x, weight, bias, target, layout: Layout, opts: Options, chunk_rows: int, *, grad_rows=None,
                lse=None, needs=(False, False, False)):
    """One walk over row chunks: each chunk's local logits z = x_c W^T + b (2 rows_c V_local H
    FLOPs); without `lse`, their losses and lse (one all-gather a chunk); with `grad_rows`, their
    gradient dz in place over z and the chunk's gradients (dx partial: 2 rows_c V_local H FLOPs;
    dW += dz^T x_c: the same again). Returns (losses, lse, grad_x, grad_weight, grad_bias), the
    gradients None where not asked for; grad_x all-reduced over the group."""
    acc = accumulation_dtype(x.dtype)
    n_rows = x.shape[0]
    losses = None
    if lse is None:
        losses = torch.empty(n_rows, dtype=acc, device=x.device)
        lse = torch.empty_like(losses)
    need_x, need_weight, need_bias = needs if grad_rows is not None else (False, False, False)
    # float32 partial sums for half x: the all-reduce then rounds dx once, not once a rank
    grad_x = torch.empty(x.shape, dtype=acc, device=x.device) if need_x else None
    grad_weight = None
    grad_bias = torch.zeros(weight.shape[0], dtype=acc, device=x.device) if need_bias else None
    for first in range(0, n_rows, chunk_rows):
        rows = slice(first, min(first + chunk_rows, n_rows))
        x_c, target_c = x[rows], target[rows]
        z = gemm(x_c, weight.t(), bias=bias)  # W read transposed in place
        if losses is not None:
            losses[rows], lse[rows] = global_losses(z, target_c, layout, opts)
        if grad_rows is None:
            continue
        dz = slice_gradient_(grad_rows[rows], z, target_c, lse[rows], layout, opts)
        if need_x:
            grad_x[rows] = gemm(dz, weight, out_dtype=acc)
        if need_weight and grad_weight is None:
            grad_weight = gemm(dz.t(), x_c)
        elif need_weight:  # in place: float32 inside, rounded to W's dtype once a chunk
            grad_weight.addmm_(dz.t(), x_c)
        if need_bias:
            grad_bias += dz.sum(0, dtype=acc)
    if need_x:
        if layout.world > 1:  # each rank's dz W_local sums its classes only: dx = the SUM over ranks
            dist.all_reduce(grad_x, group=layout.group)
        grad_x = grad_x.to(x.dtype)
    if need_weight and grad_weight is None:  # no rows
        grad_weight = torch.zeros_like(weight)
    if need_bias:
        grad_bias = grad_bias.to(bias.dtype)
    return losses, lse, grad_x, grad_weight, grad_bias


class FusedRowLosses(torch.autograd.Function):
    """Per-row losses; the backward computes the logits again, chunk by chunk."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, layout, opts, chunk_rows):
        losses, lse, *_ = walk_chunks(x, weight, bias, target, layout, opts, chunk_rows)
        ctx.save_for_backward(x, weight, bias, target, lse)
        ctx.layout, ctx.opts, ctx.chunk_rows = layout, opts, chunk_rows
        ctx.mark_non_differentiable(lse)
        return losses

    @staticmethod
    def backward(ctx, grad_rows):
        x, weight, bias, target, lse = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:3])
        _, _, grad_x, grad_weight, grad_bias = walk_chunks(x, weight, bias, target, ctx.layout, ctx.opts,
                                                           ctx.chunk_rows, grad_rows=grad_rows.contiguous(), lse=lse,
                                                           needs=needs)
        return grad_x, grad_weight, grad_bias, None, None, None, None


class FusedReducedLoss(torch.autograd.Function):
    """The "mean" or "sum" loss with its gradients computed in the forward (of a loss gradient of
    1); the backward scales them by the loss's gradient (out of place: a second backward through
    the same loss stays right, at the cost of one more gradient-sized buffer)."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, layout, opts, chunk_rows, mean):
        acc = accumulation_dtype(x.dtype)
        count = (target != opts.ignore_index).sum()
        # each row's gradient: 1 for the sum, 1 / count for the mean (inf with every row ignored:
        # the kernels zero an ignored row's gradient, as the unfused mean's); a stride-0 view
        scale = 1.0 / count.to(acc) if mean else torch.ones((), dtype=acc, device=x.device)
        needs = tuple(ctx.needs_input_grad[:3])
        losses, _, *grads = walk_chunks(x, weight, bias, target, layout, opts, chunk_rows,
                                        grad_rows=scale.expand(x.shape[0]), needs=needs)
        ctx.save_for_backward(*grads)
        loss = losses.sum()
        return loss / count if mean else loss

    @staticmethod
    def backward(ctx, grad_loss):
        grads = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors]
        return (*grads, None, None, None, None, None)


@follows_autocast("x", "weight", "bias")
def vocab_parallel_fused_linear_cross_entropy(x, weight, target, bias=None, group=None, *,
                                              vocab_start: Optional[int] = None, ignore_index: int = -100,
                                              reduction: str = "mean", label_smoothing: float = 0.0,
                                              softcap: Optional[float] = None, z_loss: float = 0.0,
                                              chunk_rows: Optional[int] = None) -> torch.Tensor:
    """kernelforge.fused_linear_cross_entropy(x, full weight, target, full bias) with the head's
    weight split over the vocabulary across the group, never the whole logits.

    x: (..., H), the same on every rank (or a Replicate DTensor); weight: this rank's (V_local, H)
    rows [vocab_start, vocab_start + V_local) of the head, x's dtype (or a DTensor placed Shard(0)
    on a 1-D mesh: the mesh then gives group and vocab_start, and the loss is a Replicate DTensor);
    bias: this rank's (V_local,) or None; target: GLOBAL class ids shaped like x without its last
    dim. ignore_index, reduction, label_smoothing, softcap (c tanh(z / c) first), z_loss
    (+ z_loss lse^2 a row) and chunk_rows (rows of local logits alive at once) as
    kernelforge.fused_linear_cross_entropy's. Gradients: dx summed over the ranks (every rank gets
    the full dx), dW and db of this rank's rows only. A "mean" or "sum" loss with a gradient to
    come computes its gradients in the forward, so its backward needs no communication. Under
    torch.autocast: x, weight and bias in autocast's dtype, as kernelforge.fused_linear_cross_entropy's."""
    check_options(FUSED_NAME, reduction, label_smoothing, ignore_index)
    for arg, t in (("x", x), ("weight", weight)):
        check_tensor(FUSED_NAME, arg, t, FLOAT_DTYPES)
    global_classes = weight.shape[0] if weight.dim() == 2 else 0
    weight, mesh = unwrap_dtensor(FUSED_NAME, "weight", weight, 0)
    x, _ = unwrap_dtensor(FUSED_NAME, "x", x, None)
    target, _ = unwrap_dtensor(FUSED_NAME, "target", target, None)
    if bias is not None:
        check_tensor(FUSED_NAME, "bias", bias, FLOAT_DTYPES)
        bias, _ = unwrap_dtensor(FUSED_NAME, "bias", bias, 0)
    if weight.dim() != 2:
        raise ValueError(f"kernelforge.{FUSED_NAME}: weight must be 2-D, this rank's (V_local, hidden) rows of the "
                         f"head, got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"kernelforge.{FUSED_NAME}: x must be (..., {weight.shape[1]}) for weight of shape "
                         f"{tuple(weight.shape)}, got {tuple(x.shape)}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"kernelforge.{FUSED_NAME}: x, weight and bias must share a dtype, got x {x.dtype}, weight "
                        f"{weight.dtype}" + ("" if bias is None else f", bias {bias.dtype}"))
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"kernelforge.{FUSED_NAME}: bias must be ({weight.shape[0]},), one a row of this rank's "
                         f"weight, got {tuple(bias.shape)}")
    for arg, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"kernelforge.{FUSED_NAME}: {arg} must be on x's device {x.device}, got {t.device}")
    check_target(FUSED_NAME, target, x.shape[:-1], x.device)
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap >= 0):
        raise ValueError(f"kernelforge.{FUSED_NAME}: softcap must be a number > 0 (None or 0: no cap), got {softcap!r}")
    if not isinstance(z_loss, (int, float)) or not z_loss >= 0:
        raise ValueError(f"kernelforge.{FUSED_NAME}: z_loss must be a number >= 0, got {z_loss!r}")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"kernelforge.{FUSED_NAME}: chunk_rows must be an int >= 1 (or None), got {chunk_rows!r}")
    if mesh is not None:
        if group is not None or vocab_start is not None:
            raise ValueError(f"kernelforge.{FUSED_NAME}: with a DTensor weight the mesh gives the group and "
                             f"vocab_start: pass neither (got group={group!r}, vocab_start={vocab_start!r})")
        group, vocab_start = mesh.get_group(), mesh_layout_start(mesh, global_classes)

    x2d, target1d = x.reshape(-1, x.shape[-1]), target.reshape(-1).contiguous()
    needs = [torch.is_grad_enabled() and t is not None and t.requires_grad for t in (x, weight, bias)]
    gradients_in_forward = reduction != "none" and any(needs)
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(x2d.shape[0], max(weight.shape[0], 1), x2d.shape[1],
                                        gradients_in_forward=gradients_in_forward and needs[1])
    layout = make_layout(FUSED_NAME, group, vocab_start, weight.shape[0], x.device)
    opts = Options(ignore_index, float(label_smoothing), float(softcap or 0.0), float(z_loss))
    if gradients_in_forward:
        loss = FusedReducedLoss.apply(x2d, weight, bias, target1d, layout, opts, chunk_rows, reduction == "mean")
    else:
        loss = reduce_rows(FusedRowLosses.apply(x2d, weight, bias, target1d, layout, opts, chunk_rows), target,
                           reduction, ignore_index)
    return replicated(loss, mesh)


def vocab_parallel_logits(x: torch.Tensor, weight, bias=None) -> torch.Tensor:
    """x @ W^T + b, the whole (..., V) logits, for a head whose weight (and bias) is a DTensor placed
    Shard(0) on a 1-D mesh (vocabulary-parallel): each rank's GEMM on its rows, then one all-gather
    of the logits over the vocabulary (for generation and evaluation; training's loss takes
    vocab_parallel_fused_linear_cross_entropy and never gathers them). x is the same plain tensor
    on every rank; its gradient, a partial sum over each rank's classes, is summed across them."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    local_weight, mesh = unwrap_dtensor("vocab_parallel_logits", "weight", weight, 0)
    if mesh is None:
        raise ValueError("kernelforge.vocab_parallel_logits: weight must be a DTensor placed (Shard(0),) on a 1-D "
                         f"mesh, got a {type(weight).__name__}")
    local_bias = unwrap_dtensor("vocab_parallel_logits", "bias", bias, 0)[0] if bias is not None else None
    x = DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
    local = torch.nn.functional.linear(x, local_weight, local_bias)
    shape = (*local.shape[:-1], weight.shape[0])
    logits = DTensor.from_local(local, mesh, [Shard(local.dim() - 1)], run_check=False, shape=shape,
                                stride=torch.empty(shape, device="meta").stride())
    return logits.full_tensor()


__all__ = ["vocab_parallel_fused_linear_cross_entropy", "vocab_parallel_logits"]
