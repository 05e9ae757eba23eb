"""Out of memory inside a kernelforge call (GPU suite): torch's OutOfMemoryError reaches the
caller, and the process stays usable: the same call, once memory is there again, gives the right
result on the same backend.

The limit is this process's own (torch.cuda.set_per_process_memory_fraction just above what it
holds), not the whole card filled: the GPU suite runs several workers on one card, and a filled
card would fail their tests instead of this one. Every buffer a kernelforge call allocates (outputs,
workspaces, the chunks of a fused loss, cuBLAS's workspace) comes from torch's caching allocator,
which raises the same error under the fraction as on an exhausted card."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

import kernelforge as kf
from tests.conftest import needs_cuda

pytestmark = [pytest.mark.gpu, needs_cuda]
MiB = 2 ** 20


@contextlib.contextmanager
def memory_limited_to(headroom_bytes: int):
    """Allow this process only headroom_bytes beyond the memory its tensors hold now (the
    allocator's cached free blocks handed back first: a call could take one of those instead)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + headroom_bytes) / total)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def bf16(*shape, scale=1.0):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).mul_(scale)


def cases():
    """(name, backends, make inputs, kernelforge's call, torch's, (rtol, atol)): each call needs
    more than the test's 64 MiB of headroom beyond its inputs (its output, or for the losses a
    gradient or a chunk's logits)."""
    rows, cols = 8192, 32768  # 512 MiB of bf16
    yield ("softmax", ("triton", "cuda"), lambda: [bf16(rows, cols)],
           lambda x: kf.softmax(x), lambda x: torch.softmax(x.float(), -1), (2e-2, 1e-5))
    yield ("rms_norm", ("triton", "cuda"), lambda: [bf16(rows, cols), bf16(cols)],
           lambda x, w: kf.rms_norm(x, w), lambda x, w: F.rms_norm(x.float(), (cols,), w.float()), (2e-2, 2e-2))
    yield ("gemm", ("triton", "cuda"), lambda: [bf16(rows, 1024, scale=0.03), bf16(1024, cols, scale=0.03)],
           lambda a, b: kf.gemm(a, b, activation="gelu"), lambda a, b: F.gelu(a.float() @ b.float()), (2e-2, 1e-2))

    yield ("flash_attention", ("triton", "cuda"), lambda: [bf16(4, 32, 4096, 128) for _ in range(3)],
           lambda q, k, v: kf.flash_attention(q, k, v, causal=True),
           lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), (2e-2, 2e-2))

    def loss_grad(x, loss):
        x = x.detach().requires_grad_()
        return torch.autograd.grad(loss(x), x)[0]

    def target():
        return torch.randint(0, cols, (rows,), device="cuda")

    yield ("cross_entropy backward", ("triton",), lambda: [bf16(rows, cols), target()],
           lambda x, t: loss_grad(x, lambda x: kf.cross_entropy(x, t, reduction="sum")),
           lambda x, t: loss_grad(x, lambda x: F.cross_entropy(x.float(), t, reduction="sum")), (2e-2, 1e-6))
    yield ("fused_linear_cross_entropy", ("triton",), lambda: [bf16(rows, 2048), bf16(cols, 2048, scale=0.02), target()],
           lambda x, w, t: kf.fused_linear_cross_entropy(x, w, t),
           lambda x, w, t: F.cross_entropy((x @ w.t()).float(), t), (1e-2, 1e-2))


CASES = {name: rest for name, *rest in cases()}


@pytest.mark.parametrize("name,backend", [pytest.param(name, backend, id=f"{name}-{backend}")
                                          for name, (backends, *_) in CASES.items() for backend in backends])
def test_out_of_memory_raises_and_leaves_the_process_usable(name, backend):
    _, make, mine, theirs, (rtol, atol) = CASES[name]
    inputs = make()
    with kf.use_backend(backend):
        with memory_limited_to(64 * MiB), pytest.raises(torch.OutOfMemoryError):
            mine(*inputs)
        torch.cuda.empty_cache()
        got = mine(*inputs)  # the same call with the memory there: it runs, and right
    want = theirs(*inputs)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol, msg=f"{name} on {backend}")
