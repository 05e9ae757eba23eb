"""Layer norm / RMS norm through the CUDA extension "norms" (csrc/norms_forward.cu,
csrc/norms_backward.cu, csrc/norms_binding.cpp): the row launchers of the backend contract, and the support
predicate the ops module asks before choosing this backend.

The kernels run on the current CUDA stream of the input's device. Weight and bias may have
any of float32 / float16 / bfloat16, independently of x (the kernels read them by a
run-time dtype code). grad_bias comes back as float32: the backward is not given the bias,
so the caller casts it to the bias's dtype, as for the reference.
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from kernelforge.cuda.compiler import get_cuda_compiler

GPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_COLS = 1 << 30  # kernelforge::cuda_norms::kMaxCols


def _extension() -> ModuleType:
    return get_cuda_compiler().load("norms")


def why_not(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None):
    """None when the CUDA norm kernels take these inputs, else why not (plain Python: it is
    on the per-call path). Does not check that the extension builds: the ops module asks
    kernelforge.cuda.why_unavailable("norms") for that."""
    if x.device.type != "cuda":
        return f"the CUDA extension runs on CUDA tensors, got a {x.device.type} tensor"
    if x.dtype not in GPU_DTYPES:
        return f"the CUDA norm kernels take float32/float16/bfloat16, got x of {x.dtype}"
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.dtype not in GPU_DTYPES:
            return f"the CUDA norm kernels take a float32/float16/bfloat16 {name}, got {p.dtype}"
    n = x.shape[-1] if x.dim() else 1
    if n > MAX_COLS:
        return f"the CUDA norm kernels take rows of at most {MAX_COLS} elements, got {n}"
    return None


def norm_forward_rows(x2d, residual2d, weight, bias, eps: float, rms: bool, offset: float):
    """(y2d, residual_out2d or None, mean or None, rstd); see kernelforge/reference/norms.py."""
    y, residual_out, mean, rstd = _extension().forward(x2d, residual2d, weight, bias, float(eps), bool(rms),
                                                       float(offset))
    return y, residual_out, mean, rstd


def norm_backward_rows(grad_y2d, grad_residual2d, h2d, weight, bias_dtype: Optional[torch.dtype], mean, rstd,
                       rms: bool, offset: float, need_weight_grad: bool):
    """(grad_h2d, grad_weight or None (weight's dtype), grad_bias or None (bias_dtype; the kernel sums
    in float32))."""
    grad_h, grad_weight, grad_bias = _extension().backward(
        grad_y2d, grad_residual2d, h2d, weight, bias_dtype is not None, mean, rstd, bool(rms), float(offset),
        bool(need_weight_grad))
    return grad_h, grad_weight, None if grad_bias is None else grad_bias.to(bias_dtype)
