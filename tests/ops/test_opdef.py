"""The one way kernelforge defines an op (kernelforge.ops._opdef.define_op): the eager call skips the
dispatcher, the registered op carries the same fake and gradient, and torch.compile traces into the
implementation where its backend is traceable."""
import pytest
import torch

import kernelforge as kf
from kernelforge import backends
from kernelforge.ops._opdef import DEFINITIONS, define_op
from kernelforge.triton import interpreter_enabled
from tests.op_paths import aot_graphs

calls = {"impl": 0, "fake": 0}


def _probe_impl(x, scale):
    calls["impl"] += 1
    return x * scale


def _probe_fake(x, scale):
    calls["fake"] += 1
    return torch.empty_like(x)


def _probe_save(ctx, inputs, output):
    ctx.scale = inputs[1]


PROBE = define_op("kernelforge::opdef_probe(Tensor x, float scale) -> Tensor", _probe_impl, _probe_fake,
                  setup_context=_probe_save, backward=lambda ctx, g: (PROBE(g, ctx.scale), None))
NO_GRADIENT = define_op("kernelforge::opdef_probe_no_gradient(Tensor x) -> Tensor", lambda x: x * 2,
                        lambda x: torch.empty_like(x))


def test_every_registered_op_is_defined_once():
    # Python-defined ops all come from define_op; the CUDA backends' launch ops (<op>_cuda_forward /
    # _backward, kernels registered from C++) are launchers, not op definitions
    names = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("kernelforge::")}
    ops = {n for n in names if "_cuda_" not in n}
    assert ops <= set(DEFINITIONS), sorted(ops - set(DEFINITIONS))
    assert "softmax" in ops and "opdef_probe" in ops


def test_eager_call_runs_the_implementation_without_the_dispatcher():
    x = torch.randn(5, requires_grad=True)
    calls.update(impl=0, fake=0)
    y = PROBE(x, 3.0)
    assert calls["impl"] == 1 and PROBE.is_eager_node(y.grad_fn)
    y.sum().backward()
    assert calls["impl"] == 2  # the backward is the op again, called directly
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))
    # the registered op: same numbers, its own autograd node, a gradient through the same formula
    xb = x.detach().requires_grad_()
    yb = torch.ops.kernelforge.opdef_probe(xb, 3.0)
    assert not PROBE.is_eager_node(yb.grad_fn)
    yb.sum().backward()
    torch.testing.assert_close(xb.grad, x.grad)


def test_double_backward_goes_through_the_op():
    x = torch.randn(4, requires_grad=True)
    (g,) = torch.autograd.grad(PROBE(x, 2.0).pow(2).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(gg, torch.full_like(x, 8.0))


def test_fake_tensors_take_the_registered_op():
    calls.update(impl=0, fake=0)
    with torch._subclasses.FakeTensorMode() as mode:
        out = PROBE(mode.from_tensor(torch.randn(3)), 1.0)
    assert calls == {"impl": 0, "fake": 1} and out.shape == (3,)


@pytest.mark.parametrize("registered", [False, True], ids=["eager", "registered"])
def test_an_op_without_gradient_raises_when_asked_for_one(registered):
    x = torch.randn(3, requires_grad=True)
    y = torch.ops.kernelforge.opdef_probe_no_gradient(x) if registered else NO_GRADIENT(x)
    with pytest.raises(RuntimeError, match="opdef_probe_no_gradient has no gradient formula"):
        y.sum().backward()


def test_eager_outputs_are_not_views():
    view_impl = define_op("kernelforge::opdef_probe_view(Tensor x) -> Tensor", lambda x: (x * 1).view(-1),
                          lambda x: x.new_empty(x.numel()))
    for x in (torch.randn(2, 3), torch.randn(2, 3, requires_grad=True)):
        y = view_impl(x)
        assert not y._is_view()
        y.add_(1)  # autograd allows in-place ops on it, as on torch's own outputs


def _two_results_and_a_helper_backward(ctx, grad_a, grad_b, grad_helper):
    seen.append((grad_a, grad_b, grad_helper))
    return grad_a * 2 + grad_b * 3


seen = []
HELPER = define_op("kernelforge::opdef_probe_helper(Tensor x) -> (Tensor, Tensor, Tensor)",
                   lambda x: (x * 2, x * 3, x * 4), lambda x: tuple(torch.empty_like(x) for _ in range(3)),
                   setup_context=lambda ctx, inputs, output: None, backward=_two_results_and_a_helper_backward,
                   helper_outputs=(2,))


@pytest.mark.parametrize("registered", [False, True], ids=["eager", "registered"])
def test_helper_outputs_get_no_zero_filled_gradient(registered):
    # a helper output's gradient comes as None (autograd would fill a tensor of zeros: a gated MLP's
    # activations, twice a layer); a result nobody differentiated still comes as zeros
    x = torch.randn(5, requires_grad=True)
    seen.clear()
    a, b, helper = torch.ops.kernelforge.opdef_probe_helper(x) if registered else HELPER(x)
    assert HELPER.is_eager_node(a.grad_fn) != registered
    (grad,) = torch.autograd.grad(a.sum(), x)
    torch.testing.assert_close(grad, torch.full_like(x, 2.0))
    grad_a, grad_b, grad_helper = seen[0]
    assert grad_helper is None and torch.equal(grad_b, torch.zeros(5)) and torch.equal(grad_a, torch.ones(5))


def test_compile_traces_into_a_traceable_backend():
    # the reference is torch ops: the compiled graph holds them, not the kernelforge op
    targets = aot_graphs(lambda x: kf.softmax(x * 2, -1).sum(), [torch.randn(4, 8, requires_grad=True)])[2]
    assert not any("kernelforge" in t for t in targets) and "aten.amax.default" in targets


@pytest.mark.skipif(not interpreter_enabled(), reason="needs Triton's interpreter (TRITON_INTERPRET=1)")
def test_compile_keeps_an_opaque_backend_whole_and_guards_on_the_forced_backend():
    # Triton's interpreter cannot enter a graph: the op stays one custom op there. Forcing it after a
    # graph was compiled on the reference recompiles (Dynamo guards on the setting).
    x = torch.randn(4, 8, requires_grad=True)
    fn = lambda t: kf.softmax(t * 2, -1).sum()  # noqa: E731
    assert not any("kernelforge" in t for t in aot_graphs(fn, [x])[2])
    with kf.use_backend("triton"):
        targets = aot_graphs(fn, [x])[2]
    assert "kernelforge.softmax.default" in targets and "kernelforge.softmax_backward.default" in targets


def test_tracing_ranks_traceable_kernels_first():
    impls = backends.implementations("softmax")
    order, why = backends._traceable_first(impls, ("cuda", "triton", "reference"), "eager reason")
    expected = ("cuda", "triton", "reference") if interpreter_enabled() else ("triton", "cuda", "reference")
    assert order == expected
    assert ("under torch.compile" in why) == (not interpreter_enabled())
