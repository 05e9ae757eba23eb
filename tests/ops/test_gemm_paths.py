"""The ways kernelforge.gemm runs: the eager call (the implementation without the dispatcher)
against the registered op; torch.compile tracing into the reference and keeping the Triton backend
one opaque op (on the GPU: Inductor's code calls torch.ops.kernelforge.gemm and gives eager's
numbers); the Triton launcher working a call signature's launch out once."""
import pytest
import torch

import kernelforge as kf
from kernelforge import backends
from kernelforge.ops import gemm as gemm_ops
from kernelforge.triton import interpreter_enabled
from tests.conftest import backend_cases, needs_cuda
from tests.op_paths import aot_graphs, assert_eager_path_equals_registered_op, compiled_code

# these tests spy on or swap the launchers' Python, which a replayed eager plan does not run
pytestmark = pytest.mark.usefixtures("no_eager_plans")


def test_eager_fast_path_equals_registered_op():
    # In plain eager mode kf.gemm skips the dispatcher (the op's generated autograd.Function when a
    # gradient is needed); torch.ops.kernelforge.gemm is the registered op. Same values, layout and
    # gradients, the pre-activation saved either way.
    w, bias = torch.randn(9, 12), torch.randn(9)
    x = torch.randn(3, 5, 12)
    public = lambda t: kf.gemm(t, w.t(), bias=bias, activation="gelu")  # noqa: E731
    registered = lambda t: torch.ops.kernelforge.gemm(t, w.t(), bias, None, "gelu", "fp32", torch.float32,  # noqa: E731
                                                      t.requires_grad)[0]
    assert gemm_ops.gemm_op._plain_eager((x, w, bias, None, "gelu", "fp32", torch.float32, False, None, None, "row",
                                          False))
    assert_eager_path_equals_registered_op(public, gemm_ops.gemm_op, registered, x)


def test_compile_traces_the_reference_and_keeps_triton_opaque():
    # The reference is torch ops: a CPU graph holds its matmuls, the backward's included, and no
    # kernelforge op. The Triton backend (autotuned, heuristics, host TMA descriptors, Gluon) is
    # registered opaque: a graph on it keeps kernelforge::gemm whole.
    assert not backends.implementations("gemm")["triton"].traceable
    assert backends.implementations("gemm")["reference"].traceable
    a = torch.randn(2, 7, 12, requires_grad=True)
    b = torch.randn(12, 5, requires_grad=True)
    bias = torch.randn(5, requires_grad=True)

    def f(a, b, bias):
        return kf.gemm(a, b, bias=bias, activation="silu").square().sum()

    out, _, targets = aot_graphs(f, [a, b, bias])
    assert not any("kernelforge" in t for t in targets), sorted(targets)
    assert "aten.mm.default" in targets or "aten.bmm.default" in targets, sorted(targets)
    torch.testing.assert_close(out, f(a, b, bias))
    if interpreter_enabled():  # Triton on CPU tensors
        with kf.use_backend("triton"):
            targets = aot_graphs(f, [a, b, bias])[2]
        assert "kernelforge.gemm.default" in targets, sorted(targets)


@pytest.mark.gpu
@needs_cuda
def test_compiled_gemm_stays_the_opaque_op_and_matches_eager():
    # On the GPU the GEMM runs on the Triton backend, which Inductor cannot take apart: its code
    # calls torch.ops.kernelforge.gemm (the eager launcher), and the numbers are eager's.
    a = torch.randn(3, 64, 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(80, 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(80, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def f(a, w, bias):
        return kf.gemm(a, w.t(), bias=bias, activation="gelu_tanh")

    torch._dynamo.reset()
    with torch.no_grad():
        out, code = compiled_code(f, a, w, bias)
    assert "torch.ops.kernelforge.gemm" in code
    torch.testing.assert_close(out, f(a, w, bias))
    got, want = torch.compile(f, fullgraph=True)(a, w, bias), f(a, w, bias)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(want)
    for x, y in zip(torch.autograd.grad(got, (a, w, bias), g), torch.autograd.grad(want, (a, w, bias), g)):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("backend,device", backend_cases(("triton",)))
@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointers"])
def test_launcher_plans_a_signature_once(backend, device, use_tma, monkeypatch):
    # The Triton launcher works a call signature's launch out on its first call (_route; on the GPU
    # the autotuner runs it); later calls at that signature launch the chosen config, all through
    # kernelforge.triton._launch.launch, and the same numbers come out. Another layout of b is
    # another signature.
    from kernelforge.triton import gemm as triton_gemm

    routes, launches = [], []
    route, launch = triton_gemm._route, triton_gemm.launch
    monkeypatch.setattr(triton_gemm, "_PLANS", {})
    monkeypatch.setattr(triton_gemm, "_CHOSEN", {})  # on the GPU the first call is the autotuner's
    monkeypatch.setattr(triton_gemm, "USE_TMA", use_tma)
    monkeypatch.setattr(triton_gemm, "_route", lambda *args: routes.append(args[-2]) or route(*args))
    monkeypatch.setattr(triton_gemm, "launch", lambda kernel, *args, **kw: launches.append(kernel) or
                        launch(kernel, *args, **kw))
    a = torch.randn(70, 32, device=device, dtype=torch.float16)
    weight = torch.randn(48, 32, device=device, dtype=torch.float16) / 6
    bias = torch.randn(48, device=device, dtype=torch.float16)
    with kf.use_backend(backend):
        outs = [kf.gemm(a, weight.t(), bias=bias, activation="relu") for _ in range(3)]
        assert len(routes) == 1 and len(triton_gemm._PLANS) == 1
        assert len(launches) == 3  # on the GPU the first is the autotuner's, through launch() too
        kf.gemm(a, weight.t().contiguous(), bias=bias, activation="relu")
    assert len(routes) == 2 and len(triton_gemm._PLANS) == 2
    kernel = triton_gemm.gemm_tma_kernel if use_tma else triton_gemm.gemm_kernel
    assert kernel in launches and all(k is kernel or type(k).__name__ == "Autotuner" for k in launches), launches
    assert torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0], torch.relu(a.float() @ weight.float().t() + bias.float()).half(),
                               rtol=2e-3, atol=2e-3)
