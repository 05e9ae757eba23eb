"""ConvRNN: schemas, input checks, fake implementations, autograd, dispatch.

    out, h_T = kernelforge.convrnn(x, kernel, hidden)    # also kernelforge.convrnn_forward
    h_0 = hidden;  h_t = tanh(x[:, t-1] + conv1d(h_{t-1}, kernel, padding=K // 2)),  t = 1..T

x (batch, time, features), kernel (1, 1, K) with K odd, hidden (batch, features), one float
dtype and one device; out (batch, time, features) holds h_1..h_T. Definition and backward
formulas: kernelforge/reference/convrnn.py.

Ops (kernelforge.ops._opdef.define_op: a fake, autograd, the lean eager call):
    kernelforge::convrnn(Tensor x, Tensor kernel, Tensor hidden) -> (Tensor, Tensor)
    kernelforge::convrnn_backward(Tensor grad_out, Tensor grad_h, Tensor kernel, Tensor hidden,
                                  Tensor out) -> (Tensor, Tensor, Tensor)
Launch ops of the CUDA backend (torch.library.define; launchers, not op definitions):
    kernelforge::convrnn_cuda_forward / convrnn_cuda_backward: the same two signatures, the
        CUDA backend. Their schemas and fakes are defined here, once; their CUDA kernels are
        registered from C++ (TORCH_LIBRARY_IMPL in kernelforge/cuda/csrc/convrnn_binding.cpp)
        when the extension loads, so the schema exists (for fake tensors, opcheck, compile)
        on machines that cannot build the extension.

The backward op has no gradient of its own: create_graph=True through convrnn raises.

Under torch.compile the ops decompose into the Triton kernels (Inductor launches them) or the
reference's torch ops, whichever the choice is; a choice of the CUDA backend keeps the op whole
(its launch op is opaque). While tracing, the Triton kernels rank ahead of the CUDA ones.
"""
from __future__ import annotations

import torch

from kernelforge import backends
from kernelforge.ops._common import FLOAT_DTYPES, GPU_FLOAT_DTYPES, check_floating, check_same
from kernelforge.ops._opdef import define_op

OP = "convrnn"
NAME = "convrnn"


# ----------------------------------------------------------------------------- checks
def _check(x: torch.Tensor, kernel: torch.Tensor, hidden: torch.Tensor) -> None:
    for arg, t in (("x", x), ("kernel", kernel), ("hidden", hidden)):
        check_floating(NAME, arg, t, FLOAT_DTYPES)
    if x.dim() != 3:
        raise ValueError(f"kernelforge.{NAME}: x must be 3-D (batch, time, features), got shape {tuple(x.shape)}")
    if kernel.dim() != 3 or kernel.shape[0] != 1 or kernel.shape[1] != 1 or kernel.shape[2] % 2 == 0:
        raise ValueError(f"kernelforge.{NAME}: kernel must have shape (1, 1, K) with K odd, got {tuple(kernel.shape)}")
    if tuple(hidden.shape) != (x.shape[0], x.shape[2]):
        raise ValueError(f"kernelforge.{NAME}: hidden must have shape (batch, features) = {(x.shape[0], x.shape[2])}"
                         f" to match x {tuple(x.shape)}, got {tuple(hidden.shape)}")
    names = ("x", "kernel", "hidden")
    check_same(NAME, "dtype", names, (x.dtype, kernel.dtype, hidden.dtype))
    check_same(NAME, "device", names, (x.device, kernel.device, hidden.device))


def _check_backward(grad_out, grad_h, kernel, hidden, out) -> None:
    _check(out, kernel, hidden)
    for arg, t, like in (("grad_out", grad_out, out), ("grad_h", grad_h, hidden)):
        if tuple(t.shape) != tuple(like.shape) or t.dtype != like.dtype or t.device != like.device:
            raise ValueError(f"kernelforge.{NAME}_backward: {arg} must match shape {tuple(like.shape)}, dtype "
                             f"{like.dtype} and device {like.device}; got {tuple(t.shape)}, {t.dtype}, {t.device}")


# ----------------------------------------------------------------------------- dispatch
# The predicates and the preference take `backward`: the two directions are chosen apart.
def _why_not_triton(x: torch.Tensor, kernel: torch.Tensor, backward: bool = False):
    from kernelforge.triton import why_unavailable
    from kernelforge.triton.convrnn import why_not

    if x.dtype not in GPU_FLOAT_DTYPES:
        return f"Triton kernels take float32/float16/bfloat16, got {x.dtype}"
    return why_not(x, kernel) or why_unavailable(x.device)


def _why_not_cuda(x: torch.Tensor, kernel: torch.Tensor, backward: bool = False):
    from kernelforge.cuda import why_unavailable
    from kernelforge.cuda.convrnn import why_not

    return why_not(x, kernel) or why_unavailable("convrnn")


def _why_not_reference(x: torch.Tensor, kernel: torch.Tensor, backward: bool = False):
    return None


# H200, bf16, batch 8, 3 taps (results/nvidia-h200/0.1.0/convrnn/2a6b9ef-backward/), ms forward, then
# forward + backward, Triton / CUDA:
#   T16 F64 0.063 / 0.038, 0.34 / 0.27       T16 F4096 0.059 / 0.043, 0.32 / 0.25
#   T256 F1024 0.38 / 0.23, 0.75 / 0.35      T4096 F64 1.50 / 2.38, 4.28 / 3.84
#   T4096 F1024 6.02 / 3.55, 12.8 / 5.35     T4096 F4096 10.37 / 10.41, 23.7 / 14.4
# The CUDA backward is the faster at every shape; the forward too, but for long sequences of
# narrow rows (Triton 1.6x at T4096 F64), where one program's whole row fits a few warps.
FEW_STEPS = 64
TRITON_FORWARD_FEATURES = 256


def _preference(x: torch.Tensor, kernel: torch.Tensor, backward: bool = False):
    if x.device.type != "cuda":
        return ("reference",), "the reference is the CPU implementation"
    if not backward and x.shape[1] > FEW_STEPS and x.shape[-1] <= TRITON_FORWARD_FEATURES:
        return ("triton", "cuda", "reference"), (
            f"forward over more than {FEW_STEPS} steps of at most {TRITON_FORWARD_FEATURES} features: the Triton "
            "kernel measured faster (H200)")
    return ("cuda", "triton", "reference"), ("the CUDA kernels measured faster here (H200: every backward, and the "
                                             "forward but for long sequences of narrow rows)")


def _choice_key(x: torch.Tensor, kernel: torch.Tensor, backward: bool = False):
    return x.device.type, x.dtype, x.shape[1] <= FEW_STEPS, x.shape[-1], kernel.shape[-1], backward


backends.register(OP, "triton", "kernelforge.triton.convrnn", _why_not_triton)
backends.register(OP, "cuda", "kernelforge.cuda.convrnn", _why_not_cuda)
backends.register(OP, "reference", "kernelforge.reference.convrnn", _why_not_reference)
backends.set_preference(OP, _preference, _choice_key)


# ----------------------------------------------------------------------------- registration
def _fake_forward(x, kernel, hidden):
    _check(x, kernel, hidden)
    return x.new_empty(x.shape), x.new_empty(hidden.shape)


def _fake_backward(grad_out, grad_h, kernel, hidden, out):
    _check_backward(grad_out, grad_h, kernel, hidden, out)
    return out.new_empty(out.shape), kernel.new_empty(kernel.shape), hidden.new_empty(hidden.shape)


for _name, _schema, _fake in (
    ("convrnn_cuda_forward", "(Tensor x, Tensor kernel, Tensor hidden) -> (Tensor, Tensor)", _fake_forward),
    ("convrnn_cuda_backward", "(Tensor grad_out, Tensor grad_h, Tensor kernel, Tensor hidden, Tensor out) -> "
                              "(Tensor, Tensor, Tensor)", _fake_backward),
):
    torch.library.define(f"kernelforge::{_name}", _schema)
    torch.library.register_fake(f"kernelforge::{_name}", _fake)


def _forward(x: torch.Tensor, kernel: torch.Tensor, hidden: torch.Tensor):
    _check(x, kernel, hidden)
    return _choose(x, kernel).implementation.launchers().convrnn_forward(x, kernel, hidden)


def _backward(grad_out, grad_h, kernel, hidden, out):
    _check_backward(grad_out, grad_h, kernel, hidden, out)
    launchers = _choose(out, kernel, backward=True).implementation.launchers()
    return tuple(t.contiguous() for t in launchers.convrnn_backward(grad_out, grad_h, kernel, hidden, out))


def _choose(x: torch.Tensor, kernel: torch.Tensor, backward: bool = False) -> backends.Choice:
    return backends.select(OP, x, kernel, backward=backward)


# No gradient of its own: create_graph=True through convrnn raises.
convrnn_backward_op = define_op(
    "kernelforge::convrnn_backward(Tensor grad_out, Tensor grad_h, Tensor kernel, Tensor hidden, Tensor out) "
    "-> (Tensor, Tensor, Tensor)",
    impl=_backward, fake=_fake_backward,
    choose=lambda grad_out, grad_h, kernel, hidden, out: _choose(out, kernel, backward=True))


def _save(ctx, inputs, output):
    _, kernel, hidden = inputs
    ctx.save_for_backward(kernel, hidden, output[0])


def _gradients(ctx, grad_out, grad_h):
    kernel, hidden, out = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    grad_h = torch.zeros_like(hidden) if grad_h is None else grad_h
    return convrnn_backward_op(grad_out, grad_h, kernel, hidden, out)


convrnn_op = define_op(
    "kernelforge::convrnn(Tensor x, Tensor kernel, Tensor hidden) -> (Tensor, Tensor)",
    impl=_forward, fake=_fake_forward,
    choose=lambda x, kernel, hidden: _choose(x, kernel),
    setup_context=_save, backward=_gradients)


def convrnn(x: torch.Tensor, kernel: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, h_T) of the ConvRNN recurrence over x's time axis (see the module docstring).
    The state is carried in float32 for low-precision inputs; differentiable in x, kernel and
    hidden (backward through time); works under torch.compile."""
    return convrnn_op(x, kernel, hidden)


convrnn_forward = convrnn  # the earlier public name, kept
