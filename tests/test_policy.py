"""kernelforge.gpu_kernel and kernelforge.precision: the precision policy reaches gemm's
"auto", explicit precision still wins, 16-bit inputs keep tensor cores; streams=True on a GPU
orders the side stream's work before the caller reads the result."""
import pytest
import torch

import kernelforge as kf
from kernelforge.ops.gemm import resolve_compute
from tests.conftest import needs_cuda


def test_precision_scope_sets_auto_and_restores():
    a32, a16 = torch.randn(3, 4), torch.randn(3, 4).half()
    assert resolve_compute(a32, a32, "auto") == "fp32"
    with kf.precision("fp16"):
        assert resolve_compute(a32, a32, "auto") == "fp16"
        assert resolve_compute(a32, a32, "tf32") == "tf32"  # an explicit precision wins
        with kf.precision(None):
            assert resolve_compute(a32, a32, "auto") == "fp32"
        assert resolve_compute(a32, a32, "auto") == "fp16"
    assert resolve_compute(a32, a32, "auto") == "fp32"
    with kf.precision("tf32", float32_only=True):
        assert resolve_compute(a32, a32, "auto") == "tf32"
        assert resolve_compute(a16, a16, "auto") == "fp16"
    with pytest.raises(ValueError, match="mode must be None or one of"):
        with kf.precision("int8"):
            pass


def test_gpu_kernel_decorator_forms():
    a, b = torch.randn(6, 8), torch.randn(8, 5)

    @kf.gpu_kernel(precision="fp16")
    def half(a, b):
        return kf.gemm(a, b)

    @kf.gpu_kernel(use_tensor_cores=False)
    def ieee(a, b):
        return resolve_compute(a, b, "auto"), resolve_compute(a.half(), b.half(), "auto")

    @kf.gpu_kernel
    def plain(a, b):
        """docstring kept"""
        return kf.gemm(a, b)

    torch.testing.assert_close(half(a, b), (a.half().float() @ b.half().float()))
    assert ieee(a, b) == ("fp32", "fp16")
    torch.testing.assert_close(plain(a, b), a @ b)
    assert plain.__doc__ == "docstring kept" and plain.__name__ == "plain"
    assert resolve_compute(a, b, "auto") == "fp32"  # the policy ends with the call
    with pytest.raises(ValueError, match="precision must be None or one of"):
        kf.gpu_kernel(precision="fp64")


def test_streams_flag_is_harmless_without_a_gpu():
    @kf.gpu_kernel(streams=True)
    def f(x):
        return x * 2

    torch.testing.assert_close(f(torch.ones(3)), torch.full((3,), 2.0))


@pytest.mark.gpu
@needs_cuda
def test_side_stream_results_are_ordered():
    x = torch.randn(2048, 2048, device="cuda")

    @kf.gpu_kernel(streams=True)
    def work(x):
        assert torch.cuda.current_stream() != torch.cuda.default_stream()
        return kf.gemm(x, x, activation="relu")

    for _ in range(3):
        got = work(x)
        torch.testing.assert_close(got, torch.relu(x @ x), rtol=1e-3, atol=1e-2)
