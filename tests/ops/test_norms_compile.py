"""The norms under torch.compile (kernelforge.ops._opdef): traced into the reference's torch ops
on the CPU and into the Triton kernels on a GPU, which Inductor then launches from its own code,
forward and backward, with the eager call's numbers; and the Triton launchers' configs under
dynamic shapes. (tests/ops/test_norms.py holds the accuracy tests and the Inductor end-to-end one.)"""
import pytest
import torch

import kernelforge as kf
from tests.conftest import needs_cuda
from tests.op_paths import aot_graphs, assert_inductor_launches

NAMES = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")


def test_triton_launch_config_reads_only_the_row_bucket():
    # Under torch.compile's dynamic shapes the row count is symbolic: the launchers' config must be
    # the one a plain int gives, found without hashing or bit_length on the symbolic size.
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from kernelforge.triton import norms as triton_norms

    env = ShapeEnv()

    def symbolic(value):
        source = ConstantSource(f"rows_{value}")
        symbol = env.create_symbol(value, source, dynamic_dim=DimDynamic.DYNAMIC)
        return env.create_symintnode(symbol, hint=value, source=source)

    for n_cols in (7, 1024, 5000, 20000, 40000):
        for n_rows in (1, 2, 3, 5, 64, 100, 4097):
            for backward, rms in ((False, True), (True, True), (True, False)):
                sizes = triton_norms._config_sizes(symbolic(n_rows), n_cols)
                assert all(type(s) is int for s in sizes)
                assert (triton_norms.default_config(*sizes, backward, rms)
                        == triton_norms.default_config(n_rows, n_cols, backward, rms))


@pytest.mark.parametrize("name", NAMES)
def test_compile_traces_into_the_reference(name):
    # On the CPU the norms run on the reference: torch.compile traces into its torch ops, forward
    # and backward, and gives the eager call's values and gradients. eps=None for the RMS forms
    # (torch.nn.RMSNorm's default, looked up by dtype under Dynamo).
    residual = name.startswith("add_")
    leaves = [torch.randn(4, 3, 8)] + ([torch.randn(4, 3, 8)] if residual else []) + [torch.randn(8), torch.randn(8)]

    def fn(*args):
        *inputs, w, b = args
        eps = None if "rms" in name else 1e-5
        out = getattr(kf, name)(*inputs, w, bias=b, eps=eps)
        return out if isinstance(out, tuple) else (out,)

    eager_leaves = [t.clone().requires_grad_() for t in leaves]
    expected = fn(*eager_leaves)
    grad_outputs = tuple(torch.randn_like(o) for o in expected)
    expected_grads = torch.autograd.grad(expected, eager_leaves, grad_outputs)
    got, grads, targets = aot_graphs(fn, [t.clone().requires_grad_() for t in leaves], grad_outputs, dynamic=False)
    assert not any("kernelforge" in t for t in targets), targets
    assert "aten.rsqrt.default" in targets
    for a, e in zip(got + grads, expected + expected_grads):
        torch.testing.assert_close(a, e)


def _inductor_forward_and_backward(fn, inputs, grad_outputs, **compile_kwargs):
    """fn compiled by Inductor (fullgraph=True), its outputs, the gradients of inputs, and the code
    Inductor generated for the forward and the backward, joined."""
    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(fn, fullgraph=True, **compile_kwargs)

    def step():
        out = compiled(*inputs)
        return out, torch.autograd.grad(out, inputs, grad_outputs)

    (out, grads), codes = run_and_get_code(step)
    return out, grads, "\n".join(codes)


def _bf16_norm_case(name, rows=64, n=1024):
    """fn(*inputs) -> outputs tuple of `name` on bf16 CUDA rows, inputs with gradients, and the
    gradients of its outputs."""
    inputs = [torch.randn(rows, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for _ in range(1 + name.startswith("add_"))]
    inputs.append(torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True))

    def fn(*args):
        out = getattr(kf, name)(*args, 1e-6)
        return out if isinstance(out, tuple) else (out,)

    grad_outputs = tuple(torch.randn(rows, n, device="cuda", dtype=torch.bfloat16) for _ in inputs[:-1])
    return fn, inputs, grad_outputs


def _eager_on_triton(fn, inputs, grad_outputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    with kf.use_backend("triton"):
        out = fn(*leaves)
        return out, torch.autograd.grad(out, leaves, grad_outputs)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm"])
def test_inductor_launches_the_triton_kernels(name):
    # Under torch.compile the op is traced into its Triton kernels (whatever the eager rules pick:
    # traceable kernels first), which Inductor launches from its own code, forward and backward
    # (the fused backward and the weight gradient's partial sums); the numbers are the eager
    # call's on the same kernels.
    fn, inputs, grad_outputs = _bf16_norm_case(name)
    no_grad = [t.detach() for t in inputs]
    out = assert_inductor_launches(fn, no_grad, ["_norm_fwd_fused_kernel"])
    expected, expected_grads = _eager_on_triton(fn, inputs, grad_outputs)
    for a, e in zip(out, expected):
        torch.testing.assert_close(a, e)
    out, grads, code = _inductor_forward_and_backward(fn, inputs, grad_outputs)
    for kernel in ("_norm_fwd_fused_kernel", "_norm_bwd_fused_kernel", "sum_partials_kernel"):
        assert kernel in code, f"{kernel} is not launched by Inductor's code"
    assert "torch.ops.kernelforge" not in code, "a kernelforge op stayed opaque in the compiled graph"
    for a, e in zip(out + grads, expected + expected_grads):
        torch.testing.assert_close(a, e)


@pytest.mark.gpu
@needs_cuda
def test_inductor_launches_the_triton_kernels_with_dynamic_rows():
    # dynamic=True: the row count is symbolic (the launchers' configs read only its power-of-two
    # bucket), the graph is still traced into the kernels, and one compiled function runs other
    # row counts right.
    from torch._inductor.utils import run_and_get_code

    cases = [_bf16_norm_case("add_rms_norm", rows=rows) for rows in (64, 100)]
    compiled = torch.compile(cases[0][0], fullgraph=True, dynamic=True)

    def step():
        results = []
        for _, inputs, grad_outputs in cases:
            out = compiled(*inputs)
            results.append((out, torch.autograd.grad(out, inputs, grad_outputs)))
        return results

    results, codes = run_and_get_code(step)
    code = "\n".join(codes)
    assert "_norm_fwd_fused_kernel" in code and "_norm_bwd_fused_kernel" in code
    assert "torch.ops.kernelforge" not in code
    for (fn, inputs, grad_outputs), (out, grads) in zip(cases, results):
        expected, expected_grads = _eager_on_triton(fn, inputs, grad_outputs)
        for a, e in zip(out + grads, expected + expected_grads):
            torch.testing.assert_close(a, e)
