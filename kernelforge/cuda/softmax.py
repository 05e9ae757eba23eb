"""Softmax through the CUDA extension (csrc/softmax_cuda.cu + csrc/softmax_binding.cpp).

Row launchers for the backend registry, and `SoftMaxOp`, an object API over the compiled module.
The kernels run on the current CUDA stream of the input's device.
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Optional

import torch

from kernelforge._rows import empty_rows_output, rows_view, run_rows
from kernelforge.cuda.compiler import get_cuda_compiler


def _extension() -> ModuleType:
    return get_cuda_compiler().load("softmax")


def softmax_forward_rows(x2d: torch.Tensor, log: bool) -> torch.Tensor:
    return _extension().forward(x2d, log)


def softmax_backward_rows(grad2d: torch.Tensor, out2d: torch.Tensor, log: bool) -> torch.Tensor:
    return _extension().backward(grad2d, out2d, log)


class SoftMaxOp:
    """Softmax (or log-softmax) over the last dimension of a CUDA tensor of any rank.

    `cuda_module` is a module built from softmax_cuda.cu, e.g. by
    `get_cuda_compiler().compile_from_file("softmax_cuda.cu", "my_softmax")`; by default
    the package's cached build. This is the raw kernel: no autograd (use
    kernelforge.softmax for that), no dtype or device checks beyond the extension's own.
    """

    def __init__(self, cuda_module: Optional[ModuleType] = None, log: bool = False):
        self.module = cuda_module if cuda_module is not None else _extension()
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_rows(x, x.dim() - 1 if x.dim() else 0, lambda x2d: self.module.forward(x2d, self.log))

    def backward(self, grad_output: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        if grad_output.shape != output.shape:
            raise ValueError(
                f"SoftMaxOp.backward: grad_output shape {tuple(grad_output.shape)} != output shape {tuple(output.shape)}"
            )
        dim = output.dim() - 1 if output.dim() else 0
        if output.numel() == 0:
            return empty_rows_output(output, dim)
        grad2d = rows_view(grad_output, dim)
        return run_rows(output, dim, lambda out2d: self.module.backward(grad2d, out2d, self.log))

    __call__ = forward


@functools.lru_cache(maxsize=None)
def get_cuda_softmax(log: bool = False) -> SoftMaxOp:
    return SoftMaxOp(log=log)
