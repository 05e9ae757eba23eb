"""DTensor sharding rules of kernelforge's GEMM, attention and cross-entropy ops, forward and
backward (the row-wise ops' are in kernelforge.distributed.sharding; kernelforge.distributed's
`enable()` registers both modules' rules the same way, sharding.enable(RULES here)).

What each rule offers, for one mesh dimension (torch picks the cheapest for the inputs it gets and
redistributes the inputs to it; a placement not offered is never computed on, so a sharding that
would give a wrong result is redistributed away, never fused):

- gemm, out = act(a @ b + bias) + residual (and the gemm / activation-backward calls of its
  backward): all Replicate; a's rows sharded (a Shard on one of its batch dims or its M dim; b
  sharded on the same batch dim where it has that dim whole, else Replicate) -> the output sharded
  on that dim; column parallel (a Replicate, b Shard on N, bias Shard(0), the residual Shard on its
  last dim where it has N there) -> the output Shard on its last dim; row parallel (a Shard on K, b
  Shard on K) -> the output Partial, offered only when the epilogue is linear in the sum: no
  activation (of a partial sum: wrong), no bias and no residual (added on every rank: counted
  world-size times). The helper output preact follows the output (Replicate when it is the empty
  tensor of save_preact=False). fp8: a scale the op computes from an operand's values (fp8_scaling
  "row") stays right where that operand's K dim is whole, so row parallel is not offered; with
  scales passed in or fp8_scaling "tensor" (a max over a sharded operand would be a shard's),
  everything stays Replicate.
- flash_attention and its backward: q, k, v (their gradients, out and lse alike) Shard(0) over the
  batch or Shard(1) over the heads, never over a sequence dim (attention reduces over the keys).
  Heads only where the kv heads divide by the mesh's size (grouped-query attention pairs q's heads
  with k's by index: both must split at group boundaries). attn_mask is sharded with them where it
  has that dim whole, else Replicate (broadcast); cache_seqlens (batch,) Shard(0) with the batch,
  else Replicate. A paged cache (block_table (batch, max_blocks) into page pools k, v (num_blocks,
  kv_heads, page_size, D)): over the batch, q, the table and the lengths Shard(0) and the pools
  Replicate (a rank's rows of the table name pages anywhere in the pool); over the heads, q and the
  pools Shard(1), the table and the lengths Replicate. With a block mask (its tensors lay the batch
  and heads out in tile lists), only Replicate is offered.
- cross_entropy and its backward: the op is per row (the public function reduces with torch ops,
  which DTensor runs itself: a sum of the Shard(0) losses is a Partial, the mean divides it by the
  count of targets, both reduced over all ranks, so the mean of sharded rows is exact). Rows
  Shard(0) with the target, losses and lse Shard(0). Never the class dim: a vocabulary-parallel
  cross-entropy needs another algorithm (a max and a sum of exponentials reduced across ranks).
- fused linear cross-entropy (linear_cross_entropy, its backward and the reduced form): x's rows
  and the target Shard(0), the weight and bias Replicate (their gradients Partial); the per-row
  losses Shard(0); the reduced form's "sum" a Partial loss with grad_x Shard(0), its "mean"
  (divided by each rank's own count of targets: not the global mean) Replicate only. Never the
  vocabulary (a vocab-parallel head needs the cross-rank softmax above).

Inputs are never accepted as Partial: a Partial operand is reduced first (torch redistributes it).
"""
from __future__ import annotations

from typing import Callable

from kernelforge.distributed.sharding import Role, row_op_strategies
from kernelforge.ops import attention, cross_entropy, gemm, linear_cross_entropy
from kernelforge.ops._opdef import Op


def _present(value, t):
    """`value` (a role, a placement) for a tensor argument `t`, None where it is absent."""
    return None if t is None else value


def _broadcast_shape(x, y) -> tuple[int, ...]:
    x, y = (tuple(x), tuple(y)) if len(x) >= len(y) else (tuple(y), tuple(x))
    y = (1,) * (len(x) - len(y)) + y
    return tuple(max(i, j) if 1 in (i, j) else i for i, j in zip(x, y))


def _aligned(t, shape, dim: int):
    """The placement of `t` (a DTensorSpec aligned to `shape` from the right, as broadcasting aligns
    it) when a tensor of `shape` is Shard(dim): sharded on its matching dim where it has it whole,
    else Replicate (it is broadcast there); None for an absent tensor."""
    from torch.distributed.tensor import Replicate, Shard

    if t is None:
        return None
    d = dim - (len(shape) - t.ndim)
    return Shard(d) if d >= 0 and t.shape[d] == shape[dim] else Replicate()


# ----------------------------------------------------------------------------- gemm
def _gemm(a, b, bias, residual, activation, compute, out_dtype, save_preact, scale_a=None, scale_b=None,
          fp8_scaling="row", fp8_fast_accum=False):
    """(out, preact) placements for (a, b, bias, residual, 4 options, scale_a, scale_b, 2 options)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    R = Replicate()
    out_shape = (*_broadcast_shape(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    nd = len(out_shape)
    scales = (_present(R, scale_a), _present(R, scale_b))
    tail = (None,) * 4  # activation, compute, out_dtype, save_preact
    options = (None, None)  # fp8_scaling, fp8_fast_accum

    def strategy(out, a_p, b_p, bias_p, residual_p):
        preact = out if save_preact else R  # save_preact=False: an empty tensor
        return ([out, preact], [a_p, b_p, _present(bias_p, bias), _present(residual_p, residual), *tail, *scales,
                                *options])

    strategies = [strategy(R, R, R, R, R)]
    if compute == "fp8" and (scale_a is not None or scale_b is not None or fp8_scaling != "row"):
        return strategies  # scales of the whole operands: see the module docstring
    for d in range(nd - 1):  # a's rows: a batch dim or M
        if out_shape[d] == 1:
            continue
        b_p = R if d == nd - 2 else _aligned(b, out_shape, d)
        strategies.append(strategy(Shard(d), _aligned(a, out_shape, d), b_p, R, _aligned(residual, out_shape, d)))
    if out_shape[-1] != 1:  # column parallel
        strategies.append(strategy(Shard(nd - 1), R, Shard(b.ndim - 1), Shard(0),
                                   _aligned(residual, out_shape, nd - 1)))
    if activation == "none" and bias is None and residual is None and compute != "fp8":  # row parallel
        strategies.append(strategy(Partial(), Shard(a.ndim - 1), Shard(b.ndim - 2), None, None))
    return strategies


# ----------------------------------------------------------------------------- attention
def _attention_dims(q, k, block_mask) -> list[int]:
    """The dims q, k and v may be sharded on: the batch, the heads where the kv heads split evenly
    over the whole mesh (a dim of it may shard them, and the mesh's dims multiply); none with a
    block mask."""
    if len(block_mask):
        return []
    dims = [0] if q.shape[0] > 1 else []
    if k.shape[1] % q.mesh.size() == 0:
        dims.append(1)
    return dims


def _attention_strategies(q, dims, rows: int, attn_mask, n_block_mask: int, before_mask: int,
                          cache_seqlens=(), outputs: int = 2, block_table=None):
    """row_op_strategies-like: `rows` per-row tensors first (q, k, v...), `before_mask` options, the
    mask, the block mask's tensors, two options, [cache_seqlens, block_table]. With a block_table,
    k and v (rows 1 and 2) are page pools: Replicate over the batch."""
    from torch.distributed.tensor import Replicate, Shard

    R = Replicate()
    strategies = []
    for placement, d in [(R, None)] + [(Shard(d), d) for d in dims]:
        mask = None if attn_mask is None else R if d is None else _aligned(attn_mask, q.shape, d)
        per_row = [placement] * rows
        if block_table is not None and d == 0:
            per_row[1:3] = [R, R]
        inputs = per_row + [None] * before_mask + [mask] + [R] * n_block_mask + [None, None]
        if cache_seqlens != ():
            for t in (cache_seqlens, block_table):
                inputs.append(None if t is None else placement if d == 0 else R)
        strategies.append(([placement] * outputs, inputs))
    return strategies


def _flash_attention(q, k, v, scale, window_left, window_right, attn_mask, block_mask, block_q, block_k,
                     cache_seqlens=None, block_table=None):
    return _attention_strategies(q, _attention_dims(q, k, block_mask), 3, attn_mask, len(block_mask), 3,
                                 cache_seqlens, block_table=block_table)


def _flash_attention_backward(grad_out, q, k, v, out, lse, scale, window_left, window_right, attn_mask, block_mask,
                              block_q, block_k):
    return _attention_strategies(q, _attention_dims(q, k, block_mask), 6, attn_mask, len(block_mask), 3,
                                 outputs=3)


# ----------------------------------------------------------------------------- cross-entropy
def _cross_entropy(logits, target, ignore_index, label_smoothing):
    return row_op_strategies(2, (0,), (Role.ROWS, Role.ROWS, None, None), (Role.ROWS, Role.ROWS))


def _cross_entropy_backward(grad_loss, logits, target, lse, ignore_index, label_smoothing):
    return row_op_strategies(2, (0,), (Role.ROWS,) * 4 + (None, None), (Role.ROWS,))


_LCE_OPTIONS = (None,) * 5  # ignore_index, label_smoothing, softcap, z_loss, chunk_rows
_WEIGHT = Role.UNBATCHED  # read whole by every row: Replicate


def _linear_cross_entropy(x, weight, target, bias, *options):
    inputs = (Role.ROWS, _WEIGHT, Role.ROWS, _present(_WEIGHT, bias)) + _LCE_OPTIONS
    return row_op_strategies(2, (0,), inputs, (Role.ROWS, Role.ROWS))


def _linear_cross_entropy_backward(grad_loss, x, weight, target, bias, lse, *options):
    inputs = (Role.ROWS, Role.ROWS, _WEIGHT, Role.ROWS, _present(_WEIGHT, bias), Role.ROWS) + _LCE_OPTIONS
    # the op returns an empty grad_bias without a bias: Replicate (COLUMN_GRAD's Partial of nothing)
    return row_op_strategies(2, (0,), inputs, (Role.ROWS, Role.COLUMN_GRAD, _WEIGHT if bias is None else Role.COLUMN_GRAD))


def _linear_cross_entropy_reduced(x, weight, target, bias, ignore_index, label_smoothing, softcap, z_loss,
                                  chunk_rows, mean, grad_x, grad_weight, grad_bias):
    """(loss, grad_x, grad_weight, grad_bias): a "sum" over sharded rows is the Partial of each
    rank's sum, its gradients those of the rows (x's sharded, the parameters' Partial); a "mean" is
    not (each rank would divide by its own count): Replicate only. A gradient not asked for is an
    empty tensor: Replicate."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    R = Replicate()
    inputs = [R, R, R, _present(R, bias)] + [None] * 9
    strategies = [([R] * 4, inputs)]
    if not mean:
        outputs = [Partial(), Shard(0) if grad_x else R, Partial() if grad_weight else R,
                   Partial() if grad_bias else R]
        strategies.append((outputs, [Shard(0), R, Shard(0), _present(R, bias)] + [None] * 9))
    return strategies


# Every op a forward here or its backward calls, with its rule (the backward's activation steps are
# sharding.py's).
RULES: dict[Op, Callable] = {
    gemm.gemm_op: _gemm,
    attention.flash_attention_op: _flash_attention,
    attention.flash_attention_backward_op: _flash_attention_backward,
    cross_entropy.cross_entropy_op: _cross_entropy,
    cross_entropy.cross_entropy_backward_op: _cross_entropy_backward,
    linear_cross_entropy.linear_cross_entropy_op: _linear_cross_entropy,
    linear_cross_entropy.linear_cross_entropy_backward_op: _linear_cross_entropy_backward,
    linear_cross_entropy.linear_cross_entropy_reduced_op: _linear_cross_entropy_reduced,
}

__all__ = ["RULES"]
