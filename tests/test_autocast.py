"""kernelforge under torch.autocast: the matrix-product ops (kf.gemm, and kf.nn.Linear through it)
run in autocast's dtype as torch's addmm does there, against a float64 oracle; a kf.patch-ed
torch.nn model under autocast gives the unpatched model's dtypes and values (to the precision of
autocast's dtype) and float32 gradients for its float32 parameters. kf.gated_mlp's and the
transformers patch's cases: tests/ops/test_gated_mlp.py, tests/test_transformers_fusions.py."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import kernelforge as kf
from tests.conftest import backend_cases
from tests.numerics import assert_matches_oracle


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_gemm_as_addmm(backend, device, activation):
    # float16 for Triton's CPU interpreter (its bfloat16 tl.dot is wrong), bfloat16 elsewhere
    dtype = torch.float16 if backend == "triton" and device == "cpu" else torch.bfloat16
    x = torch.randn(3, 7, 24, device=device, requires_grad=True)
    w = (torch.randn(10, 24, device=device) / 24 ** 0.5).requires_grad_()
    bias = torch.randn(10, device=device, requires_grad=True)
    device_type = device.split(":")[0]
    with kf.use_backend(backend), torch.autocast(device_type, dtype=dtype):
        got = kf.gemm(x, w.t(), bias=bias, activation=activation)
        want = F.linear(x, w, bias)
        want = F.gelu(want) if activation else want
    assert got.dtype == want.dtype == dtype
    exact = [t.detach().double().requires_grad_() for t in (x, w, bias)]
    oracle = F.linear(*exact)
    oracle = F.gelu(oracle) if activation else oracle
    assert_matches_oracle(got, want, oracle, "out", reduced=24)
    grad = torch.randn_like(got)
    pairs = zip(torch.autograd.grad(got, [x, w, bias], grad), torch.autograd.grad(want, [x, w, bias], grad),
                torch.autograd.grad(oracle, exact, grad.double()))
    for name, (a, b, c) in zip(("x", "weight", "bias"), pairs):
        assert a.dtype == b.dtype == torch.float32, name
        assert_matches_oracle(a, b, c, name, reduced=21, floor_dtype=dtype)


def test_gemm_keeps_an_explicit_precision_and_out_dtype():
    # precision or out_dtype named: the caller's choice, autocast or not
    x, w = torch.randn(4, 8), torch.randn(8, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kf.gemm(x, w, precision="fp32").dtype == torch.float32
        assert kf.gemm(x, w, out_dtype=torch.float32).dtype == torch.float32
        assert kf.gemm(x.double(), w.double()).dtype == torch.float64  # autocast leaves float64 alone
        assert kf.gemm(x, w).dtype == torch.bfloat16


@pytest.mark.parametrize("build", ["mlp", "encoder_layer"])
def test_a_patched_model_as_the_unpatched(build):
    torch.manual_seed(0)
    if build == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                    torch.nn.Linear(32, 8))
        x = torch.randn(4, 16)
    else:
        model = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        x = torch.randn(2, 7, 32)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kf.patch(model)
    outs = []
    for m in (model, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(m(x))
        outs[-1].float().square().sum().backward()
    assert outs[0].dtype == outs[1].dtype
    scale = outs[1].abs().max().item()
    assert (outs[0].float() - outs[1].float()).abs().max().item() <= 2e-2 * scale
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert b.grad.dtype == torch.float32, name
        assert (b.grad - a.grad).abs().max().item() <= 5e-2 * (a.grad.abs().max().item() + 1e-6), name


@pytest.mark.parametrize("backend,device", backend_cases(("reference",)))
def test_an_explicit_precision_is_computed_at_it(backend, device):
    # precision="fp32" under autocast: the product in float32 (no torch matmul inside the backend
    # recast to bfloat16 by autocast), equal to the call outside autocast
    a, b = torch.randn(5, 64, device=device), torch.randn(64, 7, device=device)
    with kf.use_backend(backend):
        outside = kf.gemm(a, b, precision="fp32")
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            inside = kf.gemm(a, b, precision="fp32")
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_fused_linear_cross_entropy_as_linear_then_cross_entropy(backend, device, monkeypatch):
    # under autocast F.linear's logits are in autocast's dtype and F.cross_entropy runs in float32:
    # the fused loss's GEMMs take x and the weight in autocast's dtype, the loss accumulates in float32
    from kernelforge.ops import linear_cross_entropy

    dtype = torch.float16 if backend == "triton" and device == "cpu" else torch.bfloat16
    operand_dtypes = set()

    def spy(a, b, *args, _gemm=linear_cross_entropy.gemm, **kwargs):
        operand_dtypes.update((a.dtype, b.dtype))
        return _gemm(a, b, *args, **kwargs)

    monkeypatch.setattr(linear_cross_entropy, "gemm", spy)
    x = torch.randn(6, 32, device=device, requires_grad=True)
    w = (torch.randn(50, 32, device=device) / 32 ** 0.5).requires_grad_()
    target = torch.randint(0, 50, (6,), device=device)
    with kf.use_backend(backend), torch.autocast(device.split(":")[0], dtype=dtype):
        got = kf.fused_linear_cross_entropy(x, w, target)
        want = F.cross_entropy(F.linear(x, w), target)
    assert got.dtype == want.dtype == torch.float32
    assert operand_dtypes == {dtype}, operand_dtypes
    exact = [t.detach().double().requires_grad_() for t in (x, w)]
    oracle = F.cross_entropy(F.linear(*exact), target)
    assert_matches_oracle(got.reshape(1), want.reshape(1), oracle.reshape(1), "loss", reduced=32, floor_dtype=dtype)
    pairs = zip(torch.autograd.grad(got, [x, w]), torch.autograd.grad(want, [x, w]), torch.autograd.grad(oracle, exact))
    for name, (a, b, c) in zip(("x", "weight"), pairs):
        assert a.dtype == b.dtype == torch.float32, name
        assert_matches_oracle(a, b, c, name, reduced=50, floor_dtype=dtype)


def test_gemm_under_autocast_compiles_whole():
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 5, requires_grad=True)

    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return kf.gemm(x, w, activation="gelu")

    torch._dynamo.reset()
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(x, w)
    want = f(x, w)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("autocast", [False, True])
def test_the_autocast_query_compiles_whole_where_dynamo_cannot_ask_for_autocast(monkeypatch, autocast):
    # torch 2.11's Dynamo cannot trace torch._C._is_autocast_available (2.13's folds it to a
    # constant): every fullgraph compile of a model on kf.gemm / kf.gated_mlp / the fused losses
    # broke there (the example models' decode step at the compile and fastest levels). Made
    # untraceable here too: the ops must not ask on a CPU or a GPU, where autocast always exists.
    monkeypatch.setattr(torch.amp, "is_autocast_available", torch._dynamo.disable(torch.amp.is_autocast_available))
    x, w = torch.randn(4, 8), torch.randn(8, 5)

    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return kf.gemm(x, w)

    torch._dynamo.reset()
    got = torch.compile(f, backend="eager", fullgraph=True)(x, w)
    assert got.dtype == (torch.bfloat16 if autocast else torch.float32)
    torch.testing.assert_close(got, f(x, w))
