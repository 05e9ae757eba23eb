"""Bias + GELU through the CUDA extension "activations" (csrc/activations_cuda.cu +
csrc/activations_binding.cpp): the row launchers of the backend contract.

Only kind "gelu" (erf form) and "gelu_tanh" (torch's approximate="tanh"), with or without
a bias, have CUDA kernels; every other kind and the GLU launchers raise. The kernels run on
the current CUDA stream of the input's device; the bias may be float32 / float16 / bfloat16
independently of x, and grad_bias has the bias's dtype.
"""
from __future__ import annotations

from types import ModuleType

from kernelforge.cuda.compiler import get_cuda_compiler

KINDS = ("gelu", "gelu_tanh")


def _extension() -> ModuleType:
    return get_cuda_compiler().load("activations")


def _tanh_form(kind: str) -> bool:
    if kind not in KINDS:
        raise NotImplementedError(
            f"the CUDA activation kernels implement kind {' and '.join(map(repr, KINDS))} (bias + GELU); "
            f"got {kind!r}: use the Triton or reference backend")
    return kind == "gelu_tanh"


def act_forward_rows(x2d, bias, kind: str):
    """y2d = act(x2d + bias), a new dense tensor."""
    tanh_form = _tanh_form(kind)  # raises for other kinds before any build
    return _extension().forward(x2d, bias, tanh_form)


def act_backward_rows(grad2d, x2d, bias, kind: str, need_bias_grad: bool):
    """(grad_x2d, grad_bias or None): grad_x = grad * act'(x + bias) recomputed from x;
    grad_bias = its column sums in the bias's dtype (deterministic two-stage reduction)."""
    tanh_form = _tanh_form(kind)
    grad_x, grad_bias = _extension().backward(grad2d, x2d, bias, tanh_form, bool(need_bias_grad))
    return grad_x, grad_bias


def glu_forward_rows(gate2d, up2d, kind: str):
    raise NotImplementedError("the CUDA activation kernels do not implement GLU (swiglu / geglu): "
                              "use the Triton or reference backend")


def glu_backward_rows(grad2d, gate2d, up2d, kind: str):
    raise NotImplementedError("the CUDA activation kernels do not implement GLU (swiglu / geglu): "
                              "use the Triton or reference backend")
