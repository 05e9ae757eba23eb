"""ConvRNN through the CUDA extension "convrnn" (csrc/convrnn_cuda.cu + csrc/convrnn_binding.cpp).

Unlike the other extensions, nothing here calls the built module: loading it runs its
TORCH_LIBRARY_IMPL block, which registers the kernels as the CUDA implementations of
kernelforge::convrnn_cuda_forward / convrnn_cuda_backward (schemas and fakes in
kernelforge/ops/convrnn.py), and the launchers call those operators.
"""
from __future__ import annotations

import torch

from kernelforge.cuda.compiler import get_cuda_compiler

GPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_FEATURES = 16384  # kernelforge::cuda_convrnn::kMaxFeatures
MAX_TAPS = 15  # kernelforge::cuda_convrnn::kMaxTaps


def why_not(x: torch.Tensor, kernel: torch.Tensor):
    """None when the CUDA kernels take these inputs, else why not (the ops module asks
    kernelforge.cuda.why_unavailable("convrnn") whether the extension builds)."""
    if x.device.type != "cuda":
        return f"the CUDA extension runs on CUDA tensors, got a {x.device.type} tensor"
    if x.dtype not in GPU_DTYPES:
        return f"the CUDA ConvRNN kernels take float32/float16/bfloat16, got {x.dtype}"
    if x.shape[-1] > MAX_FEATURES:
        return (f"the CUDA ConvRNN kernels keep a row in shared memory: at most {MAX_FEATURES} features, "
                f"got {x.shape[-1]}")
    if kernel.shape[-1] > MAX_TAPS:
        return f"the CUDA ConvRNN kernels take at most {MAX_TAPS} taps, got {kernel.shape[-1]}"
    return None


def _registered() -> None:
    get_cuda_compiler().load("convrnn")  # the first call builds or loads it, which registers the kernels


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def convrnn_forward(x: torch.Tensor, kernel: torch.Tensor, hidden: torch.Tensor):
    _registered()
    return torch.ops.kernelforge.convrnn_cuda_forward(_unit_last(x), kernel, _unit_last(hidden))


def convrnn_backward(grad_out: torch.Tensor, grad_h: torch.Tensor, kernel: torch.Tensor, hidden: torch.Tensor,
                     out: torch.Tensor):
    _registered()
    return torch.ops.kernelforge.convrnn_cuda_backward(_unit_last(grad_out), _unit_last(grad_h), kernel,
                                                      _unit_last(hidden), out)
