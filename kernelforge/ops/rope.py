"""Rotary position embedding of q and k in one kernel (transformers' apply_rotary_pos_emb):
schema, input checks, fake, autograd, dispatch, defined once (kernelforge.ops._opdef).

Registered op (with a fake implementation and autograd):
    kernelforge::rope(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids,
                      int unsqueeze_dim, bool transpose) -> (Tensor, Tensor)
transpose: the gradient's rotation (kernelforge/reference/rope.py); the op's backward is the op
transposed, so one kernel serves both directions and every order of derivative.

Backends: registry "rope" (rope_tokens): triton (GPU) and reference, both traced into a
torch.compile graph.
"""
from __future__ import annotations

from typing import Optional

import torch

from kernelforge import backends
from kernelforge.ops._common import (FLOAT_DTYPES, any_inputs, check_floating, check_same, is_dtensor, require,
                                     triton_floats)
from kernelforge.ops._opdef import define_op
from kernelforge.reference.rope import angle_gradients, token_angles
from kernelforge.reference._accumulation import accumulation_dtype

ROPE_OP = "rope"
_INTEGER_DTYPES = (torch.int32, torch.int64)


def _preference(q: torch.Tensor):
    if q.device.type != "cuda":
        return ("reference",), "the reference is the CPU implementation"
    return ("triton", "reference"), "Triton is rope's GPU implementation (one kernel for q and k)"


backends.register(ROPE_OP, "triton", "kernelforge.triton.rope", triton_floats)
backends.register(ROPE_OP, "reference", "kernelforge.reference.rope", any_inputs)
backends.set_preference(ROPE_OP, _preference, lambda q: (q.device.type, q.dtype))


# ----------------------------------------------------------------------------- checks
def _heads_dim(unsqueeze_dim: int) -> int:
    """transformers' unsqueeze_dim (where cos gains the heads' dim) -> the heads' dim of q and k:
    1 for (B, H, S, D), 2 for (B, S, H, D)."""
    if unsqueeze_dim not in (1, 2, -3, -2):
        raise ValueError(f"kernelforge.rope: unsqueeze_dim must be 1 (q, k as (batch, heads, seq, dim)) or 2 "
                         f"((batch, seq, heads, dim)), got {unsqueeze_dim}")
    return unsqueeze_dim % 4


def _tokens_view(x: torch.Tensor, heads_dim: int) -> torch.Tensor:
    """q or k as a (B, S, H, D) view."""
    return x.transpose(1, 2) if heads_dim == 1 else x


def _check(q, k, cos, sin, position_ids, unsqueeze_dim) -> int:
    """The checks, in fake and real calls alike; returns the heads' dim."""
    heads_dim = _heads_dim(unsqueeze_dim)
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"kernelforge.rope: {name} must be 4-D ((batch, heads, seq, dim) for unsqueeze_dim=1, "
                             f"(batch, seq, heads, dim) for 2), got shape {tuple(t.shape)}")
    check_floating("rope", "q", q, FLOAT_DTYPES)
    check_same("rope", "dtype", ("q", "k"), (q.dtype, k.dtype))
    check_floating("rope", "cos", cos, FLOAT_DTYPES)
    check_same("rope", "dtype", ("cos", "sin"), (cos.dtype, sin.dtype))
    devices = [q.device, k.device, cos.device, sin.device] + ([] if position_ids is None else [position_ids.device])
    names = ("q", "k", "cos", "sin", "position_ids")[:len(devices)]
    check_same("rope", "device", names, devices)
    qt, kt = _tokens_view(q, heads_dim), _tokens_view(k, heads_dim)
    B, S, _, D = qt.shape
    require(kt.shape[0] == B and kt.shape[1] == S and kt.shape[3] == D,
            lambda: f"kernelforge.rope: q and k must agree in batch, sequence and head dim (their heads may differ), "
                    f"got q {tuple(q.shape)}, k {tuple(k.shape)} with unsqueeze_dim={unsqueeze_dim}")
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"kernelforge.rope: cos and sin must have the same shape, got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    rot = cos.shape[-1] if cos.dim() else 0
    require(rot % 2 == 0 and 2 <= rot <= D,
            lambda: f"kernelforge.rope: cos's last dim (the rotated dims) must be even and in 2..{D} (q's head dim), "
                    f"got {rot}")
    if position_ids is None:
        if cos.dim() not in (2, 3):
            raise ValueError(f"kernelforge.rope: cos must be (seq, rot) or (batch, seq, rot), got shape "
                             f"{tuple(cos.shape)}")
        require(cos.shape[-2] == S and (cos.dim() == 2 or cos.shape[0] in (1, B)),
                lambda: f"kernelforge.rope: cos must be ({S}, rot) or (1 or {B}, {S}, rot) for q's batch {B} and "
                        f"sequence {S}, got {tuple(cos.shape)}")
    else:
        if position_ids.dtype not in _INTEGER_DTYPES:
            raise TypeError(f"kernelforge.rope: position_ids must be int32 or int64, got {position_ids.dtype}")
        if cos.dim() != 2:
            raise ValueError(f"kernelforge.rope: with position_ids, cos and sin must be (positions, rot) tables, got "
                             f"shape {tuple(cos.shape)}")
        require(position_ids.dim() in (1, 2) and position_ids.shape[-1] == S
                and (position_ids.dim() == 1 or position_ids.shape[0] in (1, B)),
                lambda: f"kernelforge.rope: position_ids must be ({S},) or (1 or {B}, {S}), got "
                        f"{tuple(position_ids.shape)}")
    return heads_dim


def _angles(cos, sin, position_ids):
    """cos, sin as the launchers take them ((Bc, S, rot), or the tables) and position_ids as (Bp, S)."""
    if position_ids is not None:
        # (Bp, S) with Bp written out: view(-1, 0) cannot infer it for no tokens
        return cos, sin, position_ids.view(1 if position_ids.dim() == 1 else position_ids.shape[0],
                                           position_ids.shape[-1])
    if cos.dim() == 2:
        return cos.unsqueeze(0), sin.unsqueeze(0), None
    return cos, sin, None


# ----------------------------------------------------------------------------- implementations
def _rope(q, k, cos, sin, position_ids, unsqueeze_dim: int, transpose: bool):
    heads_dim = _check(q, k, cos, sin, position_ids, unsqueeze_dim)
    cos3, sin3, positions = _angles(cos, sin, position_ids)
    launchers = backends.select(ROPE_OP, q).implementation.launchers()
    qo, ko = launchers.rope_tokens(_tokens_view(q, heads_dim), _tokens_view(k, heads_dim), cos3, sin3, positions,
                                   transpose)
    return _tokens_view(qo, heads_dim), _tokens_view(ko, heads_dim)


def _fake_rope(q, k, cos, sin, position_ids, unsqueeze_dim, transpose):
    heads_dim = _check(q, k, cos, sin, position_ids, unsqueeze_dim)
    return tuple(_tokens_view(torch.empty_like(_tokens_view(x, heads_dim)), heads_dim) for x in (q, k))


def _save(ctx, inputs, output) -> None:
    q, k, cos, sin, position_ids, unsqueeze_dim, transpose = inputs
    angle_grads = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(cos, sin, position_ids, *((q, k) if angle_grads else ()))
    ctx.unsqueeze_dim, ctx.transpose, ctx.angle_grads = unsqueeze_dim, transpose, angle_grads
    ctx.output_shapes = (q.shape, k.shape)  # for an output whose gradient is None


def _table_gradients(grad_q, grad_k, q, k, c, positions, cos_shape, transpose):
    """angle_gradients; for DTensors read through position ids, on each rank's shards: DTensor has
    no sharding rule for the index_add_ into the table in every torch release (2.11), and each
    rank's sum over its own tokens and heads is a partial sum of the table's gradient (Partial
    where the tokens or heads are sharded, Replicate where nothing is). The last dim (the rotated
    pairs) is never sharded by the rope rule."""
    if positions is None or not is_dtensor(grad_q):
        return angle_gradients(grad_q, grad_k, q, k, c, positions, cos_shape, transpose)
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh, placements = grad_q.device_mesh, grad_q.placements
    # the per-token angles and ids (batch or 1, seq, ...) split over the batch where the tokens are,
    # so that each rank's rows line up (replicated ids beside batch-sharded q: a local slice)
    by_batch = [Shard(0) if p.is_shard(0) else Replicate() for p in placements]
    c, positions = (t.redistribute(mesh, by_batch) if is_dtensor(t) and t.shape[0] != 1 else t for t in (c, positions))
    local = [t.to_local() if is_dtensor(t) else t for t in (grad_q, grad_k, q, k, c, positions)]
    tables = angle_gradients(*local, cos_shape, transpose)
    summed = [Replicate() if p.is_replicate() else Partial() for p in placements]
    return tuple(DTensor.from_local(t, mesh, summed, run_check=False) for t in tables)


def _rope_grad(ctx, grad_q, grad_k):
    # An output nobody differentiated comes as None (unused_gradients_as_none) and its input gets
    # no gradient, as in torch: a zero gradient rotated back by an infinite or NaN angle would be NaN.
    if grad_q is None and grad_k is None:
        return None, None, None, None, None, None, None
    cos, sin, position_ids, *inputs = ctx.saved_tensors
    used = grad_q is not None, grad_k is not None
    grad_q, grad_k = (g if g is not None else cos.new_zeros(shape, dtype=other.dtype)
                      for g, other, shape in ((grad_q, grad_k, ctx.output_shapes[0]),
                                              (grad_k, grad_q, ctx.output_shapes[1])))
    dq, dk = rope_op(grad_q, grad_k, cos, sin, position_ids, ctx.unsqueeze_dim, not ctx.transpose)
    dq, dk = (d if u else None for d, u in zip((dq, dk), used))
    dcos = dsin = None
    if ctx.angle_grads:  # not fused: torch ops over the inputs (angles rarely need a gradient)
        # an unused output's input as zeros too: its 0 gradient times an infinite input is no term
        q, k = (t if u else torch.zeros_like(t) for t, u in zip(inputs, used))
        heads_dim = _heads_dim(ctx.unsqueeze_dim)
        cos3, sin3, positions = _angles(cos, sin, position_ids)
        c, _ = token_angles(cos3, sin3, positions, _tokens_view(q, heads_dim).shape[0],
                            accumulation_dtype(q.dtype))
        dcos, dsin = _table_gradients(*(_tokens_view(t, heads_dim) for t in (grad_q, grad_k, q, k)), c, positions,
                                      cos3.shape, ctx.transpose)
        dcos, dsin = dcos.view(cos.shape).to(cos.dtype), dsin.view(sin.shape).to(sin.dtype)
    return dq, dk, dcos, dsin, None, None, None


rope_op = define_op(
    "kernelforge::rope(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids, int unsqueeze_dim, "
    "bool transpose) -> (Tensor, Tensor)",
    impl=_rope, fake=_fake_rope, choose=lambda q, *rest: backends.select(ROPE_OP, q),
    setup_context=_save, backward=_rope_grad, unused_gradients_as_none=True)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         position_ids: Optional[torch.Tensor] = None, unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) with the rotary embedding applied, as transformers' apply_rotary_pos_emb(q, k, cos,
    sin, unsqueeze_dim=unsqueeze_dim) computes it (rotate-half), in one kernel for both.

    q (B, H, S, D) and k (B, Hkv, S, D) (unsqueeze_dim=2: (B, S, H, D)), any strides; cos and sin
    (B or 1, S, rot) or (S, rot) per token, or, with position_ids ((S,) or (B or 1, S), int), the
    (positions, rot) tables they index. rot = cos.shape[-1] (even, <= D) dims of each head rotate,
    the rest pass through (partial rotary). Each half of cos / sin is used as given, so the
    scaled variants' angles (linear, NTK, YaRN, Llama 3: transformers computes them) and their
    attention factor folded into cos / sin work as they are. Computed in float32 and rounded once;
    the outputs keep the inputs' shapes, and their memory order where it is dense (else dense in
    (batch, seq, heads, dim) order). Differentiable in q and k (the transposed
    rotation, the same kernel) and in cos and sin. A position outside the tables gives NaN."""
    return rope_op(q, k, cos, sin, position_ids, unsqueeze_dim, False)


__all__ = ["rope"]
