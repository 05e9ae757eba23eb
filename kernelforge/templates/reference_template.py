"""my_op in plain PyTorch: the definition every backend must match, the CPU implementation,
and (on float64 inputs) the test oracle.

    y = my_op(x)          elementwise; any shape, any float dtype
    dx = my_op'(x) * dy   the backward, written out (gradcheck compares it with the forward)

Low-precision inputs are computed in float32 and rounded once on the way out, as the GPU
kernels do; float64 stays float64.

TODO(new-op): write the math in _forward_math and _backward_math below; everything else
(dtypes, shapes, the op, autograd, tests) is already wired.
"""
from __future__ import annotations

import torch

from kernelforge.reference._accumulation import accumulation_dtype as _compute_dtype


def _forward_math(x: torch.Tensor) -> torch.Tensor:
    """y = f(x) on float32 / float64 x."""
    raise NotImplementedError("TODO(new-op): my_op's forward math in kernelforge/reference/my_op.py, "
                              "e.g. return x * torch.sigmoid(x)")


def _backward_math(x: torch.Tensor, grad_y: torch.Tensor) -> torch.Tensor:
    """dL/dx = f'(x) * dL/dy on float32 / float64 tensors."""
    raise NotImplementedError("TODO(new-op): my_op's backward math in kernelforge/reference/my_op.py, "
                              "e.g. s = torch.sigmoid(x); return grad_y * s * (1 + x * (1 - s))")


def my_op_forward(x: torch.Tensor) -> torch.Tensor:
    return _forward_math(x.to(_compute_dtype(x.dtype))).to(x.dtype)


def my_op_backward(grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    acc = _compute_dtype(x.dtype)
    return _backward_math(x.to(acc), grad_y.to(acc)).to(x.dtype)
