"""Softmax and log-softmax in plain PyTorch: the definition every backend must match.

Accumulates in float32 (float64 for float64 input) and rounds once to the input dtype,
so a low-precision result carries one rounding error, as a fused kernel's does.
This is also the CPU implementation and, on float64 inputs, the test oracle.
"""
from __future__ import annotations

import torch

from kernelforge.reference._accumulation import accumulation_dtype as _accumulation_dtype


def softmax(x: torch.Tensor, dim: int = -1, log: bool = False) -> torch.Tensor:
    """softmax(x)_i = exp(x_i - max x) / sum_j exp(x_j - max x); log=True gives its log."""
    xa = x.to(_accumulation_dtype(x.dtype))
    shifted = xa - xa.amax(dim=dim, keepdim=True)  # a new tensor: the in-place ops below are safe
    if log:
        return shifted.sub_(shifted.exp().sum(dim=dim, keepdim=True).log_()).to(x.dtype)
    e = shifted.exp_()
    return e.div_(e.sum(dim=dim, keepdim=True)).to(x.dtype)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return softmax(x, dim, log=True)


def softmax_backward(
    grad_output: torch.Tensor, output: torch.Tensor, dim: int = -1, log: bool = False
) -> torch.Tensor:
    """Gradient of (log-)softmax with respect to its input, from the forward output y.

    softmax:     dx = y * (dy - sum(dy * y))
    log_softmax: dx = dy - exp(y) * sum(dy)
    """
    acc = _accumulation_dtype(output.dtype)
    gy, y = grad_output.to(acc), output.to(acc)
    if log:
        gx = gy - y.exp() * gy.sum(dim=dim, keepdim=True)
    else:
        gx = y * (gy - (gy * y).sum(dim=dim, keepdim=True))
    return gx.to(output.dtype)


# Row launchers: the interface every backend of the softmax op implements.
# x2d is (rows, cols) with unit column stride; the result is a new dense (rows, cols) tensor.
def softmax_forward_rows(x2d: torch.Tensor, log: bool) -> torch.Tensor:
    return softmax(x2d, -1, log).contiguous()


def softmax_backward_rows(grad2d: torch.Tensor, out2d: torch.Tensor, log: bool) -> torch.Tensor:
    return softmax_backward(grad2d, out2d, -1, log).contiguous()
