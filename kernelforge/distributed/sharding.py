"""DTensor sharding rules of kernelforge's row-wise and elementwise ops, forward and backward, so
that under tensor / sequence parallelism they run on each rank's local shard without a gather.

Every op here computes each row of its inputs (or each element) independently: softmax over its
dim, the norms over the trailing normalized dims, the activations and gated activations
elementwise, rope per (batch, head). A rule lists the placements it accepts, for one mesh
dimension: everything Replicate, or the per-row tensors all Shard(d) on one dim d the op does not
reduce over. torch (torch.distributed.tensor.experimental.register_sharding) picks the cheapest
of them for the inputs it gets, redistributes the inputs to it and calls the op on the local
shards. The other tensors follow the rows' placement by their role (`Role`):
- per-column parameters (a norm's weight / bias, an activation's bias) are Replicate, or Shard(0)
  when an elementwise op's rows are sharded on their last dim;
- their gradients are Partial (each rank summed its own rows) when the rows are sharded on
  another dim; DTensor reduces them where they are used (the weight's .grad, an optimizer step);
- rope's per-token angles and position ids are Replicate, or Shard(0) with q and k sharded over
  the batch when they have a row per batch element.
The per-row inputs are never accepted as Partial: an unreduced input (a row-parallel matmul's
output) is reduced first (torch redistributes it), since a norm or an activation of a partial sum
is not the partial sum of the results.

Registration: `enable()`, idempotent, which importing kernelforge.distributed calls (its enable()
adds kernelforge.distributed.matmul_sharding's rules: gemm, attention, cross-entropy). Not at
`import kernelforge`: torch.distributed.tensor takes a while to import, is absent from some torch
builds, and most users never build a DTensor (tests/test_structure.py keeps the import light).
Whoever builds DTensors has torch.distributed imported already, and one `import
kernelforge.distributed` then costs nothing more. Where torch.distributed is unavailable,
enable() registers nothing and returns False.
"""
from __future__ import annotations

import enum
import functools
from typing import Callable, Optional, Sequence

from kernelforge.ops import activations, gated_activations, norms, rope, softmax
from kernelforge.ops._opdef import Op


class Role(enum.Enum):
    """What a tensor argument or output is to a row op, which fixes its placement from the rows'."""
    ROWS = "shaped like the rows (or their statistics, the rows without the reduced trailing dims)"
    COLUMNS = "a per-column parameter along the rows' last dim"
    COLUMN_GRAD = "the gradient of a per-column parameter: a sum over the rows"
    BATCHED = "one entry per batch element (rope's angles and position ids with a batch dim)"
    UNBATCHED = "the same for every batch element (rope's angles as (seq, rot) or (1, seq, rot))"


def _placement(role: Optional[Role], rows, ndim: int):
    """The placement of a tensor of `role` when the rows (of `ndim` dims) are placed as `rows`;
    None for an argument that is no tensor (or an absent optional one)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if role is None:
        return None
    if role is Role.ROWS or isinstance(rows, Replicate):
        return rows
    if role is Role.COLUMNS:
        return Shard(0) if rows.dim == ndim - 1 else Replicate()
    if role is Role.COLUMN_GRAD:
        return Shard(0) if rows.dim == ndim - 1 else Partial()
    if role is Role.BATCHED:
        return rows if rows.dim == 0 else Replicate()
    return Replicate()  # UNBATCHED


def row_op_strategies(ndim: int, shard_dims: Sequence[int], inputs: Sequence[Optional[Role]],
                      outputs: Sequence[Optional[Role]]) -> list[tuple[list, list]]:
    """The (output placements, input placements) a row op accepts on one mesh dim: all Replicate,
    or the rows Shard(d) for each d of `shard_dims`, the other tensors by their roles. `inputs`
    has one role per argument (None for a non-tensor or absent one), `outputs` one per output."""
    from torch.distributed.tensor import Replicate, Shard

    strategies = []
    for rows in [Replicate()] + [Shard(d) for d in shard_dims]:
        strategies.append(([_placement(r, rows, ndim) for r in outputs],
                           [_placement(r, rows, ndim) for r in inputs]))
    return strategies


def _present(role: Role, t) -> Optional[Role]:
    return None if t is None else role


def _all_but(ndim: int, *reduced: int) -> list[int]:
    return [d for d in range(ndim) if d not in {r % ndim for r in reduced}]


# ----------------------------------------------------------------------------- the ops' rules
# Each takes the op's arguments (tensors as DTensorSpecs, whose .ndim and .shape are global) and
# returns row_op_strategies(...).
def _softmax(x, dim):
    return row_op_strategies(x.ndim, _all_but(x.ndim, dim), (Role.ROWS, None), (Role.ROWS,))


def _softmax_backward(grad_output, output, dim):
    return row_op_strategies(output.ndim, _all_but(output.ndim, dim), (Role.ROWS, Role.ROWS, None), (Role.ROWS,))


def _norm(residual: bool, rms: bool):
    """layer_norm / rms_norm and their add_ forms: (y, [residual_out], [mean], rstd), the
    statistics sharded as the rows (their dims are the rows' leading ones)."""
    def rule(x, *args):
        normalized_shape, weight, bias = args[residual:residual + 3]  # after x and the residual
        inputs = (Role.ROWS,) + (Role.ROWS,) * residual + (None, _present(Role.COLUMNS, weight),
                                                           _present(Role.COLUMNS, bias), None, None)
        outputs = (Role.ROWS,) * (1 + residual + (not rms) + 1)
        return row_op_strategies(x.ndim, range(x.ndim - len(normalized_shape)), inputs, outputs)

    return rule


def _norm_backward(rms: bool):
    """layer_norm_backward / rms_norm_backward: [grad_h, grad_weight?, grad_bias?], the parameters'
    gradients only when weight_grads is set and the parameter exists (as the op returns them)."""
    def rule(grad_y, grad_residual, h, normalized_shape, weight, bias, *rest):
        stats, weight_grads = rest[:-3], rest[-1]
        inputs = (Role.ROWS, _present(Role.ROWS, grad_residual), Role.ROWS, None, _present(Role.COLUMNS, weight),
                  _present(Role.COLUMNS, bias)) + (Role.ROWS,) * len(stats) + (None, None, None)
        outputs = [Role.ROWS] + [Role.COLUMN_GRAD for p in (weight, bias) if weight_grads and p is not None]
        return row_op_strategies(h.ndim, range(h.ndim - len(normalized_shape)), inputs, outputs)

    return rule


def _activation(x, bias, kind):
    return row_op_strategies(x.ndim, range(x.ndim), (Role.ROWS, _present(Role.COLUMNS, bias), None), (Role.ROWS,))


def _activation_backward(grad_output, x, bias, kind):
    inputs = (Role.ROWS, Role.ROWS, _present(Role.COLUMNS, bias), None)
    return row_op_strategies(x.ndim, range(x.ndim), inputs, (Role.ROWS,))


def _bias_activation_backward(grad_output, x, bias, kind):
    inputs = (Role.ROWS, Role.ROWS, Role.COLUMNS, None)
    return row_op_strategies(x.ndim, range(x.ndim), inputs, (Role.ROWS, Role.COLUMN_GRAD))


def _elementwise(n_inputs: int, n_outputs: int):
    """An op of tensors shaped alike (and a trailing non-tensor kind), any dim sharded."""
    def rule(*args):
        return row_op_strategies(args[0].ndim, range(args[0].ndim), (Role.ROWS,) * n_inputs + (None,),
                                 (Role.ROWS,) * n_outputs)

    return rule


def _packed(gate_up, kind):
    # [gate | up] along the last dim: a shard of it would pair the wrong halves
    return row_op_strategies(gate_up.ndim, _all_but(gate_up.ndim, -1), (Role.ROWS, None), (Role.ROWS,))


def _packed_backward(grad_output, gate_up, kind):
    return row_op_strategies(gate_up.ndim, _all_but(gate_up.ndim, -1), (Role.ROWS, Role.ROWS, None), (Role.ROWS,))


def _rope(q, k, cos, sin, position_ids, unsqueeze_dim, transpose):
    """q and k sharded alike over the batch or the heads (rope mixes neither); the angles follow
    a batch sharding where they have a row per batch element."""
    batch = q.shape[0]
    if position_ids is None:
        angles = Role.BATCHED if cos.ndim == 3 and cos.shape[0] == batch != 1 else Role.UNBATCHED
        positions = None
    else:  # the angles are (positions, rot) tables any token may index
        angles = Role.UNBATCHED
        positions = Role.BATCHED if position_ids.ndim == 2 and position_ids.shape[0] == batch != 1 else Role.UNBATCHED
    heads_dim = unsqueeze_dim % 4
    inputs = (Role.ROWS, Role.ROWS, angles, angles, positions, None, None)
    return row_op_strategies(4, (0, heads_dim), inputs, (Role.ROWS, Role.ROWS))


# Every op a forward here or its backward calls, with its rule.
RULES: dict[Op, Callable] = {
    softmax.softmax_op: _softmax,
    softmax.log_softmax_op: _softmax,
    softmax.softmax_backward_op: _softmax_backward,
    softmax.log_softmax_backward_op: _softmax_backward,
    norms.layer_norm_op: _norm(residual=False, rms=False),
    norms.add_layer_norm_op: _norm(residual=True, rms=False),
    norms.rms_norm_op: _norm(residual=False, rms=True),
    norms.add_rms_norm_op: _norm(residual=True, rms=True),
    norms.layer_norm_backward_op: _norm_backward(rms=False),
    norms.rms_norm_backward_op: _norm_backward(rms=True),
    activations.activation_op: _activation,
    activations.activation_backward_op: _activation_backward,
    activations.bias_activation_backward_op: _bias_activation_backward,
    gated_activations.gated_activation_op: _elementwise(2, 1),
    gated_activations.gated_activation_backward_op: _elementwise(3, 2),
    gated_activations.gated_activation_backward_and_product_op: _elementwise(3, 3),
    gated_activations.gated_activation_packed_op: _packed,
    gated_activations.gated_activation_packed_backward_op: _packed_backward,
    rope.rope_op: _rope,
}


# ----------------------------------------------------------------------------- registration
def _first_non_tensor(overload) -> int:
    for i, arg in enumerate(overload._schema.arguments):
        if "Tensor" not in str(arg.type):
            return i
    return len(overload._schema.arguments)


def _list_output_strategy(rule: Callable, op_schema):
    """register_sharding's strategy for an op returning Tensor[] (the norms' backward): it gives a
    list output one placement, where each of its tensors needs its own (grad_h sharded, the
    parameters' gradients Partial). The same expansion over the mesh, with one output spec per
    tensor of the list."""
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    args = [a.strategies[0].output_spec if isinstance(a, OpStrategy) else a for a in op_schema.args_schema]
    strategies = rule(*args)
    expanded = expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema,
                                               [outputs + inputs for outputs, inputs in strategies],
                                               input_index=len(strategies[0][0]))
    for spec in expanded.strategies:  # a list of one tensor (grad_h alone) is still a list
        if not isinstance(spec.output_specs, tuple):
            spec.output_specs = (spec.output_specs,)
    return expanded


def _register(op: Op, rule: Callable) -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor.experimental import register_sharding

    overload = op.registered._opoverload
    register_sharding(overload)(rule)
    # DTensor caches a rule's answer by the inputs' specs and, as RuntimeSchemaInfo documents it,
    # the non-tensor arguments from static_argnum on, which register_sharding sets at the first
    # `int` (none for the norms): the rules also read int[] normalized_shape and bool weight_grads,
    # so every non-tensor argument joins the key, lest a call with another normalized_shape reuse
    # a wrong sharding. (torch 2.13's key happens to hash them all anyway; the test
    # rules-read-every-non-tensor-argument guards the behavior.)
    propagator = DTensor._op_dispatcher.sharding_propagator
    schema_info = RuntimeSchemaInfo(_first_non_tensor(overload), needs_pytree=True)
    if str(overload._schema.returns[0].type) == "List[Tensor]":
        propagator.register_op_strategy(overload, functools.partial(_list_output_strategy, rule), schema_info)
    else:
        propagator.op_to_schema_info[overload] = schema_info


_registered: set = set()


def enable(*more_rules: dict[Op, Callable]) -> bool:
    """Register the sharding rules of every op in RULES, and in each of `more_rules` (the package's
    kernelforge.distributed.enable() passes matmul_sharding.RULES), with DTensor; an op registered
    already is skipped (calls are idempotent). Returns whether the rules are registered: False where
    torch.distributed is unavailable."""
    import torch.distributed

    if not torch.distributed.is_available():
        return False
    for rules in (RULES, *more_rules):
        for op, rule in rules.items():
            if op not in _registered:
                _register(op, rule)
                _registered.add(op)
    return True


__all__ = ["RULES", "Role", "enable", "row_op_strategies"]
