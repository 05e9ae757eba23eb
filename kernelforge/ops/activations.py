"""Activations (gelu, gelu_tanh, silu, relu) and bias + activation: schemas, input checks,
fake implementations, autograd, dispatch. Gated activations (swiglu, geglu) build on
these helpers in kernelforge/ops/gated_activations.py.

Registered ops (each with a fake implementation and autograd; kind is one of
"gelu", "gelu_tanh", "silu", "relu"):
    kernelforge::activation(Tensor x, Tensor? bias, str kind) -> Tensor
        act(x + bias), bias None or (n,) along x's last dim
    kernelforge::activation_backward(Tensor grad_output, Tensor x, Tensor? bias, str kind) -> Tensor
        grad_x only (no bias, or a bias that needs no gradient)
    kernelforge::bias_activation_backward(Tensor grad_output, Tensor x, Tensor bias, str kind)
        -> (Tensor, Tensor)                 grad_x and grad_bias in one pass

Two backward ops for one forward because a custom op cannot return an optional tensor:
the bias gradient comes from its own op when autograd asks for it.

Backends (registry "activation": act_forward_rows, act_backward_rows): triton, cuda
(gelu and gelu_tanh), reference. See kernelforge/reference/activations.py for the
launcher interface.

Layout: elementwise without a bias, so rows run along x's unit-stride dim (the last one
for contiguous x): a transposed or channels-last input is a row view without a copy, and
the output keeps its layout, as torch's elementwise ops do. A bias runs along the last
dim, so then rows run along the last dim.
"""
from __future__ import annotations

from typing import Optional

import torch

from kernelforge import backends
from kernelforge._rows import empty_rows_output, from_rows, rows_view
from kernelforge.ops._common import (FLOAT_DTYPES, GPU_FLOAT_DTYPES, check_floating, check_same, not_a_view,
                                     plain_eager_call, require)
from kernelforge.reference.activations import KINDS, activation_derivative, activation_second_derivative

OP = "activation"  # backend registry name (kernelforge.explain(OP, x, bias=..., kind=...))
CUDA_KINDS = ("gelu", "gelu_tanh")

# Names the messages use: the public function a user called.
_ACT_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu", "silu": "silu", "relu": "relu"}


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


def _why_not_reference(*inputs, **options):
    return None


# Below this many elements a call is bound by host time: the CUDA extension's launcher takes
# ~9 us against Triton's ~50 us (H100 host); from it up the two run at the same speed
# forward and Triton's backward is faster (150 against 192 us at 16384x4096 bf16).
SMALL_INPUT_ELEMENTS = 1 << 20


def _preference(x: torch.Tensor, *inputs, **options):
    """Fastest-first backend order for these inputs."""
    if x.device.type != "cuda":
        return ("reference",), "the reference is the CPU implementation"
    if x.numel() < SMALL_INPUT_ELEMENTS:
        return ("cuda", "triton", "reference"), (
            f"under {SMALL_INPUT_ELEMENTS} elements host time dominates and the CUDA extension launches in ~9 us "
            "against Triton's ~50 us (H100); CUDA covers gelu and gelu_tanh, Triton the rest")
    return ("triton", "cuda", "reference"), (
        f"from {SMALL_INPUT_ELEMENTS} elements up Triton is as fast forward and faster backward (H100)")


def _choice_key(x: torch.Tensor, bias: Optional[torch.Tensor] = None, kind: str = "gelu"):
    # everything _preference and the _why_not_* predicates look at
    return x.device.type, x.dtype, None if bias is None else bias.dtype, kind, x.numel() < SMALL_INPUT_ELEMENTS


backends.register(OP, "triton", "kernelforge.triton.activations", _why_not_triton)
backends.register(OP, "cuda", "kernelforge.cuda.activations", _why_not_cuda)
backends.register(OP, "reference", "kernelforge.reference.activations", _why_not_reference)
backends.set_preference(OP, _preference, _choice_key)


def _launchers(x: torch.Tensor, bias: Optional[torch.Tensor], kind: str):
    return backends.select(OP, x, bias=bias, kind=kind).implementation.launchers()


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
    require(
        bias.dim() == 1 and bias.shape[0] == x.shape[-1],
        lambda: f"kernelforge.{name}: bias must have shape ({x.shape[-1]},) (x's last dim), got {tuple(bias.shape)}",
    )


def _check_same_as(name: str, names: tuple[str, str], a: torch.Tensor, b: torch.Tensor) -> None:
    check_same(name, "device", names, (a.device, b.device))
    check_same(name, "dtype", names, (a.dtype, b.dtype))
    check_same(name, "shape", names, (tuple(a.shape), tuple(b.shape)))


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
    # not a view (ops._common.not_a_view): in-place ops on it work as on torch's outputs
    return not_a_view(from_rows(launchers.act_forward_rows(rows_view(x, dim), bias, kind), x, dim))


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


def _call_activation(x: torch.Tensor, bias: Optional[torch.Tensor], kind: str) -> torch.Tensor:
    if not plain_eager_call(x, bias):
        return torch.ops.kernelforge.activation(x, bias, kind)
    if _needs_grad(x, bias):
        return _EagerActivation.apply(x, bias, kind)
    return _activation(x, bias, kind)


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


__all__ = ["bias_gelu", "bias_silu", "gelu", "relu", "silu"]
