"""Gated activations, act(gate) * up (swiglu: silu, geglu: gelu): schemas, input checks,
fake implementations, autograd, dispatch. Shares kinds, checks and the eager-call
machinery with kernelforge/ops/activations.py.

Registered ops (each with a fake implementation and autograd):
    kernelforge::gated_activation(Tensor gate, Tensor up, str kind) -> Tensor      act(gate) * up
    kernelforge::gated_activation_backward(Tensor grad_output, Tensor gate, Tensor up, str kind)
        -> (Tensor, Tensor)
    kernelforge::gated_activation_packed(Tensor gate_up, str kind) -> Tensor
        gate_up = [gate | up] along the last dim (as torch.chunk(2, -1) splits it)
    kernelforge::gated_activation_packed_backward(Tensor grad_output, Tensor gate_up, str kind) -> Tensor
        the gradient of gate_up, both halves written by one kernel into one buffer

The packed form has ops of its own (rather than slicing gate_up and calling
gated_activation) so that its gradient is one buffer filled in place: slicing would make
autograd allocate a zero gradient for gate_up per half and add them.

Backends: registry "gated_activation" (glu_forward_rows, glu_backward_rows): triton and
reference; the CUDA extension has no gated launchers.
"""
from __future__ import annotations

from typing import Optional

import torch

from kernelforge import backends
from kernelforge._rows import empty_rows_output, from_rows, rows_view
from kernelforge.ops._common import (FLOAT_DTYPES, GPU_FLOAT_DTYPES, check_floating, check_same, not_a_view,
                                     plain_eager_call, require)
from kernelforge.ops.activations import (_acc, _check_kind, _check_same_as, _gelu_kind, _needs_grad, _preference,
                                         _row_dim, _save_all_and_kind, _why_not_reference)
from kernelforge.reference.activations import activation_derivative, activation_second_derivative, activation_value

GATED_OP = "gated_activation"  # backend registry name
# Names the messages use: the public function a user called.
_GATED_NAMES = {"gelu": "geglu", "gelu_tanh": "geglu", "silu": "swiglu", "relu": "gated_activation"}


def _why_not_triton_gated(gate: torch.Tensor, kind: str = "silu"):
    from kernelforge.triton import why_unavailable

    if gate.dtype not in GPU_FLOAT_DTYPES:
        return f"Triton kernels take float32/float16/bfloat16, got {gate.dtype}"
    return why_unavailable(gate.device)


def _gated_choice_key(gate: torch.Tensor, kind: str = "silu"):
    return gate.device.type, gate.dtype


backends.register(GATED_OP, "triton", "kernelforge.triton.activations", _why_not_triton_gated)
backends.register(GATED_OP, "reference", "kernelforge.reference.activations", _why_not_reference)
backends.set_preference(GATED_OP, _preference, _gated_choice_key)


def _gated_launchers(gate: torch.Tensor, kind: str):
    return backends.select(GATED_OP, gate, kind=kind).implementation.launchers()


def _check_gated(name: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    check_floating(name, "gate", gate, FLOAT_DTYPES)
    _check_same_as(name, ("gate", "up"), gate, up)


def _packed_half(name: str, gate_up: torch.Tensor) -> int:
    """Check the packed input [gate | up] and return the width of one half."""
    check_floating(name, "gate", gate_up, FLOAT_DTYPES)
    if gate_up.dim() == 0:
        raise ValueError(f"kernelforge.{name}: gate must have at least 1 dim to split into [gate | up], got a 0-dim tensor")
    require(
        gate_up.shape[-1] % 2 == 0,
        lambda: f"kernelforge.{name}: gate with up=None must hold [gate | up] along its last dim, "
        f"which must be even, got shape {tuple(gate_up.shape)}",
    )
    return gate_up.shape[-1] // 2


def _packed_out_shape(gate_up: torch.Tensor, half: int) -> list:
    return list(gate_up.shape[:-1]) + [half]


def _check_packed_backward(name: str, grad_output: torch.Tensor, gate_up: torch.Tensor) -> int:
    half = _packed_half(name, gate_up)
    check_same(name, "device", ("grad_output", "gate"), (grad_output.device, gate_up.device))
    check_same(name, "dtype", ("grad_output", "gate"), (grad_output.dtype, gate_up.dtype))
    expected = tuple(_packed_out_shape(gate_up, half))
    require(
        tuple(grad_output.shape) == expected,
        lambda: f"kernelforge.{name}: grad_output must have shape {expected} (gate's with its last dim "
        f"halved), got {tuple(grad_output.shape)}",
    )
    return half


def _gated(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    _check_kind(GATED_OP, kind)
    _check_gated(_GATED_NAMES[kind], gate, up)
    dim = _row_dim(gate)
    if gate.numel() == 0:
        return empty_rows_output(gate, dim)
    y2d = _gated_launchers(gate, kind).glu_forward_rows(rows_view(gate, dim), rows_view(up, dim), kind)
    # not a view (ops._common.not_a_view): in-place ops on it work as on torch's outputs
    return not_a_view(from_rows(y2d, gate, dim))


def _gated_backward(grad_output: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, kind: str):
    _check_kind(GATED_OP, kind)
    name = _GATED_NAMES[kind] + "_backward"
    _check_gated(name, gate, up)
    _check_same_as(name, ("grad_output", "gate"), grad_output, gate)
    dim = _row_dim(gate)
    if gate.numel() == 0:
        return empty_rows_output(gate, dim), empty_rows_output(up, dim)
    grad_gate2d, grad_up2d = _gated_launchers(gate, kind).glu_backward_rows(
        rows_view(grad_output, dim), rows_view(gate, dim), rows_view(up, dim), kind)
    return from_rows(grad_gate2d, gate, dim), from_rows(grad_up2d, up, dim)


def _gated_packed(gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    _check_kind(GATED_OP, kind)
    half = _packed_half(_GATED_NAMES[kind], gate_up)
    out_shape = _packed_out_shape(gate_up, half)
    if gate_up.numel() == 0:
        return gate_up.new_empty(out_shape)
    packed2d = rows_view(gate_up, gate_up.dim() - 1)
    y2d = _gated_launchers(gate_up, kind).glu_forward_rows(packed2d[:, :half], packed2d[:, half:], kind)
    return not_a_view(y2d.view(out_shape))


def _gated_packed_backward(grad_output: torch.Tensor, gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    _check_kind(GATED_OP, kind)
    half = _check_packed_backward(_GATED_NAMES[kind] + "_backward", grad_output, gate_up)
    grad = gate_up.new_empty(gate_up.shape)
    if gate_up.numel() == 0:
        return grad
    packed2d = rows_view(gate_up, gate_up.dim() - 1)
    grad2d = grad.view(-1, 2 * half)
    _gated_launchers(gate_up, kind).glu_backward_rows(
        rows_view(grad_output, grad_output.dim() - 1), packed2d[:, :half], packed2d[:, half:], kind,
        out=(grad2d[:, :half], grad2d[:, half:]))
    return grad


def _gated_double_backward_math(g, gate, up, v_gate, v_up, kind):
    """gg = g up act'(a), gu = g act(a), a = gate  =>
    dg = v_gate up act'(a) + v_up act(a),  da = g (v_gate up act''(a) + v_up act'(a)),  du = v_gate g act'(a)."""
    acc = _acc(gate)
    g, a, u, vg, vu = (t.to(acc) for t in (g, gate, up, v_gate, v_up))
    d1 = activation_derivative(a, kind)
    d_grad = vg * u * d1 + vu * activation_value(a, kind)
    d_gate = g * (vg * u * activation_second_derivative(a, kind) + vu * d1)
    d_up = vg * g * d1
    return d_grad, d_gate, d_up


def _gated_double_backward(ctx, v_gate, v_up):
    grad_output, gate, up = ctx.saved_tensors
    d_grad, d_gate, d_up = _gated_double_backward_math(grad_output, gate, up, v_gate, v_up, ctx.kind)
    return d_grad.to(grad_output.dtype), d_gate.to(gate.dtype), d_up.to(up.dtype), None


def _gated_packed_double_backward(ctx, v):
    grad_output, gate_up = ctx.saved_tensors
    gate, up = gate_up.chunk(2, -1)
    v_gate, v_up = v.chunk(2, -1)
    d_grad, d_gate, d_up = _gated_double_backward_math(grad_output, gate, up, v_gate, v_up, ctx.kind)
    return d_grad.to(grad_output.dtype), torch.cat((d_gate, d_up), -1).to(gate_up.dtype), None


@torch.library.custom_op("kernelforge::gated_activation_backward", mutates_args=())
def gated_activation_backward_op(
    grad_output: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return _gated_backward(grad_output, gate, up, kind)


@gated_activation_backward_op.register_fake
def _(grad_output, gate, up, kind):
    _check_kind(GATED_OP, kind)
    name = _GATED_NAMES[kind] + "_backward"
    _check_gated(name, gate, up)
    _check_same_as(name, ("grad_output", "gate"), grad_output, gate)
    dim = _row_dim(gate)
    return empty_rows_output(gate, dim), empty_rows_output(up, dim)


gated_activation_backward_op.register_autograd(_gated_double_backward, setup_context=_save_all_and_kind)


@torch.library.custom_op("kernelforge::gated_activation", mutates_args=())
def gated_activation_op(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    return _gated(gate, up, kind)


@gated_activation_op.register_fake
def _(gate, up, kind):
    _check_kind(GATED_OP, kind)
    _check_gated(_GATED_NAMES[kind], gate, up)
    return empty_rows_output(gate, _row_dim(gate))


def _gated_grad(ctx, grad_output):
    gate, up = ctx.saved_tensors
    grad_gate, grad_up = gated_activation_backward_op(grad_output, gate, up, ctx.kind)
    return grad_gate, grad_up, None


gated_activation_op.register_autograd(_gated_grad, setup_context=_save_all_and_kind)


@torch.library.custom_op("kernelforge::gated_activation_packed_backward", mutates_args=())
def gated_activation_packed_backward_op(grad_output: torch.Tensor, gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    return _gated_packed_backward(grad_output, gate_up, kind)


@gated_activation_packed_backward_op.register_fake
def _(grad_output, gate_up, kind):
    _check_kind(GATED_OP, kind)
    _check_packed_backward(_GATED_NAMES[kind] + "_backward", grad_output, gate_up)
    return gate_up.new_empty(gate_up.shape)


gated_activation_packed_backward_op.register_autograd(_gated_packed_double_backward, setup_context=_save_all_and_kind)


@torch.library.custom_op("kernelforge::gated_activation_packed", mutates_args=())
def gated_activation_packed_op(gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    return _gated_packed(gate_up, kind)


@gated_activation_packed_op.register_fake
def _(gate_up, kind):
    _check_kind(GATED_OP, kind)
    return gate_up.new_empty(_packed_out_shape(gate_up, _packed_half(_GATED_NAMES[kind], gate_up)))


def _gated_packed_grad(ctx, grad_output):
    (gate_up,) = ctx.saved_tensors
    return gated_activation_packed_backward_op(grad_output, gate_up, ctx.kind), None


gated_activation_packed_op.register_autograd(_gated_packed_grad, setup_context=_save_all_and_kind)


class _EagerGated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, kind):
        _save_all_and_kind(ctx, (gate, up, kind), None)
        return _gated(gate, up, kind)

    @staticmethod
    def backward(ctx, grad_output):
        if torch.is_grad_enabled():
            return _gated_grad(ctx, grad_output)
        return (*_gated_backward(grad_output, *ctx.saved_tensors, ctx.kind), None)


class _EagerGatedPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, kind):
        _save_all_and_kind(ctx, (gate_up, kind), None)
        return _gated_packed(gate_up, kind)

    @staticmethod
    def backward(ctx, grad_output):
        if torch.is_grad_enabled():
            return _gated_packed_grad(ctx, grad_output)
        return _gated_packed_backward(grad_output, *ctx.saved_tensors, ctx.kind), None


def _call_gated(gate: torch.Tensor, up: Optional[torch.Tensor], kind: str) -> torch.Tensor:
    if up is None:
        if not plain_eager_call(gate):
            return torch.ops.kernelforge.gated_activation_packed(gate, kind)
        return _EagerGatedPacked.apply(gate, kind) if _needs_grad(gate) else _gated_packed(gate, kind)
    if not plain_eager_call(gate, up):
        return torch.ops.kernelforge.gated_activation(gate, up, kind)
    return _EagerGated.apply(gate, up, kind) if _needs_grad(gate, up) else _gated(gate, up, kind)


def swiglu(gate: torch.Tensor, up: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(gate) * up. With up=None, gate holds [gate | up] along its last dim (split as
    torch.chunk(gate, 2, -1) would) and its gradient comes back as one tensor."""
    return _call_gated(gate, up, "silu")


def geglu(gate: torch.Tensor, up: Optional[torch.Tensor] = None, approximate: str = "none") -> torch.Tensor:
    """gelu(gate) * up (approximate as in gelu); up=None as in swiglu."""
    return _call_gated(gate, up, _gelu_kind("geglu", approximate))


__all__ = ["geglu", "swiglu"]
