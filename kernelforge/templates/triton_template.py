"""Triton kernels of my_op (forward and backward) and their launchers (the backend interface
of kernelforge/ops/my_op.py: my_op_forward(x), my_op_backward(grad_y, x)).

Elementwise over the flattened tensor, BLOCK values a program, float32 math, one rounding to
the input dtype on the store. Per element: forward reads x and writes y (2 x itemsize bytes),
backward reads x and grad_y and writes dx (3 x itemsize): bandwidth-bound, so the math is free
unless it is long.

TODO(new-op): write the math in _forward_math and _backward_math (the same formulas as
kernelforge/reference/my_op.py). Until then they return NaN, so the tests fail.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernelforge.triton._launch import cdiv, launch, on_device

BLOCK = 1024


@triton.jit
def _forward_math(x):
    # TODO(new-op): y = f(x) on a float32 block, e.g. return x * tl.sigmoid(x)
    return x * float("nan")


@triton.jit
def _backward_math(x, grad_y):
    # TODO(new-op): dx = f'(x) * grad_y on float32 blocks
    return x * grad_y * float("nan")


@triton.jit
def my_op_forward_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, _forward_math(x).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def my_op_backward_kernel(X, DY, DX, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + offs, _backward_math(x, dy).to(DX.dtype.element_ty), mask=mask)


def why_not(x: torch.Tensor):
    """None when these kernels take x, else why not (the dtype and device checks are the op's)."""
    return None


def my_op_forward(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        with on_device(x):
            launch(my_op_forward_kernel, (cdiv(x.numel(), BLOCK),), x, y, x.numel(), BLOCK=BLOCK)
    return y


def my_op_backward(grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    x, grad_y = x.contiguous(), grad_y.contiguous()
    dx = torch.empty_like(x)
    if x.numel():
        with on_device(x):
            launch(my_op_backward_kernel, (cdiv(x.numel(), BLOCK),), x, grad_y, dx, x.numel(), BLOCK=BLOCK)
    return dx
