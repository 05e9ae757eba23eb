"""softmax and log_softmax: schemas, input checks, fake implementations, autograd, dispatch.

Registered ops (each with a fake implementation):
    kernelforge::softmax(Tensor x, int dim) -> Tensor
    kernelforge::softmax_backward(Tensor grad_output, Tensor output, int dim) -> Tensor
    kernelforge::log_softmax(Tensor x, int dim) -> Tensor
    kernelforge::log_softmax_backward(Tensor grad_output, Tensor output, int dim) -> Tensor

Every backend implements the same two row launchers on (rows, n) views with unit column
stride: `softmax_forward_rows(x2d, log)` and `softmax_backward_rows(grad2d, out2d, log)`,
each returning a new dense (rows, n) tensor. This module turns any rank, `dim` and layout
into such a view (a copy only when the layout needs one) and back.

Output layout: dense with `dim` innermost, i.e. contiguous for dim=-1 and a permuted
view of a dense buffer otherwise (no transpose copy on the way out).
"""
from __future__ import annotations

import torch

from kernelforge import backends, tuning
from kernelforge._rows import empty_rows_output, from_rows, rows_view, run_rows
from kernelforge.ops._common import FLOAT_DTYPES, GPU_FLOAT_DTYPES, check_floating, check_same, normalize_dim
from kernelforge.ops._opdef import define_op
from kernelforge.reference._accumulation import accumulation_dtype

OP = "softmax"  # the backend registry's name for the family (softmax and log_softmax)


# ----------------------------------------------------------------------------- dispatch
def _why_not_triton(x: torch.Tensor, dim: int = -1, log: bool = False):
    from kernelforge.triton import why_unavailable

    if x.dtype not in GPU_FLOAT_DTYPES:
        return f"Triton kernels take float32/float16/bfloat16, got {x.dtype}"
    return why_unavailable(x.device)


def _why_not_cuda(x: torch.Tensor, dim: int = -1, log: bool = False):
    from kernelforge.cuda import why_unavailable

    if x.device.type != "cuda":
        return f"the CUDA extension runs on CUDA tensors, got a {x.device.type} tensor"
    if x.dtype not in GPU_FLOAT_DTYPES:
        return f"the CUDA kernels take float32/float16/bfloat16, got {x.dtype}"
    return why_unavailable("softmax")


def _why_not_reference(x: torch.Tensor, dim: int = -1, log: bool = False):
    return None


def _preference(x: torch.Tensor, dim: int = -1, log: bool = False):
    """Fastest-first backend order for these inputs."""
    if x.device.type != "cuda":
        return ("reference",), "the reference is the CPU implementation"
    return ("triton", "cuda", "reference"), (
        "Triton's kernels take less device time than the CUDA extension's at every size measured (H200, bf16, "
        "16x4096 to 2048x4096 and 8192x768: 0.61-0.99x forward, 0.67-0.92x forward+backward), and with its "
        "eager plan a call costs less host time too")


backends.register(OP, "triton", "kernelforge.triton.softmax", _why_not_triton)
backends.register(OP, "cuda", "kernelforge.cuda.softmax", _why_not_cuda)
backends.register(OP, "reference", "kernelforge.reference.softmax", _why_not_reference)
backends.register_alias("log_softmax", OP)  # kf.explain("log_softmax", x): the same kernels
def _choice_key(x: torch.Tensor, dim: int = -1, log: bool = False):
    # everything _preference and the _why_not_* predicates look at
    return x.device.type, x.dtype


backends.set_preference(OP, _preference, _choice_key)
backends.set_tuning(OP, tuning.SOFTMAX)  # measured on CUDA where it pays (kernelforge.tuning)


# ----------------------------------------------------------------------------- checks
def _check_input(name: str, x: torch.Tensor, dim: int) -> int:
    check_floating(name, "x", x, FLOAT_DTYPES)
    return normalize_dim(name, "dim", dim, x.dim())


def _check_backward(name: str, grad_output: torch.Tensor, output: torch.Tensor, dim: int) -> int:
    args = ("grad_output", "output")
    check_same(name, "device", args, (grad_output.device, output.device))
    check_same(name, "dtype", args, (grad_output.dtype, output.dtype))
    check_same(name, "shape", args, (tuple(grad_output.shape), tuple(output.shape)))
    check_floating(name, "output", output, FLOAT_DTYPES)
    return normalize_dim(name, "dim", dim, output.dim())


def _choose(x: torch.Tensor, dim: int) -> backends.Choice:
    return backends.select(OP, x, dim=dim)


def _forward_impl(name: str, log: bool):
    def forward(x: torch.Tensor, dim: int) -> torch.Tensor:
        dim = _check_input(name, x, dim)
        launchers = _choose(x, dim).implementation.launchers()
        return run_rows(x, dim, lambda x2d: launchers.softmax_forward_rows(x2d, log))

    return forward


def _backward_impl(name: str, log: bool):
    def backward(grad_output: torch.Tensor, output: torch.Tensor, dim: int) -> torch.Tensor:
        dim = _check_backward(name, grad_output, output, dim)
        if output.numel() == 0:
            return empty_rows_output(output, dim)
        launchers = _choose(output, dim).implementation.launchers()
        grad2d = launchers.softmax_backward_rows(rows_view(grad_output, dim), rows_view(output, dim), log)
        return from_rows(grad2d, output, dim)

    return backward


# ----------------------------------------------------------------------------- double backward
def _double_backward(ctx, grad_grad_input):
    """Gradients of the backward op (for create_graph=True), in plain differentiable ops.

    softmax:     gx = y*(g - <g,y>)   => dg = y*(v - <v,y>),  dy = v*(g - <g,y>) - g*<v,y>
    log_softmax: gx = g - e^y * sum g => dg = v - <v,e^y>,     dy = -v*e^y * sum g
    """
    grad_output, output = ctx.saved_tensors
    dim, log = ctx.dim, ctx.log
    v = grad_grad_input
    acc = accumulation_dtype(output.dtype)
    g, y, v = grad_output.to(acc), output.to(acc), v.to(acc)
    if log:
        ey = y.exp()
        d_grad = v - (v * ey).sum(dim, keepdim=True)
        d_out = -v * ey * g.sum(dim, keepdim=True)
    else:
        gy = (g * y).sum(dim, keepdim=True)
        vy = (v * y).sum(dim, keepdim=True)
        d_grad = y * (v - vy)
        d_out = v * (g - gy) - g * vy
    return d_grad.to(grad_output.dtype), d_out.to(output.dtype), None


# ----------------------------------------------------------------------------- definitions
def _define(name: str, log: bool):
    """kernelforge::<name> and <name>_backward, each with its fake and gradient; returns both."""
    backward_name = f"{name}_backward"

    def save_backward_inputs(ctx, inputs, output):
        grad_output, forward_output, dim = inputs
        ctx.save_for_backward(grad_output, forward_output)
        ctx.dim, ctx.log = dim, log

    backward_op = define_op(
        f"kernelforge::{backward_name}(Tensor grad_output, Tensor output, int dim) -> Tensor",
        impl=_backward_impl(backward_name, log),
        fake=lambda g, y, dim: empty_rows_output(y, _check_backward(backward_name, g, y, dim)),
        choose=lambda g, y, dim: _choose(y, dim),
        setup_context=save_backward_inputs, backward=_double_backward)

    def save_output(ctx, inputs, output):
        ctx.dim = inputs[1]
        ctx.save_for_backward(output)

    def gradient(ctx, grad_output):
        (output,) = ctx.saved_tensors
        return backward_op(grad_output, output, ctx.dim), None

    forward_op = define_op(
        f"kernelforge::{name}(Tensor x, int dim) -> Tensor",
        impl=_forward_impl(name, log),
        fake=lambda x, dim: empty_rows_output(x, _check_input(name, x, dim)),
        choose=lambda x, dim: _choose(x, dim),
        setup_context=save_output, backward=gradient)
    return forward_op, backward_op


softmax_op, softmax_backward_op = _define("softmax", log=False)
log_softmax_op, log_softmax_backward_op = _define("log_softmax", log=True)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """softmax along `dim`: exp(x - max) / sum(exp(x - max)), computed in float32 for
    low-precision inputs. Any rank and layout; differentiable; works under torch.compile."""
    return softmax_op(x, dim)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log of softmax along `dim`: x - max - log(sum(exp(x - max)))."""
    return log_softmax_op(x, dim)
