"""Cross-entropy over a vocabulary sharded across the ranks of a process group (a tensor-parallel
language-model head): each rank holds the classes [vocab_start, vocab_start + V_local) of every
row, and the loss is computed without ever gathering the (rows x V) logits.

    loss = vocab_parallel_cross_entropy(local_logits, target, group)            # (rows, V_local)
    loss = vocab_parallel_fused_linear_cross_entropy(x, local_weight, target, group=group)

The algorithm, a row at a time (z: the row's logits, capped c tanh(z / c) where softcap is set):

1. Each rank reduces its own slice to a few numbers: lse_r = log sum_{c in slice} exp(z_c) (the
   cross-entropy forward kernel's lse: one read of the slice's logits), the target's logit where
   the target is in the slice (0 elsewhere: exactly one rank holds it), and with label smoothing
   the slice's sum of logits (a second read, only then).
2. One all-gather of those (rows, 2 or 3) numbers, plus one row with the rank's (V_local,
   vocab_start) that gives every rank the vocabulary's size and checks that the slices tile it.
   Why an all-gather of the local lse and not an all-reduce MAX then an all-reduce SUM of
   [exp(lse_r - max), target logit, logit sum]: both move O(rows) floats, against the rows x V
   logits never moved, and at these sizes a collective costs mostly its latency: the all-gather
   is ONE collective where the all-reduces are two, the second waiting for the first. Bytes a rank
   receives (4-byte floats, ring all-reduce): all-gather (p - 1) rows k 4, all-reduces
   2 (p - 1) / p rows (k + 1) 4. At p = 2 the all-gather is also fewer bytes (4096 rows, k = 2:
   32 KiB against 48 KiB); at p = 8, k = 3 it is more (336 KiB against 112 KiB), a few microseconds
   of NVLink, still less than the second collective's latency.
3. Every rank then computes the same loss from the gathered numbers: lse = logsumexp_r lse_r,
   loss = lse - z_t (label smoothing: (1 - eps)(lse - z_t) + eps (lse - sum_c z_c / V); z-loss:
   + z_loss lse^2), 0 for an ignored row, NaN for a target outside [0, V).
4. The gradient of the rank's logits needs only the global lse and the target (replicated):
   g (softmax(z)_c - (1 - eps)[c == t] - eps / V), the cross-entropy kernels' slice backward at
   first = vocab_start. No communication in the backward of the logits.

The fused form (x @ W_local^T + b_local, chunks of rows, kf.gemm) computes per row chunk the
local logits (2 rows_c V_local H FLOPs), their stats, one all-gather, the loss, and for a "mean"
or "sum" loss with a gradient to come the chunk's gradients right away (as
kernelforge.fused_linear_cross_entropy does: 3 GEMMs, not 4): dz in place over the logits,
dx_partial = dz W_local, dW_local += dz^T x_c, db_local += colsum(dz). x is replicated, so every
rank's dz W_local is a partial sum over its classes: dx is all-reduced (SUM) once a call, in
float32 for half-precision x (rows H 4 bytes, 2 (p - 1) / p of that sent by each rank in a ring)
so that it is rounded once, not once a rank. dW_local and db_local need no communication.
Reduction "none" (and a loss computed without gradient) keeps only the lse a row; its backward
computes each chunk's logits again (no communication but dx's all-reduce).

softcap and z_loss are as kernelforge.fused_linear_cross_entropy defines them; both are per
element or per row of the global lse, so they work across ranks unchanged.

The fused form and the head's gathered logits live in kernelforge/distributed/vocab_parallel_fused.py.

A DTensor input on a 1-D mesh gives the group and the rank's vocab_start (DTensor's Shard split:
ceil(V / p) classes a rank, the last ones fewer); the loss then comes back as a Replicate DTensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from kernelforge import backends
from kernelforge.ops._common import FLOAT_DTYPES
from kernelforge.ops.cross_entropy import OP as CROSS_ENTROPY_OP
from kernelforge.ops.cross_entropy import REDUCTIONS, TARGET_DTYPES
from kernelforge.reference._accumulation import accumulation_dtype

CE_NAME = "vocab_parallel_cross_entropy"
FUSED_NAME = "vocab_parallel_fused_linear_cross_entropy"


class Options(NamedTuple):
    ignore_index: int
    label_smoothing: float
    softcap: float  # 0: none
    z_loss: float


@dataclass
class Layout:
    """Where the rank's classes lie: name (the public function's, for errors), group (None: the
    default group, or no process group at all), world (ranks in it), start (the rank's first
    class), local (its classes), vocab (all ranks' classes, known after the first all-gather)."""
    name: str
    group: object
    world: int
    start: int
    local: int
    vocab: Optional[int] = None


def kernels(logits: torch.Tensor):
    """The cross-entropy backend's row launchers (forward_rows, slice_backward_) for these logits."""
    return backends.select(CROSS_ENTROPY_OP, logits).implementation.launchers()


# ----------------------------------------------------------------------------- the group and layout
def group_size(group) -> int:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1  # no process group: one rank holding the whole vocabulary
    return dist.get_world_size(group)


def make_layout(name: str, group, vocab_start: Optional[int], local: int, device: torch.device) -> Layout:
    world = group_size(group)
    if vocab_start is None:
        if world == 1:
            vocab_start = 0
        else:  # one all-gather of one int64 a rank: the slices in rank order
            sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
            dist.all_gather(sizes, torch.tensor([local], dtype=torch.int64, device=device), group=group)
            vocab_start = int(sum(s.item() for s in sizes[:dist.get_rank(group)]))
    elif not isinstance(vocab_start, int) or isinstance(vocab_start, bool) or vocab_start < 0:
        raise ValueError(f"kernelforge.{name}: vocab_start must be an int >= 0 (the rank's first class), "
                         f"got {vocab_start!r}")
    return Layout(name, group, world, vocab_start, local)


def resolve_vocab(name: str, meta: torch.Tensor) -> int:
    """The vocabulary's size from every rank's (local classes, first class) (float: exact below
    2^24 classes), after checking that the ranks' slices tile [0, V) without gap or overlap: the
    same check, and the same error, on every rank (they all see the same numbers)."""
    slices = sorted((int(s), int(n)) for n, s in meta.tolist() if int(n) > 0)
    end = 0
    for start, size in slices:
        if start != end:
            raise ValueError(f"kernelforge.{name}: the ranks' vocabulary slices (vocab_start, classes) "
                             f"{[(int(s), int(n)) for n, s in meta.tolist()]} do not tile [0, V): a gap or an "
                             f"overlap at class {min(start, end)}; check vocab_start on each rank")
        end = start + size
    if end == 0:
        raise ValueError(f"kernelforge.{name}: no rank holds any class (every logits / weight slice is empty)")
    return end


# ----------------------------------------------------------------------------- forward statistics
def slice_stats(z: torch.Tensor, target: torch.Tensor, layout: Layout, opts: Options) -> torch.Tensor:
    """(rows, k) in the accumulation dtype: the slice's lse, the target's logit where this rank
    holds it (else 0), with label smoothing the slice's sum of logits (all capped)."""
    acc = accumulation_dtype(z.dtype)
    rows, width = z.shape
    if width:
        # the forward kernel's lse (one read of the slice, softcap applied in it): every row marked
        # ignored, as its loss (of a slice, not a row) is not wanted
        marks = torch.full((rows,), opts.ignore_index, dtype=torch.int64, device=z.device)
        lse = kernels(z).cross_entropy_forward_rows(z, marks, opts.ignore_index, 0.0, opts.softcap, 0.0)[1].to(acc)
    else:
        lse = torch.full((rows,), float("-inf"), dtype=acc, device=z.device)
    local = target.long() - layout.start
    here = (local >= 0) & (local < width) & (target.long() != opts.ignore_index)
    picked = z.gather(1, local.clamp(0, max(width - 1, 0))[:, None])[:, 0].to(acc) if width else lse.new_zeros(rows)
    columns = [lse, torch.where(here, cap(picked, opts.softcap), 0.0)]
    if opts.label_smoothing:  # a second read of the slice, only for smoothing
        columns.append(cap(z.to(acc), opts.softcap).sum(1))
    return torch.stack(columns, 1)


def cap(z: torch.Tensor, softcap: float) -> torch.Tensor:
    return softcap * torch.tanh(z / softcap) if softcap else z


def global_losses(z: torch.Tensor, target: torch.Tensor, layout: Layout, opts: Options):
    """(loss, lse) a row, (rows,) each in the accumulation dtype, of the rows whose logits are
    split over the group; one all-gather of (rows + 1) x k floats (the module docstring)."""
    stats = slice_stats(z, target, layout, opts)
    meta = stats.new_zeros(1, stats.shape[1])
    meta[0, 0], meta[0, 1] = layout.local, layout.start
    mine = torch.cat([stats, meta])
    if layout.world == 1:
        gathered = mine[None]
    else:
        parts = [torch.empty_like(mine) for _ in range(layout.world)]
        dist.all_gather(parts, mine, group=layout.group)
        gathered = torch.stack(parts)  # (p, rows + 1, k)
    if layout.vocab is None:  # the first chunk: a host read of the slices (one sync a call, not a chunk)
        layout.vocab = resolve_vocab(layout.name, gathered[:, -1, :2])
    stats = gathered[:, :-1]
    top = stats[..., 0].amax(0)
    shift = torch.where(top == float("-inf"), 0.0, top)  # a +inf logit gives NaN (inf - inf), as torch's
    lse = shift + torch.log(torch.exp(stats[..., 0] - shift).sum(0))
    loss = lse - stats[..., 1].sum(0)
    eps = opts.label_smoothing
    if eps:
        loss = (1 - eps) * loss + eps * (lse - stats[..., 2].sum(0) / layout.vocab)
    if opts.z_loss:
        loss = loss + opts.z_loss * lse * lse
    t = target.long()
    ignored = t == opts.ignore_index
    bad = ~ignored & ((t < 0) | (t >= layout.vocab))
    return torch.where(ignored, 0.0, loss).masked_fill_(bad, float("nan")), lse


def slice_gradient_(grad_rows, z, target, lse, layout: Layout, opts: Options) -> torch.Tensor:
    """The gradient of sum_i grad_rows_i loss_i over this rank's classes, written over z."""
    return kernels(z).cross_entropy_slice_backward_(grad_rows, z, target, lse, layout.start, layout.vocab,
                                                    opts.ignore_index, opts.label_smoothing, opts.softcap,
                                                    opts.z_loss)


# ----------------------------------------------------------------------------- cross-entropy of logits
class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row losses of (rows, V_local) logits; the backward: the logits' gradient, no communication."""

    @staticmethod
    def forward(ctx, logits, target, layout, opts):
        z = logits.contiguous()
        loss, lse = global_losses(z, target, layout, opts)
        ctx.save_for_backward(z, target, lse)
        ctx.layout, ctx.opts = layout, opts
        return loss

    @staticmethod
    def backward(ctx, grad_rows):
        z, target, lse = ctx.saved_tensors
        grad = slice_gradient_(grad_rows.contiguous(), z.clone(), target, lse, ctx.layout, ctx.opts)
        return grad, None, None, None


def unwrap_dtensor(name: str, arg: str, t, shard_dim: Optional[int]):
    """(local tensor, mesh or None): a DTensor on a 1-D mesh placed Shard(shard_dim) (None:
    Replicate) becomes its local tensor (differentiably); a plain tensor passes."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # torch without DTensor: only plain tensors
        return t, None
    if not isinstance(t, DTensor):
        return t, None
    expected = Replicate() if shard_dim is None else Shard(shard_dim % t.dim())
    if t.device_mesh.ndim != 1 or len(t.placements) != 1 or t.placements[0] != expected:
        raise ValueError(f"kernelforge.{name}: a DTensor {arg} must be on a 1-D mesh placed ({expected},), got mesh "
                         f"of {t.device_mesh.ndim} dims placed {tuple(t.placements)}")
    return t.to_local(), t.device_mesh


def mesh_layout_start(mesh, global_size: int) -> int:
    """The rank's first class under DTensor's Shard split (torch.chunk: ceil(V / p) a rank)."""
    per_rank = -(-global_size // mesh.size())
    return min(mesh.get_local_rank() * per_rank, global_size)


def replicated(loss: torch.Tensor, mesh):
    if mesh is None:
        return loss
    from torch.distributed.tensor import DTensor, Replicate
    return DTensor.from_local(loss, mesh, [Replicate()], run_check=False)


def check_options(name: str, reduction, label_smoothing, ignore_index) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"kernelforge.{name}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"kernelforge.{name}: ignore_index must be an int, got {ignore_index!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"kernelforge.{name}: label_smoothing must be a number in [0, 1], got {label_smoothing!r}")


def check_tensor(name: str, arg: str, t, dtypes=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"kernelforge.{name}: {arg} must be a tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"kernelforge.{name}: {arg} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def check_target(name: str, target: torch.Tensor, rows_shape, device) -> None:
    check_tensor(name, "target", target, TARGET_DTYPES)
    if tuple(target.shape) != tuple(rows_shape):
        raise ValueError(f"kernelforge.{name}: target must hold one GLOBAL class id a row, shape {tuple(rows_shape)}, "
                         f"got {tuple(target.shape)}")
    if target.device != device:
        raise ValueError(f"kernelforge.{name}: target must be on {device}, got {target.device}")


def reduce_rows(loss: torch.Tensor, target: torch.Tensor, reduction: str, ignore_index: int) -> torch.Tensor:
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target.reshape(-1) != ignore_index).sum()  # 0 / 0 = NaN with every row ignored, as torch


def vocab_parallel_cross_entropy(logits, target, group=None, *, vocab_start: Optional[int] = None,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """F.cross_entropy(gathered logits, target) from this rank's slice of the classes.

    logits: (..., V_local) in float16/bfloat16/float32/float64, the classes [vocab_start,
    vocab_start + V_local) of every row; or a DTensor placed Shard(-1) on a 1-D mesh (then the mesh
    gives group and vocab_start, and the loss is a Replicate DTensor). target: the GLOBAL class ids,
    logits' shape without its last dim, int64 or int32, the same on every rank. vocab_start: None
    gathers every rank's V_local once (the slices in rank order). ignore_index, reduction ("mean"
    over the rows not ignored, "sum", "none") and label_smoothing as in torch. The loss is float32
    (float64 for float64 logits), the same on every rank; the gradient is of the local logits only
    (no communication in the backward). A target outside [0, V) that is not ignore_index gives NaN.
    """
    check_options(CE_NAME, reduction, label_smoothing, ignore_index)
    check_tensor(CE_NAME, "logits", logits, FLOAT_DTYPES)
    global_classes = logits.shape[-1] if logits.dim() else 0
    local, mesh = unwrap_dtensor(CE_NAME, "logits", logits, -1)
    target, _ = unwrap_dtensor(CE_NAME, "target", target, None)
    if local.dim() < 1:
        raise ValueError(f"kernelforge.{CE_NAME}: logits must be (..., V_local), got a 0-dim tensor")
    check_target(CE_NAME, target, local.shape[:-1], local.device)
    if mesh is not None:
        if group is not None or vocab_start is not None:
            raise ValueError(f"kernelforge.{CE_NAME}: with DTensor logits the mesh gives the group and vocab_start: "
                             f"pass neither (got group={group!r}, vocab_start={vocab_start!r})")
        group, vocab_start = mesh.get_group(), mesh_layout_start(mesh, global_classes)
    layout = make_layout(CE_NAME, group, vocab_start, local.shape[-1], local.device)
    opts = Options(ignore_index, float(label_smoothing), 0.0, 0.0)
    loss = VocabParallelCrossEntropy.apply(local.reshape(-1, local.shape[-1]), target.reshape(-1), layout, opts)
    return replicated(reduce_rows(loss, target, reduction, ignore_index), mesh)


__all__ = ["vocab_parallel_cross_entropy"]
