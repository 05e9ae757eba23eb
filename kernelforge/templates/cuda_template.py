"""my_op through the CUDA extension "my_op" (csrc/my_op_cuda.cu + csrc/my_op_binding.cpp, found
by kernelforge/cuda/extensions.py's naming convention). Loading the extension runs its
TORCH_LIBRARY_IMPL block, which registers the kernels as the CUDA implementations of
kernelforge::my_op_cuda_forward / my_op_cuda_backward (schemas and fakes in
kernelforge/ops/my_op.py); the launchers call those operators.
"""
from __future__ import annotations

import torch

from kernelforge.cuda.compiler import get_cuda_compiler

GPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def why_not(x: torch.Tensor):
    """None when the CUDA kernels take x, else why not (kernelforge/ops/my_op.py asks
    kernelforge.cuda.why_unavailable("my_op") whether the extension builds)."""
    if x.device.type != "cuda":
        return f"the CUDA extension runs on CUDA tensors, got a {x.device.type} tensor"
    if x.dtype not in GPU_DTYPES:
        return f"the CUDA my_op kernels take float32/float16/bfloat16, got {x.dtype}"
    return None


def _registered() -> None:
    get_cuda_compiler().load("my_op")  # the first call builds or loads it, which registers the kernels


def my_op_forward(x: torch.Tensor) -> torch.Tensor:
    _registered()
    return torch.ops.kernelforge.my_op_cuda_forward(x)


def my_op_backward(grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    _registered()
    return torch.ops.kernelforge.my_op_cuda_backward(grad_y, x)
