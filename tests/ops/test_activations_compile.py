"""The activation ops under torch.compile: traced into the reference on the CPU (static and dynamic
shapes), kept whole where the backend cannot be traced, and on a GPU launched by Inductor's own code
(their Triton kernels), forward and backward, with eager's numbers."""
import pytest
import torch

import kernelforge as kf
from kernelforge.ops import activations as ops
from kernelforge.ops import gated_activations as gated
from kernelforge.triton import interpreter_enabled
from tests.conftest import HAS_CUDA, needs_cuda
from tests.numerics import assert_compiled_matches_eager, same_layout
from tests.op_paths import aot_graphs, assert_inductor_launches

# every activation op the public functions call (tests/ops/test_activations.py opchecks each, and
# gated_activation_backward_and_product, gated_mlp's, too)
OPS = {"activation", "activation_backward", "bias_activation_backward", "gated_activation", "gated_activation_backward",
       "gated_activation_packed", "gated_activation_packed_backward"}


def leaf_copies(*tensors):
    return [same_layout(t).requires_grad_() for t in tensors]


def _compile_device_cases():
    return [pytest.param("cpu", id="cpu"),
            pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])]


@pytest.mark.slow
@pytest.mark.parametrize("device", _compile_device_cases())
def test_torch_compile_fullgraph(device):
    def block(x, w, b):
        h = x @ w
        a = ops.bias_gelu(h, b, "tanh") + ops.silu(h)
        return (gated.swiglu(a) + gated.geglu(a[:, :8], a[:, 8:])).sum()

    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    # On the CPU the compiled graph holds the reference's math, which Inductor fuses and rounds its
    # own way: in float32 the gradients' sums (cancelling terms of order 100) then differ from
    # eager's by ~1e-5, past assert_close's float32 tolerance; float64 compares them exactly enough.
    # On a GPU the graph launches the Triton kernels where eager takes the CUDA extension at this
    # size, and Inductor sums the gradients its way: 1.8e-5 of terms of order 10 measured (H200).
    dtype = torch.float64 if device == "cpu" else torch.float32
    x = torch.randn(8, 16, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(16, 16, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(16, device=device, dtype=dtype, requires_grad=True)
    assert_compiled_matches_eager(block, compiled, (x, w, b), relative_floor=0.0 if device == "cpu" else 1e-5)


def _every_op(x, bias, frozen_bias, gate, up, packed):
    """Each activation op forward and backward: silu (activation_backward), bias_gelu with a bias
    gradient (bias_activation_backward), bias_silu with a frozen bias (activation_backward with a
    bias), relu, swiglu (gated_activation_backward), packed geglu (gated_activation_packed_backward)."""
    return (ops.silu(x).sum() + (ops.bias_gelu(x, bias, "tanh") * 2).sum() + ops.bias_silu(x, frozen_bias).sum()
            + ops.relu(x - 0.5).sum() + gated.swiglu(gate, up).sum() + gated.geglu(packed).pow(2).sum())


def _every_op_inputs():
    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    return [leaf(6, 8), leaf(8), torch.randn(8), leaf(5, 7), leaf(5, 7), leaf(2, 3, 10)]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_traces_every_op_into_the_reference(dynamic):
    # On the CPU the reference runs every op; it is torch ops, so torch.compile traces the ops'
    # implementations into the graphs (forward and backward) instead of keeping kernelforge ops,
    # and gets eager's numbers.
    inputs = _every_op_inputs()
    expected = _every_op(*inputs)
    expected_grads = torch.autograd.grad(expected, [t for t in inputs if t.requires_grad])
    out, grads, targets = aot_graphs(_every_op, inputs, dynamic=dynamic)
    assert not [t for t in targets if "kernelforge" in t]
    assert "aten.sigmoid.default" in targets and "aten.erf.default" in targets  # the reference's silu, geglu
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


@pytest.mark.skipif(not interpreter_enabled(), reason="needs Triton's interpreter (TRITON_INTERPRET=1)")
def test_compile_keeps_an_opaque_backend_whole():
    # Triton's interpreter cannot enter a graph: each op's `choose` says so and the op stays one
    # custom op (its fake, then its implementation at run time), forward and backward.
    inputs = _every_op_inputs()
    with kf.use_backend("triton"):
        expected = _every_op(*inputs)
        expected_grads = torch.autograd.grad(expected, [t for t in inputs if t.requires_grad])
        out, grads, targets = aot_graphs(_every_op, inputs)
    ours = {t.split(".")[1] for t in targets if t.startswith("kernelforge.")}
    assert ours == OPS
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def test_triton_tile_config_takes_symbolic_sizes():
    # Under dynamic shapes the launchers see SymInts: the tile is the concrete sizes' tile, and a size
    # past the widest tile is not specialized (a guard, no replacement by its value).
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from kernelforge.triton import activations as triton_act

    for rows, cols in ((1, 70000), (1, 300), (300, 4096), (3, 5), (5000, 96)):
        env = ShapeEnv()
        sym = [env.create_symintnode(env.create_symbol(v, ConstantSource(f"s{i}"), dynamic_dim=DimDynamic.DYNAMIC), hint=v)
               for i, v in enumerate((rows, cols))]
        if rows == 1:
            sym[0] = 1
        assert triton_act.default_config(*sym) == triton_act.default_config(rows, cols)
        if cols >= 2048:
            assert not env.replacements, env.replacements


GPU_COMPILE_CASES = {  # public call, input shapes, the Triton kernels forward, backward
    "silu": (ops.silu, [(64, 1000)], ["_act_fwd_kernel"], ["_act_bwd_kernel"]),
    "bias_gelu": (ops.bias_gelu, [(64, 1000), (1000,)], ["_act_fwd_kernel"], ["_act_bwd_kernel"]),
    "swiglu packed": (gated.swiglu, [(64, 2000)], ["_glu_fwd_kernel"], ["_glu_bwd_kernel"]),
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_COMPILE_CASES)
def test_inductor_launches_the_triton_kernels(case):
    # Compiled, the ops are traced into: Inductor's code launches the Triton kernels itself (no
    # kernelforge op in it), forward and backward (the bias gradient included), with eager's numbers.
    # Eager runs on Triton too (at this size bias_gelu's eager choice is the CUDA extension).
    from torch._inductor.utils import run_and_get_code

    fn, shapes, forward_kernels, backward_kernels = GPU_COMPILE_CASES[case]
    inputs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for shape in shapes]
    with kf.use_backend("triton"):
        expected = fn(*inputs)
    assert torch.equal(assert_inductor_launches(fn, inputs, forward_kernels), expected)

    eager_leaves, compiled_leaves = leaf_copies(*inputs), leaf_copies(*inputs)
    with kf.use_backend("triton"):
        expected = fn(*eager_leaves)
        g = torch.randn_like(expected)
        expected.backward(g)

    def forward_and_backward(*leaves):
        out = torch.compile(fn, fullgraph=True)(*leaves)
        out.backward(g)
        return out

    out, codes = run_and_get_code(forward_and_backward, *compiled_leaves)
    code = "\n".join(codes)
    for name in forward_kernels + backward_kernels:
        assert name in code, f"{name} is not launched by Inductor's code"
    assert "torch.ops.kernelforge" not in code, "a kernelforge op stayed opaque in the compiled graphs"
    assert torch.equal(out, expected)
    assert torch.equal(compiled_leaves[0].grad, eager_leaves[0].grad)
    for got, want in zip(compiled_leaves[1:], eager_leaves[1:]):  # the bias: a reduction, in Inductor's order
        assert got.grad.dtype == want.grad.dtype
        torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [48, 80])
def test_inductor_launches_the_triton_kernels_under_dynamic_shapes(rows):
    # Symbolic sizes reach the launchers (tile configuration, grids): still Inductor's launches.
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    with kf.use_backend("triton"):
        expected = ops.bias_gelu(x, bias)
    got = assert_inductor_launches(ops.bias_gelu, [x, bias], ["_act_fwd_kernel"], dynamic=True)
    assert torch.equal(got, expected)
