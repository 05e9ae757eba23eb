"""my_op: every backend against the float64 oracle (forward and backward), odd and empty
shapes, strided inputs, gradcheck of the reference, opcheck of every registered op,
torch.compile, and bad input. Written by `kernelforge new-op my_op`: these tests fail until
the math is written (the TODO(new-op) sites), then they are the op's spec.

CPU: pytest tests/ops/test_my_op.py (Triton through TRITON_INTERPRET=1); GPU: -m gpu.
"""
import pytest
import torch

import kernelforge as kf
from kernelforge.ops.my_op import my_op
from kernelforge.reference.my_op import my_op_backward as reference_backward
from kernelforge.reference.my_op import my_op_forward as reference_forward
from tests.conftest import backend_cases, device_cases
from tests.numerics import assert_matches_oracle

SHAPES = [(1,), (7, 199), (3, 4097), (2, 3, 1000)]
GPU_SHAPES = SHAPES + [(4096, 8192)]


def dtypes_for(backend, device):
    if device == "cpu" and backend == "triton":
        return [torch.float32, torch.float16]  # the interpreter's bfloat16 is not faithful
    return [torch.float32, torch.float16, torch.bfloat16] + ([torch.float64] if backend == "reference" else [])


def shapes_for(device):
    return GPU_SHAPES if device == "cuda" else SHAPES


@pytest.mark.parametrize("backend,device", backend_cases())
def test_forward_matches_oracle(backend, device):
    for shape in shapes_for(device):
        for dtype in dtypes_for(backend, device):
            x = torch.randn(shape, dtype=dtype, device=device)
            with kf.use_backend(backend):
                y = my_op(x)
            # the same-dtype yardstick: the reference at x's dtype (float32 math, one rounding)
            assert_matches_oracle(y, reference_forward(x), reference_forward(x.double()),
                                  f"my_op {shape} {dtype} {backend}")


@pytest.mark.parametrize("backend,device", backend_cases())
def test_backward_matches_oracle(backend, device):
    for shape in shapes_for(device):
        for dtype in dtypes_for(backend, device):
            x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
            grad_y = torch.randn(shape, dtype=dtype, device=device)
            with kf.use_backend(backend):
                (dx,) = torch.autograd.grad(my_op(x), x, grad_y)
            assert_matches_oracle(dx, reference_backward(grad_y, x.detach()),
                                  reference_backward(grad_y.double(), x.detach().double()),
                                  f"my_op {shape} {dtype} {backend} dx")


def test_reference_backward_is_the_forward_derivative():
    # the written-out backward against finite differences of the forward, in float64
    x = torch.randn(3, 17, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(my_op, (x,))


@pytest.mark.parametrize("backend,device", backend_cases())
def test_strided_and_empty_inputs(backend, device):
    base = torch.randn(33, 18, device=device)
    x = base.t()[::2]  # non-contiguous
    with kf.use_backend(backend):
        torch.testing.assert_close(my_op(x), my_op(x.contiguous()))
        empty = torch.randn(0, 5, device=device, requires_grad=True)
        y = my_op(empty)
        assert y.shape == (0, 5)
        (dx,) = torch.autograd.grad(y.sum(), empty)
        assert dx.shape == (0, 5)


@pytest.mark.parametrize("device", device_cases())
def test_opcheck(device):
    x = torch.randn(5, 9, device=device)
    grad_y = torch.randn_like(x)
    torch.library.opcheck(torch.ops.kernelforge.my_op.default, (x,))
    torch.library.opcheck(torch.ops.kernelforge.my_op.default, (x.clone().requires_grad_(),))
    torch.library.opcheck(torch.ops.kernelforge.my_op_backward.default, (grad_y, x))
    if device == "cuda":
        from kernelforge.cuda.my_op import my_op_forward

        my_op_forward(x)  # loads the extension: its C++ block registers the CUDA kernels
        for name in ("my_op_cuda_forward", "my_op_cuda_backward"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kernelforge::{name}", "CUDA"), name
        torch.library.opcheck(torch.ops.kernelforge.my_op_cuda_forward.default, (x,))
        torch.library.opcheck(torch.ops.kernelforge.my_op_cuda_backward.default, (grad_y, x))


@pytest.mark.parametrize("device", device_cases())
def test_compiled_matches_eager(device):
    x = torch.randn(4, 33, device=device, requires_grad=True)

    def loss(x):
        return (my_op(x) * x).sum()

    expected = torch.autograd.grad(loss(x), x)
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(x), x)
    torch.testing.assert_close(got, expected)


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="my_op: x must have dtype in"):
        my_op(torch.arange(4))
    x = torch.randn(3)
    with pytest.raises(ValueError, match=r"grad_y must match x's shape \(3,\)"):
        torch.ops.kernelforge.my_op_backward(torch.randn(4), x)
