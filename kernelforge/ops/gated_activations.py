"""Gated activations, act(gate) * up (swiglu: silu, geglu: gelu): schemas, input checks,
fake implementations, autograd, dispatch, each op defined once (kernelforge.ops._opdef). Shares
kinds, checks and the saved context with kernelforge/ops/activations.py.

Registered ops (each with a fake implementation and autograd):
    kernelforge::gated_activation(Tensor gate, Tensor up, str kind) -> Tensor      act(gate) * up
    kernelforge::gated_activation_backward(Tensor grad_output, Tensor gate, Tensor up, str kind)
        -> (Tensor, Tensor)
    kernelforge::gated_activation_backward_and_product(Tensor grad_output, Tensor gate, Tensor up,
        str kind) -> (Tensor, Tensor, Tensor)     the same and act(gate) * up, from one pass
    kernelforge::gated_activation_packed(Tensor gate_up, str kind) -> Tensor
        gate_up = [gate | up] along the last dim (as torch.chunk(2, -1) splits it)
    kernelforge::gated_activation_packed_backward(Tensor grad_output, Tensor gate_up, str kind) -> Tensor
        the gradient of gate_up, both halves written by one kernel into one buffer

The packed form has ops of its own (rather than slicing gate_up and calling
gated_activation) so that its gradient is one buffer filled in place: slicing would make
autograd allocate a zero gradient for gate_up per half and add them.

Backends: registry "gated_activation" (glu_forward_rows, glu_backward_rows): triton and
reference, both traced into a torch.compile graph; the CUDA extension has no gated launchers.
"""
from __future__ import annotations

from typing import Optional

import torch

from kernelforge import backends
from kernelforge._rows import empty_rows_output, from_rows, rows_view
from kernelforge.ops._common import FLOAT_DTYPES, GPU_FLOAT_DTYPES, check_floating, check_same, require
from kernelforge.ops._opdef import define_op
from kernelforge.ops.activations import check_kind, check_same_as, gelu_kind, row_dim, save_inputs_and_kind
from kernelforge.reference._accumulation import accumulation_dtype
from kernelforge.reference.activations import activation_derivative, activation_second_derivative, activation_value

GATED_OP = "gated_activation"  # backend registry name
# Names the messages use: the public function a user called.
_GATED_NAMES = {"gelu": "geglu", "gelu_tanh": "geglu", "silu": "swiglu", "relu": "gated_activation"}


def _why_not_triton_gated(gate: torch.Tensor, kind: str = "silu"):
    from kernelforge.triton import why_unavailable

    if gate.dtype not in GPU_FLOAT_DTYPES:
        return f"Triton kernels take float32/float16/bfloat16, got {gate.dtype}"
    return why_unavailable(gate.device)


def _why_not_reference(gate: torch.Tensor, kind: str = "silu"):
    return None


def _gated_preference(gate: torch.Tensor, kind: str = "silu"):
    """Backend order for these inputs: Triton is the one GPU implementation."""
    if gate.device.type != "cuda":
        return ("reference",), "the reference is the CPU implementation"
    return ("triton", "reference"), "Triton is the gated ops' GPU implementation (the CUDA extension has none)"


def _gated_choice_key(gate: torch.Tensor, kind: str = "silu"):
    return gate.device.type, gate.dtype


backends.register(GATED_OP, "triton", "kernelforge.triton.activations", _why_not_triton_gated)
backends.register(GATED_OP, "reference", "kernelforge.reference.activations", _why_not_reference)
backends.set_preference(GATED_OP, _gated_preference, _gated_choice_key)


def _choose(gate: torch.Tensor, kind: str) -> backends.Choice:
    """The backend for a gated op on `gate` (the packed input, for the packed ops)."""
    return backends.select(GATED_OP, gate, kind=kind)


def _check_gated(name: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    check_floating(name, "gate", gate, FLOAT_DTYPES)
    check_same_as(name, ("gate", "up"), gate, up)


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


# ----------------------------------------------------------------------------- implementations
# What the ops compute: the eager call runs these directly, the registered ops through torch.ops,
# and torch.compile traces them.
def _gated(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    check_kind(GATED_OP, kind)
    _check_gated(_GATED_NAMES[kind], gate, up)
    dim = row_dim(gate)
    if gate.numel() == 0:
        return empty_rows_output(gate, dim)
    y2d = _choose(gate, kind).implementation.launchers().glu_forward_rows(rows_view(gate, dim), rows_view(up, dim), kind)
    return from_rows(y2d, gate, dim)


def _check_gated_backward(grad_output: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, kind: str) -> int:
    """gated_activation_backward's checks; returns the dim rows run along."""
    check_kind(GATED_OP, kind)
    name = _GATED_NAMES[kind] + "_backward"
    _check_gated(name, gate, up)
    check_same_as(name, ("grad_output", "gate"), grad_output, gate)
    return row_dim(gate)


def _gated_backward(grad_output: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, kind: str,
                    with_product: bool = False):
    dim = _check_gated_backward(grad_output, gate, up, kind)
    likes = (gate, up, gate) if with_product else (gate, up)
    if gate.numel() == 0:
        return tuple(empty_rows_output(t, dim) for t in likes)
    results2d = _choose(gate, kind).implementation.launchers().glu_backward_rows(
        rows_view(grad_output, dim), rows_view(gate, dim), rows_view(up, dim), kind, with_product=with_product)
    return tuple(from_rows(r, t, dim) for r, t in zip(results2d, likes))


def _gated_backward_and_product(grad_output: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, kind: str):
    return _gated_backward(grad_output, gate, up, kind, with_product=True)


def _gated_packed(gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    check_kind(GATED_OP, kind)
    half = _packed_half(_GATED_NAMES[kind], gate_up)
    out_shape = _packed_out_shape(gate_up, half)
    if gate_up.numel() == 0:
        return gate_up.new_empty(out_shape)
    packed2d = rows_view(gate_up, gate_up.dim() - 1)
    y2d = _choose(gate_up, kind).implementation.launchers().glu_forward_rows(packed2d[:, :half], packed2d[:, half:], kind)
    return y2d.view(out_shape)


def _gated_packed_backward(grad_output: torch.Tensor, gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    check_kind(GATED_OP, kind)
    half = _check_packed_backward(_GATED_NAMES[kind] + "_backward", grad_output, gate_up)
    grad = gate_up.new_empty(gate_up.shape)
    if gate_up.numel() == 0:
        return grad
    packed2d = rows_view(gate_up, gate_up.dim() - 1)
    grad2d = grad.view(-1, 2 * half)
    _choose(gate_up, kind).implementation.launchers().glu_backward_rows(
        rows_view(grad_output, grad_output.dim() - 1), packed2d[:, :half], packed2d[:, half:], kind,
        out=(grad2d[:, :half], grad2d[:, half:]))
    return grad


def _fake_gated(gate, up, kind) -> torch.Tensor:
    check_kind(GATED_OP, kind)
    _check_gated(_GATED_NAMES[kind], gate, up)
    return empty_rows_output(gate, row_dim(gate))


def _fake_gated_backward(grad_output, gate, up, kind) -> tuple[torch.Tensor, torch.Tensor]:
    dim = _check_gated_backward(grad_output, gate, up, kind)
    return empty_rows_output(gate, dim), empty_rows_output(up, dim)


def _fake_gated_backward_and_product(grad_output, gate, up, kind) -> tuple[torch.Tensor, ...]:
    dim = _check_gated_backward(grad_output, gate, up, kind)
    return empty_rows_output(gate, dim), empty_rows_output(up, dim), empty_rows_output(gate, dim)


def _fake_gated_packed(gate_up, kind) -> torch.Tensor:
    check_kind(GATED_OP, kind)
    return gate_up.new_empty(_packed_out_shape(gate_up, _packed_half(_GATED_NAMES[kind], gate_up)))


def _fake_gated_packed_backward(grad_output, gate_up, kind) -> torch.Tensor:
    check_kind(GATED_OP, kind)
    _check_packed_backward(_GATED_NAMES[kind] + "_backward", grad_output, gate_up)
    return gate_up.new_empty(gate_up.shape)


# ----------------------------------------------------------------------------- gradients
def _gated_grad(ctx, grad_output):
    gate, up = ctx.saved_tensors
    grad_gate, grad_up = gated_activation_backward_op(grad_output, gate, up, ctx.kind)
    return grad_gate, grad_up, None


def _gated_packed_grad(ctx, grad_output):
    (gate_up,) = ctx.saved_tensors
    return gated_activation_packed_backward_op(grad_output, gate_up, ctx.kind), None


def _gated_double_backward_math(g, gate, up, v_gate, v_up, kind):
    """gg = g up act'(a), gu = g act(a), a = gate  =>
    dg = v_gate up act'(a) + v_up act(a),  da = g (v_gate up act''(a) + v_up act'(a)),  du = v_gate g act'(a)."""
    acc = accumulation_dtype(gate.dtype)
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


# ----------------------------------------------------------------------------- definitions
gated_activation_backward_op = define_op(
    "kernelforge::gated_activation_backward(Tensor grad_output, Tensor gate, Tensor up, str kind) -> (Tensor, Tensor)",
    impl=_gated_backward, fake=_fake_gated_backward,
    choose=lambda grad_output, gate, up, kind: _choose(gate, kind),
    setup_context=save_inputs_and_kind, backward=_gated_double_backward)

# gated_activation_backward and act(gate) * up again, from one pass over gate and up: for a backward
# that needs the forward's product and did not keep it (gated_mlp's down-projection weight gradient).
# No gradient of its own (gated_mlp_backward, its caller, has none).
gated_activation_backward_and_product_op = define_op(
    "kernelforge::gated_activation_backward_and_product(Tensor grad_output, Tensor gate, Tensor up, str kind) "
    "-> (Tensor, Tensor, Tensor)",
    impl=_gated_backward_and_product, fake=_fake_gated_backward_and_product,
    choose=lambda grad_output, gate, up, kind: _choose(gate, kind))

gated_activation_op = define_op(
    "kernelforge::gated_activation(Tensor gate, Tensor up, str kind) -> Tensor",
    impl=_gated, fake=_fake_gated, choose=lambda gate, up, kind: _choose(gate, kind),
    setup_context=save_inputs_and_kind, backward=_gated_grad)

gated_activation_packed_backward_op = define_op(
    "kernelforge::gated_activation_packed_backward(Tensor grad_output, Tensor gate_up, str kind) -> Tensor",
    impl=_gated_packed_backward, fake=_fake_gated_packed_backward,
    choose=lambda grad_output, gate_up, kind: _choose(gate_up, kind),
    setup_context=save_inputs_and_kind, backward=_gated_packed_double_backward)

gated_activation_packed_op = define_op(
    "kernelforge::gated_activation_packed(Tensor gate_up, str kind) -> Tensor",
    impl=_gated_packed, fake=_fake_gated_packed, choose=lambda gate_up, kind: _choose(gate_up, kind),
    setup_context=save_inputs_and_kind, backward=_gated_packed_grad)


# ----------------------------------------------------------------------------- public functions
def _call_gated(gate: torch.Tensor, up: Optional[torch.Tensor], kind: str) -> torch.Tensor:
    if up is None:
        return gated_activation_packed_op(gate, kind)
    return gated_activation_op(gate, up, kind)


def swiglu(gate: torch.Tensor, up: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(gate) * up. With up=None, gate holds [gate | up] along its last dim (split as
    torch.chunk(gate, 2, -1) would) and its gradient comes back as one tensor."""
    return _call_gated(gate, up, "silu")


def geglu(gate: torch.Tensor, up: Optional[torch.Tensor] = None, approximate: str = "none") -> torch.Tensor:
    """gelu(gate) * up (approximate as in gelu); up=None as in swiglu."""
    return _call_gated(gate, up, gelu_kind("geglu", approximate))


__all__ = ["geglu", "swiglu"]
