"""Activations (gelu, gelu_tanh, silu, relu) and bias + activation: schemas, input checks,
fake implementations, autograd, dispatch, each op defined once (kernelforge.ops._opdef).
Gated activations (swiglu, geglu) build on these helpers in
kernelforge/ops/gated_activations.py.

Registered ops (each with a fake implementation and autograd; kind is one of
"gelu", "gelu_tanh", "silu", "relu"):
    kernelforge::activation(Tensor x, Tensor? bias, str kind) -> Tensor
        act(x + bias), bias None or (n,) along x's last dim
    kernelforge::activation_backward(Tensor grad_output, Tensor x, Tensor? bias, str kind) -> Tensor
        grad_x only (no bias, or a bias that needs no gradient)
    kernelforge::bias_activation_backward(Tensor grad_output, Tensor x, Tensor bias, str kind)
        -> (Tensor, Tensor)                 grad_x and grad_bias in one pass

Two backward ops for one forward because a custom op cannot return an optional tensor:
the bias gradient comes from its own op when autograd asks for it. The Op objects
(activation_op, activation_backward_op, bias_activation_backward_op) are the calls to make:
direct in plain eager mode, the registered op elsewhere.

Backends (registry "activation": act_forward_rows, act_backward_rows): triton, cuda
(gelu and gelu_tanh), reference. See kernelforge/reference/activations.py for the
launcher interface. Under torch.compile the Triton kernels and the reference are traced into
the graph (Inductor launches the kernels); the CUDA extension stays one opaque op.

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
from kernelforge.ops._common import FLOAT_DTYPES, GPU_FLOAT_DTYPES, check_floating, check_same, require
from kernelforge.ops._opdef import define_op
from kernelforge.reference._accumulation import accumulation_dtype
from kernelforge.reference.activations import KINDS, activation_derivative, activation_second_derivative

OP = "activation"  # backend registry name (kernelforge.explain(OP, x, bias=..., kind=...))
CUDA_KINDS = ("gelu", "gelu_tanh")

# Names the messages use: the public function a user called.
_ACT_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu", "silu": "silu", "relu": "relu"}


# ----------------------------------------------------------------------------- dispatch
def _why_not_triton(x: torch.Tensor, bias: Optional[torch.Tensor] = None, kind: str = "gelu", backward: bool = False):
    from kernelforge.triton import why_unavailable

    for name, t in (("x", x), ("bias", bias)):
        if t is not None and t.dtype not in GPU_FLOAT_DTYPES:
            return f"Triton kernels take float32/float16/bfloat16, got {name} of {t.dtype}"
    return why_unavailable(x.device)


def _why_not_cuda(x: torch.Tensor, bias: Optional[torch.Tensor] = None, kind: str = "gelu", backward: bool = False):
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


# Measured on an H200 (bf16, device time, 16x4096 to 2048x4096 and 8192x768): Triton's backward
# kernels take less device time than the CUDA extension's at every size (0.70-0.97x with the
# forward), and so does its forward below this many elements (0.76-0.97x); from it up the CUDA
# forward of gelu is 1-9% faster (bias + gelu at 8192x768: 23%). With its eager plan a Triton call
# also costs less host time than the extension's.
CUDA_FORWARD_MIN_ELEMENTS = 1 << 20


def _preference(x: torch.Tensor, *inputs, backward: bool = False, **options):
    """Fastest-first backend order for these inputs."""
    if x.device.type != "cuda":
        return ("reference",), "the reference is the CPU implementation"
    if not backward and x.numel() >= CUDA_FORWARD_MIN_ELEMENTS:
        return ("cuda", "triton", "reference"), (
            f"forward from {CUDA_FORWARD_MIN_ELEMENTS} elements up the CUDA gelu kernels take 1-23% less device time "
            "(H200); CUDA covers gelu and gelu_tanh, Triton the rest")
    return ("triton", "cuda", "reference"), (
        "Triton's kernels take less device time (H200: backward at every size, forward below "
        f"{CUDA_FORWARD_MIN_ELEMENTS} elements) and, with their eager plans, less host time a call")


def _choice_key(x: torch.Tensor, bias: Optional[torch.Tensor] = None, kind: str = "gelu", backward: bool = False):
    # everything _preference and the _why_not_* predicates look at
    return (x.device.type, x.dtype, None if bias is None else bias.dtype, kind,
            not backward and x.numel() >= CUDA_FORWARD_MIN_ELEMENTS)


backends.register(OP, "triton", "kernelforge.triton.activations", _why_not_triton)
# kf.explain("silu", x) and the like: the public names, each with the kind it runs
backends.register_alias("gelu", OP, kind="gelu")
backends.register_alias("silu", OP, kind="silu")
backends.register_alias("relu", OP, kind="relu")
backends.register_alias("bias_gelu", OP, kind="gelu")
backends.register_alias("bias_silu", OP, kind="silu")
backends.register(OP, "cuda", "kernelforge.cuda.activations", _why_not_cuda)
backends.register(OP, "reference", "kernelforge.reference.activations", _why_not_reference)
backends.set_preference(OP, _preference, _choice_key)


def _choose(x: torch.Tensor, bias: Optional[torch.Tensor], kind: str, backward: bool = False) -> backends.Choice:
    return backends.select(OP, x, bias=bias, kind=kind, backward=backward)


# ----------------------------------------------------------------------------- checks
# check_kind, check_same_as, row_dim, save_inputs_and_kind and gelu_kind serve the gated ops too.
def check_kind(name: str, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kernelforge.{name}: kind must be one of {KINDS}, got {kind!r}")


def _act_name(kind: str, bias: Optional[torch.Tensor]) -> str:
    check_kind(OP, kind)
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


def check_same_as(name: str, names: tuple[str, str], a: torch.Tensor, b: torch.Tensor) -> None:
    check_same(name, "device", names, (a.device, b.device))
    check_same(name, "dtype", names, (a.dtype, b.dtype))
    check_same(name, "shape", names, (tuple(a.shape), tuple(b.shape)))


# ----------------------------------------------------------------------------- layouts
def row_dim(x: torch.Tensor) -> int:
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
    return row_dim(x) if bias is None else x.dim() - 1


# ----------------------------------------------------------------------------- implementations
# What the ops compute: the eager call runs these directly, the registered ops through torch.ops,
# and torch.compile traces them (for a traceable backend).
def _activation(x: torch.Tensor, bias: Optional[torch.Tensor], kind: str) -> torch.Tensor:
    name = _act_name(kind, bias)
    _check_activation(name, x, bias)
    dim = _activation_dim(x, bias)
    if x.numel() == 0:
        return empty_rows_output(x, dim)
    launchers = _choose(x, bias, kind).implementation.launchers()
    bias = None if bias is None else bias.contiguous()
    return from_rows(launchers.act_forward_rows(rows_view(x, dim), bias, kind), x, dim)


def _activation_backward(
    grad_output: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], kind: str, need_bias_grad: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    dim = _check_backward(grad_output, x, bias, kind)
    if x.numel() == 0:
        grad_bias = torch.zeros_like(bias, memory_format=torch.contiguous_format) if need_bias_grad else None
        return empty_rows_output(x, dim), grad_bias
    launchers = _choose(x, bias, kind, backward=True).implementation.launchers()
    bias = None if bias is None else bias.contiguous()
    grad2d, grad_bias = launchers.act_backward_rows(rows_view(grad_output, dim), rows_view(x, dim), bias, kind, need_bias_grad)
    return from_rows(grad2d, x, dim), grad_bias


def _check_backward(grad_output: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], kind: str) -> int:
    """The backward ops' checks; returns the dim rows run along."""
    name = _act_name(kind, bias) + "_backward"
    _check_activation(name, x, bias)
    check_same_as(name, ("grad_output", "x"), grad_output, x)
    return _activation_dim(x, bias)


def _fake_activation(x: torch.Tensor, bias: Optional[torch.Tensor], kind: str) -> torch.Tensor:
    _check_activation(_act_name(kind, bias), x, bias)
    return empty_rows_output(x, _activation_dim(x, bias))


def _fake_activation_backward(grad_output, x, bias, kind) -> torch.Tensor:
    return empty_rows_output(x, _check_backward(grad_output, x, bias, kind))


def _fake_bias_activation_backward(grad_output, x, bias, kind) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x = empty_rows_output(x, _check_backward(grad_output, x, bias, kind))
    return grad_x, torch.empty_like(bias, memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------- gradients
def save_inputs_and_kind(ctx, inputs, output) -> None:
    """setup_context of every activation op (the gated ones too): the tensor inputs, and the kind."""
    ctx.save_for_backward(*(t for t in inputs if not isinstance(t, str)))
    ctx.kind = inputs[-1]


def _activation_grad(ctx, grad_output):
    x, bias = ctx.saved_tensors
    if bias is not None and ctx.needs_input_grad[1]:
        grad_x, grad_bias = bias_activation_backward_op(grad_output, x, bias, ctx.kind)
        return grad_x, grad_bias, None
    return activation_backward_op(grad_output, x, bias, ctx.kind), None, None


def _sum_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).sum(0)


# Gradients of the backward ops (for create_graph=True), in plain differentiable torch ops
# on the reference's derivatives, in float32 (float64 for float64).
def _activation_double_backward(ctx, v, bias_grad_output=None):
    """gx = g * act'(z), z = x + b  =>  dg = v act'(z), dx = v g act''(z), db = sum_rows(dx).
    With bias_activation_backward, gb = sum_rows(gx): its incoming gradient adds to v."""
    grad_output, x, bias = ctx.saved_tensors
    acc = accumulation_dtype(x.dtype)
    v = v.to(acc)
    if bias_grad_output is not None:
        v = v + bias_grad_output.to(acc)
    z = x.to(acc) if bias is None else x.to(acc) + bias.to(acc)
    d_grad = v * activation_derivative(z, ctx.kind)
    d_x = v * grad_output.to(acc) * activation_second_derivative(z, ctx.kind)
    d_bias = None if bias is None else _sum_rows(d_x).to(bias.dtype)
    return d_grad.to(grad_output.dtype), d_x.to(x.dtype), d_bias, None


# ----------------------------------------------------------------------------- definitions
activation_backward_op = define_op(
    "kernelforge::activation_backward(Tensor grad_output, Tensor x, Tensor? bias, str kind) -> Tensor",
    impl=lambda grad_output, x, bias, kind: _activation_backward(grad_output, x, bias, kind, False)[0],
    fake=_fake_activation_backward,
    choose=lambda grad_output, x, bias, kind: _choose(x, bias, kind, backward=True),
    setup_context=save_inputs_and_kind, backward=_activation_double_backward)

bias_activation_backward_op = define_op(
    "kernelforge::bias_activation_backward(Tensor grad_output, Tensor x, Tensor bias, str kind) -> (Tensor, Tensor)",
    impl=lambda grad_output, x, bias, kind: _activation_backward(grad_output, x, bias, kind, True),
    fake=_fake_bias_activation_backward,
    choose=lambda grad_output, x, bias, kind: _choose(x, bias, kind, backward=True),
    setup_context=save_inputs_and_kind, backward=_activation_double_backward)

activation_op = define_op(
    "kernelforge::activation(Tensor x, Tensor? bias, str kind) -> Tensor",
    impl=_activation, fake=_fake_activation, choose=_choose,
    setup_context=save_inputs_and_kind, backward=_activation_grad)


# ----------------------------------------------------------------------------- public functions
def gelu_kind(name: str, approximate: str) -> str:
    """The kind for gelu's `approximate` ("none" or "tanh"), named in the message as `name`."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"kernelforge.{name}: approximate must be 'none' or 'tanh', got {approximate!r}")
    return "gelu_tanh" if approximate == "tanh" else "gelu"


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU, x * Phi(x) (erf form), or with approximate="tanh" torch's tanh approximation.
    Any rank and layout; float32 math; differentiable; works under torch.compile."""
    return activation_op(x, None, gelu_kind("gelu", approximate))


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU (swish), x * sigmoid(x)."""
    return activation_op(x, None, "silu")


def relu(x: torch.Tensor) -> torch.Tensor:
    """ReLU, max(x, 0) (NaN stays NaN; gradient 0 at 0, as torch)."""
    return activation_op(x, None, "relu")


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(x + bias) in one pass, bias of shape (x.shape[-1],); x + bias is not rounded
    on the way. The bias may have another float dtype than x (e.g. a float32 bias with
    bfloat16 activations); the result has x's dtype, the bias gradient bias's."""
    return activation_op(x, bias, gelu_kind("bias_gelu", approximate))


def bias_silu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """silu(x + bias) in one pass; see bias_gelu."""
    return activation_op(x, bias, "silu")


__all__ = ["bias_gelu", "bias_silu", "gelu", "relu", "silu"]
