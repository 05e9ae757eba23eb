"""An op's output may be modified in place, as torch's own ops' outputs may (y = norm(x); y += r),
with the gradient of the modified result right; where the backward needs the output itself
(softmax, attention, add_rms_norm's sum x + residual), autograd's version check refuses it, as
for torch's softmax."""
import contextlib

import pytest
import torch

import kernelforge as kf
from tests.conftest import device_cases

SHAPES = [(5, 24), (2, 3, 24)]


def _ops(dtype, device):
    w, b = torch.randn(24, dtype=dtype, device=device), torch.randn(24, 24, dtype=dtype, device=device)
    # a permutation of the nodes: one message into each node (and out of each row), so the Triton
    # kernel's float32 atomics add to zero only and give the same bits in each of the test's calls
    perm = torch.tensor([2, 0, 4, 1, 3], device=device)
    src, dst = {5: perm, 2: perm[perm < 2]}, {n: torch.arange(n, device=device) for n in (5, 2)}
    return {
        "layer_norm": lambda x: kf.layer_norm(x, w, w),
        "rms_norm": lambda x: kf.rms_norm(x, w, 1e-6),
        "add_rms_norm": lambda x: kf.add_rms_norm(x, x * 0.5, w)[0],
        "gelu": lambda x: kf.gelu(x, "tanh"),
        "silu": kf.silu,
        "swiglu": lambda x: kf.swiglu(x, x.exp()),
        "swiglu_packed": lambda x: kf.swiglu(torch.cat([x, x.cos()], -1)),
        "gemm": lambda x: kf.gemm(x, b, activation="silu"),
        "gather_scatter": lambda x: kf.gather_scatter(x, src[x.shape[0]], dst[x.shape[0]], x.shape[0], "mean"),
    }


def _registered_op_path(device):
    """A TorchFunctionMode (here `with torch.device(...)`) sends kernelforge's calls through the
    registered ops instead of the eager autograd.Functions: both paths must behave alike."""
    return torch.device(device)


@pytest.mark.parametrize("path", ["eager", "registered-op"])
@pytest.mark.parametrize("device", device_cases())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(_ops(torch.float64, "cpu")))
def test_output_modified_in_place_differentiates(name, shape, device, path):
    dtype = torch.float64 if device == "cpu" else torch.float32
    op = _ops(dtype, device)[name]
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    with _registered_op_path(device) if path == "registered-op" else contextlib.nullcontext():
        y_in_place = op(x).mul_(3.0).add_(1.0)
    y = op(x).mul(3.0).add(1.0)
    torch.testing.assert_close(y_in_place, y, rtol=0, atol=0)
    g = torch.randn_like(y)
    (a,), (b,) = torch.autograd.grad(y_in_place, [x], g), torch.autograd.grad(y, [x], g)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("path", ["eager", "registered-op"])
@pytest.mark.parametrize("device", device_cases())
def test_in_place_on_an_output_the_backward_needs_is_refused(device, path):
    x = torch.randn(2, 3, 5, 8, device=device, requires_grad=True)
    with _registered_op_path(device) if path == "registered-op" else contextlib.nullcontext():
        outputs = (kf.softmax(x, dim=-1), kf.flash_attention(x, x, x), kf.add_rms_norm(x, x * 0.5, None)[1])
    for y in outputs:
        y.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
