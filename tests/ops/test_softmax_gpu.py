"""GPU-only properties of every softmax backend: kernels run on the current stream, and on
tensors of any device index."""
import pytest
import torch

import kernelforge as kf
from tests.conftest import needs_cuda

pytestmark = [pytest.mark.gpu, needs_cuda]
BACKENDS = ["triton", "cuda", "reference"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1000, 100_000])
def test_runs_on_the_current_stream(backend, n):
    # On a side stream: a long sleep, then the write of x, then softmax. A kernel launched
    # on any other stream would read x before it is written and give a wrong answer.
    source = torch.randn(64, n, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), kf.use_backend(backend):
        torch.cuda._sleep(100_000_000)
        x = source * 2
        y = kf.softmax(x, -1)
        g = torch.randn_like(y)
        (dx,) = torch.autograd.grad(kf.softmax(x.requires_grad_(), -1), x, g)
    side.synchronize()
    expected = torch.softmax(source * 2, -1)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(dx, torch.ops.aten._softmax_backward_data(g, expected, -1, torch.float32))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_zero_device_index(backend):
    assert torch.cuda.current_device() == 0
    x = torch.randn(33, 5000, device="cuda:1", requires_grad=True)
    with kf.use_backend(backend):
        y = kf.log_softmax(x, -1)
        y.backward(torch.ones_like(y))
    assert y.device == x.device
    torch.testing.assert_close(y, torch.log_softmax(x.detach(), -1))
    torch.testing.assert_close(x.grad, 1 - y.detach().exp() * 5000)


def test_default_choice_is_explained():
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    text = kf.explain("softmax", x)
    chosen = text.split("runs on ")[1].split(" ")[0]
    assert chosen in BACKENDS
    assert "because" in text and all(b in text for b in BACKENDS)
    # fp64 on CUDA has only the reference
    assert "runs on reference" in kf.explain("softmax", x.double())
