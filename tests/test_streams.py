"""Every op runs on the caller's current stream, forward and backward, the first call and a
replayed one (kernelforge._eager_plans) alike: on a side stream the inputs are written after a
long sleep kernel, so an op that launched a kernel on another stream would read them before they
exist (zeros) and give other values than the same op on the default stream."""
import pytest
import torch

import kernelforge as kf
from tests.conftest import needs_cuda
from tests.test_special_values import cases as special_value_cases

SLEEP_CYCLES = 50_000_000  # ~30 ms at the SM clock: far longer than any of these small calls


def op_cases():
    """(name, backends with a kernel for it, inputs, differentiable inputs, kernelforge's call): the
    special-value suite's table (every public op at 4 x 37, no special values planted) and the ops
    it leaves out."""
    for name, backends, inputs, differentiable, mine, _ in special_value_cases([]):
        yield name, backends, inputs, differentiable, mine
    q, k, v = (torch.randn(1, 4, 40, 32) for _ in range(3))
    yield ("flash_attention", ("reference", "triton", "cuda"), [q, k, v], (0, 1, 2),
           lambda q, k, v: kf.flash_attention(q, k, v, causal=True))
    x, residual, w, b = torch.randn(4, 37), torch.randn(4, 37), torch.randn(37), torch.randn(37)
    yield ("add_layer_norm", ("reference", "triton", "cuda"), [x, residual, w, b], (0, 1, 2, 3),
           lambda x, r, w, b: kf.add_layer_norm(x, r, w, b)[0])
    gate_w, up_w, down_w = torch.randn(48, 37) * 0.2, torch.randn(48, 37) * 0.2, torch.randn(37, 48) * 0.2
    yield ("gated_mlp", ("reference", "triton"), [x, gate_w, up_w, down_w], (0, 1, 2, 3), kf.gated_mlp)
    yield ("fused_linear_cross_entropy mean", ("reference", "triton"),
           [x, torch.randn(11, 37), torch.tensor([1, 3, 10, 0])], (0, 1),
           lambda x, w, t: kf.fused_linear_cross_entropy(x, w, t))


def run(mine, inputs, differentiable, grad=None):
    """The op and the gradients of its inputs for `grad` (a fresh random one if None), on the
    current stream."""
    leaves = [t.requires_grad_(i in differentiable) if t.is_floating_point() else t for i, t in enumerate(inputs)]
    out = mine(*leaves)
    grad = torch.randn_like(out) if grad is None else grad
    return out.detach(), torch.autograd.grad(out, [leaves[i] for i in differentiable], grad), grad


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_every_op_runs_on_the_callers_stream(backend):
    dtype = torch.float16 if backend == "cuda" else torch.float32  # the CUDA GEMM takes half types
    checked = []
    for name, backends, inputs, differentiable, mine in op_cases():
        if backend not in backends:
            continue
        inputs = [t.to("cuda", dtype) if t.is_floating_point() else t.cuda() for t in inputs]
        with kf.use_backend(backend):
            # on the default stream: the first call (it may compile, autotune), the second (recorded),
            # then replays; the side stream's call below is a replay too
            grad = None
            for _ in range(4):
                want, want_grads, grad = run(mine, [t.clone() for t in inputs], differentiable, grad)
            side = torch.cuda.Stream()
            blank = [torch.zeros_like(t) for t in inputs]  # made on the default stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP_CYCLES)
                for b, t in zip(blank, inputs):
                    b.copy_(t)
                got, got_grads, _ = run(mine, blank, differentiable, grad)
            torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        what = f"{name} on {backend}"
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3, msg=lambda m: f"{what}: {m}")
        for i, g, w in zip(differentiable, got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3, msg=lambda m: f"{what}, gradient {i}: {m}")
        checked.append(name)
    assert len(checked) >= (10 if backend == "cuda" else 20), checked
