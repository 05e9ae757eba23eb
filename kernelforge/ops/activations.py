"""Activations (gelu, gelu_tanh, silu, relu), bias + activation, and gated activations
(swiglu, geglu): schemas, input checks, fake implementations, autograd, dispatch.

Registered ops (each with a fake implementation and autograd; kind is one of
"gelu", "gelu_tanh", "silu", "relu"):
    kernelforge::activation(Tensor x, Tensor? bias, str kind) -> Tensor
        act(x + bias), bias None or (n,) along x's last dim
    kernelforge::activation_backward(Tensor grad_output, Tensor x, Tensor? bias, str kind) -> Tensor
        grad_x only (no bias, or a bias that needs no gradient)
    kernelforge::bias_activation_backward(Tensor grad_output, Tensor x, Tensor bias, str kind)
        -> (Tensor, Tensor)                 grad_x and grad_bias in one pass
    kernelforge::gated_activation(Tensor gate, Tensor up, str kind) -> Tensor      act(gate) * up
    kernelforge::gated_activation_backward(Tensor grad_output, Tensor gate, Tensor up, str kind)
        -> (Tensor, Tensor)
    kernelforge::gated_activation_packed(Tensor gate_up, str kind) -> Tensor
        gate_up = [gate | up] along the last dim (as torch.chunk(2, -1) splits it)
    kernelforge::gated_activation_packed_backward(Tensor grad_output, Tensor gate_up, str kind) -> Tensor
        the gradient of gate_up, both halves written by one kernel into one buffer

Two backward ops for one forward because a custom op cannot return an optional tensor:
the bias gradient comes from its own op when autograd asks for it. The packed form has
ops of its own (rather than slicing gate_up and calling gated_activation) so that its
gradient is one buffer filled in place: slicing would make autograd allocate a zero
gradient for gate_up per half and add them.

Backends: two registry entries, because the CUDA extension implements only the
bias + activation launchers (act_forward_rows / act_backward_rows for gelu and gelu_tanh):
    "activation"        act_forward_rows, act_backward_rows     triton, cuda, reference
    "gated_activation"  glu_forward_rows, glu_backward_rows     triton, reference
See kernelforge/reference/activations.py for the launcher interface.

Layout: elementwise without a bias, so rows run along x's unit-stride dim (the last one
for contiguous x): a transposed or channels-last input is a row view without a copy, and
the output keeps its layout, as torch's elementwise ops do. A bias runs along the last
dim and the packed form splits it, so those run rows along the last dim.
"""
from __future__ import annotations

from typing import Optional

import torch

from kernelforge import backends
from kernelforge._rows import empty_rows_output, from_rows, rows_view
from kernelforge.ops._common import FLOAT_DTYPES, GPU_FLOAT_DTYPES, check_floating, check_same, plain_eager_call
from kernelforge.reference.activations import KINDS, activation_derivative, activation_second_derivative
from kernelforge.reference.activations import activation_value

OP = "activation"  # backend registry names (kernelforge.explain(OP, x, bias=..., kind=...))
GATED_OP = "gated_activation"
CUDA_KINDS = ("gelu", "gelu_tanh")

# Names the messages use: the public function a user called.
_ACT_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu", "silu": "silu", "relu": "relu"}
_GATED_NAMES = {"gelu": "geglu", "gelu_tanh": "geglu", "silu": "swiglu", "relu": "gated_activation"}


# ----------------------------------------------------------------------------- dispatch
def _why_not_triton(x: torch.Tensor, bias: Optional[torch.Tensor] = None, kind: str = "gelu"):
    from kernelforge.triton import why_unavailable

    for name, t in (("x", x), ("bias", bias)):
        if t is not None and t.dtype not in GPU_FLOAT_DTYPES:
            return f"Triton kernels take float32/float16/bfloat16, got {name} of {t.dtype}"
    return why_unavailable(x.device)


def _why_not_cuda(x: torch.Tensor, bias: Optional[torch.Tensor] = None, kind: str = "gelu"):
    from kernelforge.cuda import why_unavailable

    if x.device.type != "cuda":
        return f"the CUDA extension runs on CUDA tensors, got a {x.device.type} tensor"
    if kind not in CUDA_KINDS:
        return f"the CUDA kernels implement {' and '.join(CUDA_KINDS)} only, got kind {kind!r}"
    for name, t in (("x", x), ("bias", bias)):  # the bias may have another of these dtypes than x
        if t is not None and t.dtype not in GPU_FLOAT_DTYPES:
            return f"the CUDA kernels take float32/float16/bfloat16, got {name} of {t.dtype}"
    return why_unavailable("activations")


def _why_not_triton_gated(gate: torch.Tensor, kind: str = "silu"):
    from kernelforge.triton import why_unavailable

    if gate.dtype not in GPU_FLOAT_DTYPES:
        return f"Triton kernels take float32/float16/bfloat16, got {gate.dtype}"
    return why_unavailable(gate.device)


def _why_not_reference(*inputs, **options):
    return None


def _preference(x: torch.Tensor, *inputs, **options):
    """Fastest-first backend order for these inputs."""
    if x.device.type != "cuda":
        return ("reference",), "the reference is the CPU implementation"
    return ("triton", "cuda", "reference"), "not measured yet on a GPU: Triton is the default until the GPU sweep"


def _choice_key(x: torch.Tensor, bias: Optional[torch.Tensor] = None, kind: str = "gelu"):
    # everything _preference and the _why_not_* predicates look at
    return x.device.type, x.dtype, None if bias is None else bias.dtype, kind


def _gated_choice_key(gate: torch.Tensor, kind: str = "silu"):
    return gate.device.type, gate.dtype


backends.register(OP, "triton", "kernelforge.triton.activations", _why_not_triton)
backends.register(OP, "cuda", "kernelforge.cuda.activations", _why_not_cuda)
backends.register(OP, "reference", "kernelforge.reference.activations", _why_not_reference)
backends.set_preference(OP, _preference, _choice_key)
backends.register(GATED_OP, "triton", "kernelforge.triton.activations", _why_not_triton_gated)
backends.register(GATED_OP, "reference", "kernelforge.reference.activations", _why_not_reference)
backends.set_preference(GATED_OP, _preference, _gated_choice_key)


def _launchers(x: torch.Tensor, bias: Optional[torch.Tensor], kind: str):
    return backends.select(OP, x, bias=bias, kind=kind).implementation.launchers()


def _gated_launchers(gate: torch.Tensor, kind: str):
    return backends.select(GATED_OP, gate, kind=kind).implementation.launchers()


# ----------------------------------------------------------------------------- checks
def _check_kind(name: str, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kernelforge.{name}: kind must be one of {KINDS}, got {kind!r}")


def _act_name(kind: str, bias: Optional[torch.Tensor]) -> str:
    _check_kind(OP, kind)
    return ("bias_" if bias is not None else "") + _ACT_NAMES[kind]


def _check_activation(name: str, x: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    check_floating(name, "x", x, FLOAT_DTYPES)
    if bias is None:
        return
    check_floating(name, "bias", bias, FLOAT_DTYPES)
    check_same(name, "device", ("x", "bias"), (x.device, bias.device))
    if x.dim() == 0:
        raise ValueError(f"kernelforge.{name}: x must have at least 1 dim to add a bias along its last, got a 0-dim tensor")
    torch._check(
        bias.dim() == 1 and bias.shape[0] == x.shape[-1],
        lambda: f"kernelforge.{name}: bias must have shape ({x.shape[-1]},) (x's last dim), got {tuple(bias.shape)}",
    )


def _check_same_as(name: str, names: tuple[str, str], a: torch.Tensor, b: torch.Tensor) -> None:
    check_same(name, "device", names, (a.device, b.device))
    check_same(name, "dtype", names, (a.dtype, b.dtype))
    check_same(name, "shape", names, (tuple(a.shape), tuple(b.shape)))


def _check_gated(name: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    check_floating(name, "gate", gate, FLOAT_DTYPES)
    _check_same_as(name, ("gate", "up"), gate, up)


def _packed_half(name: str, gate_up: torch.Tensor) -> int:
    """Check the packed input [gate | up] and return the width of one half."""
    check_floating(name, "gate", gate_up, FLOAT_DTYPES)
    if gate_up.dim() == 0:
        raise ValueError(f"kernelforge.{name}: gate must have at least 1 dim to split into [gate | up], got a 0-dim tensor")
    torch._check(
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
    torch._check(
        tuple(grad_output.shape) == expected,
        lambda: f"kernelforge.{name}: grad_output must have shape {expected} (gate's with its last dim "
        f"halved), got {tuple(grad_output.shape)}",
    )
    return half


# ----------------------------------------------------------------------------- layouts
def _row_dim(x: torch.Tensor) -> int:
    """The dim rows run along for an elementwise op: the last, unless x's unit-stride dim is
    another one (transposed, channels-last): then that one, so the row view needs no copy."""
    last = max(x.dim() - 1, 0)
    if x.dim() <= 1 or x.stride(-1) == 1:
        return last
    for d in range(x.dim()):
        if x.stride(d) == 1 and x.shape[d] > 1:
            return d
    return last


def _activation_dim(x: torch.Tensor, bias: Optional[torch.Tensor]) -> int:
    return _row_dim(x) if bias is None else x.dim() - 1


# ----------------------------------------------------------------------------- implementations
# What the registered ops compute (and the eager fast path calls directly).
def _activation(x: torch.Tensor, bias: Optional[torch.Tensor], kind: str) -> torch.Tensor:
    name = _act_name(kind, bias)
    _check_activation(name, x, bias)
    dim = _activation_dim(x, bias)
    if x.numel() == 0:
        return empty_rows_output(x, dim)
    launchers = _launchers(x, bias, kind)
    bias = None if bias is None else bias.contiguous()
    return from_rows(launchers.act_forward_rows(rows_view(x, dim), bias, kind), x, dim)


def _activation_backward(
    grad_output: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], kind: str, need_bias_grad: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    name = _act_name(kind, bias) + "_backward"
    _check_activation(name, x, bias)
    _check_same_as(name, ("grad_output", "x"), grad_output, x)
    dim = _activation_dim(x, bias)
    if x.numel() == 0:
        grad_bias = torch.zeros_like(bias, memory_format=torch.contiguous_format) if need_bias_grad else None
        return empty_rows_output(x, dim), grad_bias
    launchers = _launchers(x, bias, kind)
    bias = None if bias is None else bias.contiguous()
    grad2d, grad_bias = launchers.act_backward_rows(rows_view(grad_output, dim), rows_view(x, dim), bias, kind, need_bias_grad)
    return from_rows(grad2d, x, dim), grad_bias


def _gated(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    _check_kind(GATED_OP, kind)
    _check_gated(_GATED_NAMES[kind], gate, up)
    dim = _row_dim(gate)
    if gate.numel() == 0:
        return empty_rows_output(gate, dim)
    y2d = _gated_launchers(gate, kind).glu_forward_rows(rows_view(gate, dim), rows_view(up, dim), kind)
    return from_rows(y2d, gate, dim)


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
    return y2d.view(out_shape)


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


# ----------------------------------------------------------------------------- double backward
# Gradients of the backward ops (for create_graph=True), in plain differentiable torch ops
# on the reference's derivatives, in float32 (float64 for float64).
def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _sum_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).sum(0)


def _activation_double_backward(ctx, v, bias_grad_output=None):
    """gx = g * act'(z), z = x + b  =>  dg = v act'(z), dx = v g act''(z), db = sum_rows(dx).
    With bias_activation_backward, gb = sum_rows(gx): its incoming gradient adds to v."""
    grad_output, x, bias = ctx.saved_tensors
    acc = _acc(x)
    v = v.to(acc)
    if bias_grad_output is not None:
        v = v + bias_grad_output.to(acc)
    z = x.to(acc) if bias is None else x.to(acc) + bias.to(acc)
    d_grad = v * activation_derivative(z, ctx.kind)
    d_x = v * grad_output.to(acc) * activation_second_derivative(z, ctx.kind)
    d_bias = None if bias is None else _sum_rows(d_x).to(bias.dtype)
    return d_grad.to(grad_output.dtype), d_x.to(x.dtype), d_bias, None


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


def _save_all_and_kind(ctx, inputs, output):
    ctx.save_for_backward(*(t for t in inputs if not isinstance(t, str)))
    ctx.kind = inputs[-1]


# ----------------------------------------------------------------------------- registration
@torch.library.custom_op("kernelforge::activation_backward", mutates_args=())
def activation_backward_op(grad_output: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], kind: str) -> torch.Tensor:
    return _activation_backward(grad_output, x, bias, kind, need_bias_grad=False)[0]


@activation_backward_op.register_fake
def _(grad_output, x, bias, kind):
    name = _act_name(kind, bias) + "_backward"
    _check_activation(name, x, bias)
    _check_same_as(name, ("grad_output", "x"), grad_output, x)
    return empty_rows_output(x, _activation_dim(x, bias))


activation_backward_op.register_autograd(_activation_double_backward, setup_context=_save_all_and_kind)


@torch.library.custom_op("kernelforge::bias_activation_backward", mutates_args=())
def bias_activation_backward_op(
    grad_output: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return _activation_backward(grad_output, x, bias, kind, need_bias_grad=True)


@bias_activation_backward_op.register_fake
def _(grad_output, x, bias, kind):
    name = _act_name(kind, bias) + "_backward"
    _check_activation(name, x, bias)
    _check_same_as(name, ("grad_output", "x"), grad_output, x)
    return empty_rows_output(x, _activation_dim(x, bias)), torch.empty_like(bias, memory_format=torch.contiguous_format)


bias_activation_backward_op.register_autograd(
    lambda ctx, v, w: _activation_double_backward(ctx, v, w), setup_context=_save_all_and_kind)


@torch.library.custom_op("kernelforge::activation", mutates_args=())
def activation_op(x: torch.Tensor, bias: Optional[torch.Tensor], kind: str) -> torch.Tensor:
    return _activation(x, bias, kind)


@activation_op.register_fake
def _(x, bias, kind):
    _check_activation(_act_name(kind, bias), x, bias)
    return empty_rows_output(x, _activation_dim(x, bias))


def _activation_grad(ctx, grad_output):
    x, bias = ctx.saved_tensors
    if bias is not None and ctx.needs_input_grad[1]:
        grad_x, grad_bias = bias_activation_backward_op(grad_output, x, bias, ctx.kind)
        return grad_x, grad_bias, None
    return activation_backward_op(grad_output, x, bias, ctx.kind), None, None


activation_op.register_autograd(_activation_grad, setup_context=_save_all_and_kind)


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


# ----------------------------------------------------------------------------- public functions
def _gelu_kind(name: str, approximate: str) -> str:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"kernelforge.{name}: approximate must be 'none' or 'tanh', got {approximate!r}")
    return "gelu_tanh" if approximate == "tanh" else "gelu"


# ----------------------------------------------------------------------------- eager fast path
# In plain eager mode (kernelforge.ops._common.plain_eager_call) the public functions skip
# the dispatcher, whose Python custom-op glue costs more than these kernels at small
# shapes. The autograd.Functions below run the same implementations and reuse the
# registered ops' gradient functions (which read only ctx.saved_tensors, ctx.kind and
# ctx.needs_input_grad), so a double backward goes through the registered backward ops.
def _needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _EagerActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, kind):
        _save_all_and_kind(ctx, (x, bias, kind), None)
        return _activation(x, bias, kind)

    @staticmethod
    def backward(ctx, grad_output):
        if torch.is_grad_enabled():  # create_graph=True: the registered ops carry gradients
            return _activation_grad(ctx, grad_output)
        x, bias = ctx.saved_tensors
        need_bias_grad = bias is not None and ctx.needs_input_grad[1]
        grad_x, grad_bias = _activation_backward(grad_output, x, bias, ctx.kind, need_bias_grad)
        return grad_x, grad_bias, None


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


def _call_activation(x: torch.Tensor, bias: Optional[torch.Tensor], kind: str) -> torch.Tensor:
    if not plain_eager_call(x, bias):
        return torch.ops.kernelforge.activation(x, bias, kind)
    if _needs_grad(x, bias):
        return _EagerActivation.apply(x, bias, kind)
    return _activation(x, bias, kind)


def _call_gated(gate: torch.Tensor, up: Optional[torch.Tensor], kind: str) -> torch.Tensor:
    if up is None:
        if not plain_eager_call(gate):
            return torch.ops.kernelforge.gated_activation_packed(gate, kind)
        return _EagerGatedPacked.apply(gate, kind) if _needs_grad(gate) else _gated_packed(gate, kind)
    if not plain_eager_call(gate, up):
        return torch.ops.kernelforge.gated_activation(gate, up, kind)
    return _EagerGated.apply(gate, up, kind) if _needs_grad(gate, up) else _gated(gate, up, kind)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU, x * Phi(x) (erf form), or with approximate="tanh" torch's tanh approximation.
    Any rank and layout; float32 math; differentiable; works under torch.compile."""
    return _call_activation(x, None, _gelu_kind("gelu", approximate))


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU (swish), x * sigmoid(x)."""
    return _call_activation(x, None, "silu")


def relu(x: torch.Tensor) -> torch.Tensor:
    """ReLU, max(x, 0) (NaN stays NaN; gradient 0 at 0, as torch)."""
    return _call_activation(x, None, "relu")


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(x + bias) in one pass, bias of shape (x.shape[-1],); x + bias is not rounded
    on the way. The bias may have another float dtype than x (e.g. a float32 bias with
    bfloat16 activations); the result has x's dtype, the bias gradient bias's."""
    return _call_activation(x, bias, _gelu_kind("bias_gelu", approximate))


def bias_silu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """silu(x + bias) in one pass; see bias_gelu."""
    return _call_activation(x, bias, "silu")


def swiglu(gate: torch.Tensor, up: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(gate) * up. With up=None, gate holds [gate | up] along its last dim (split as
    torch.chunk(gate, 2, -1) would) and its gradient comes back as one tensor."""
    return _call_gated(gate, up, "silu")


def geglu(gate: torch.Tensor, up: Optional[torch.Tensor] = None, approximate: str = "none") -> torch.Tensor:
    """gelu(gate) * up (approximate as in gelu); up=None as in swiglu."""
    return _call_gated(gate, up, _gelu_kind("geglu", approximate))


__all__ = ["bias_gelu", "bias_silu", "geglu", "gelu", "relu", "silu", "swiglu"]
