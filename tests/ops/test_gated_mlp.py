"""kernelforge.gated_mlp against the MLP written out (float64 oracle, the same in the tested dtype as
the yardstick): every activation, batched and strided x, odd sizes, the gradients of x and the
three weights, a residual added (and its gradient), what the backward keeps (gate and up, not the
activation), opcheck, torch.compile, bad input."""
import pytest
import torch
import torch.nn.functional as F

import kernelforge as kf
from tests.conftest import backend_cases
from tests.numerics import assert_matches_oracle

ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


def written_out(x, wg, wu, wd, activation):
    return F.linear(ACTS[activation](F.linear(x, wg)) * F.linear(x, wu), wd)


def weights(hidden, inner, out, device, dtype):
    return [(torch.randn(*shape, device=device) / shape[1] ** 0.5).to(dtype)
            for shape in ((inner, hidden), (inner, hidden), (out, inner))]


def dtypes_for(backend, device):
    return [torch.float32, torch.float16, torch.bfloat16] + ([torch.float64] if backend == "reference" else [])


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
@pytest.mark.parametrize("activation", list(ACTS))
def test_matches_the_written_out_mlp(backend, device, activation):
    # x (2, 7, 24) and a transposed view; intermediate 40, out 24 and 9
    for dtype in dtypes_for(backend, device):
        if device == "cpu" and dtype == torch.float16:
            continue  # half matmuls on a CPU: slow and not what anyone runs
        for out, strided in ((24, False), (9, True)):
            x = torch.randn(2, 24, 7, device=device).to(dtype).transpose(1, 2) if strided else \
                torch.randn(2, 7, 24, device=device).to(dtype)
            params = [x, *weights(24, 40, out, device, dtype)]
            mine = [t.detach().clone().requires_grad_() for t in params]
            same = [t.detach().clone().requires_grad_() for t in params]
            exact = [t.detach().double().requires_grad_() for t in params]
            with kf.use_backend(backend):
                y = kf.gated_mlp(*mine, activation=activation)
            yard, oracle = written_out(*same, activation), written_out(*exact, activation)
            label = f"{backend} {dtype} {activation} out={out} strided={strided}"
            assert_matches_oracle(y, yard.detach(), oracle.detach(), label, reduced=40)
            grad = torch.randn_like(y)
            with kf.use_backend(backend):
                got = torch.autograd.grad(y, mine, grad)
            base = torch.autograd.grad(yard, same, grad)
            want = torch.autograd.grad(oracle, exact, grad.double())
            for name, g, b, w in zip(("x", "gate_weight", "up_weight", "down_weight"), got, base, want):
                assert g.shape == w.shape and g.dtype == b.dtype, f"{label} grad {name}"
                assert_matches_oracle(g, b, w, f"{label} grad {name}", reduced=40 * 14)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_with_a_residual(backend, device):
    # residual + mlp(x), the add in the down projection's GEMM: a strided residual too, and its
    # gradient (the output's); float32 and bfloat16 against the float64 oracle
    for dtype in (torch.float32, torch.bfloat16):
        for strided in (False, True):
            x = torch.randn(3, 5, 24, device=device).to(dtype)
            residual = torch.randn(3, 24, 5, device=device).to(dtype).transpose(1, 2) if strided else \
                torch.randn(3, 5, 24, device=device).to(dtype)
            params = [x, *weights(24, 40, 24, device, dtype), residual]
            mine = [t.detach().clone().requires_grad_() for t in params]
            same = [t.detach().clone().requires_grad_() for t in params]
            exact = [t.detach().double().requires_grad_() for t in params]
            with kf.use_backend(backend):
                y = kf.gated_mlp(*mine[:4], residual=mine[4])
            yard, oracle = same[4] + written_out(*same[:4], "silu"), exact[4] + written_out(*exact[:4], "silu")
            label = f"{backend} {dtype} strided={strided}"
            assert_matches_oracle(y, yard.detach(), oracle.detach(), label, reduced=40)
            grad = torch.randn_like(y)
            with kf.use_backend(backend):
                got = torch.autograd.grad(y, mine, grad)
            base, want = torch.autograd.grad(yard, same, grad), torch.autograd.grad(oracle, exact, grad.double())
            for name, g, b, w in zip(("x", "gate_weight", "up_weight", "down_weight", "residual"), got, base, want):
                assert g.shape == w.shape and g.dtype == b.dtype, f"{label} grad {name}"
                assert_matches_oracle(g, b, w, f"{label} grad {name}", reduced=40 * 14)


def test_the_backward_keeps_gate_and_up_not_the_activation():
    # what autograd saves for the backward: x, gate, up and the weights; the unfused MLP also
    # keeps act(gate) * up (for the down projection's weight gradient)
    x = torch.randn(3, 8, requires_grad=True)
    wg, wu, wd = (w.requires_grad_() for w in weights(8, 32, 8, "cpu", torch.float32))

    def saved_elements(fn):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append((t.data_ptr(), t.numel())) or t,
                                                      lambda t: t):
            fn()
        return sum(n for _, n in set(sizes))

    params = x.numel() + wg.numel() + wu.numel() + wd.numel()
    assert saved_elements(lambda: kf.gated_mlp(x, wg, wu, wd)) == params + 2 * 3 * 32
    assert saved_elements(lambda: written_out(x, wg, wu, wd, "silu")) >= params + 3 * 3 * 32


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_opcheck(backend, device):
    x = torch.randn(2, 3, 8, device=device)
    wg, wu, wd = weights(8, 12, 5, device, torch.float32)
    with kf.use_backend(backend):
        for args in [(x, wg, wu, wd, "silu"), (x[0].t().contiguous().t(), wg, wu, wd, "gelu_tanh"),
                     (x, wg, wu, wd, "gelu", torch.randn(2, 3, 5, device=device))]:
            torch.library.opcheck(torch.ops.kernelforge.gated_mlp.default, args)


def test_compiles_without_graph_breaks():
    x = torch.randn(4, 8, requires_grad=True)
    ws = [w.requires_grad_() for w in weights(8, 16, 8, "cpu", torch.float32)]

    def f(x, *ws):
        return kf.gated_mlp(x, *ws, residual=x).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got, want = compiled(x, *ws), f(x, *ws)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, [x, *ws]), torch.autograd.grad(want, [x, *ws])):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_under_autocast_like_three_linears(backend, device):
    # float32 x and weights inside torch.autocast: the products in autocast's dtype as F.linear's
    # (the backward used to multiply a bfloat16 gradient by a float32 weight and fail), the
    # weights' gradients float32 through the casts
    dtype = torch.bfloat16
    x = torch.randn(3, 5, 24, device=device, requires_grad=True)
    ws = [w.requires_grad_() for w in weights(24, 40, 24, device, torch.float32)]
    with kf.use_backend(backend), torch.autocast(device.split(":")[0], dtype=dtype):
        got = kf.gated_mlp(x, *ws)
        want = written_out(x, *ws, "silu")
        with_residual = kf.gated_mlp(x, *ws, residual=x)  # added in the product's dtype, autocast's
    assert got.dtype == want.dtype == with_residual.dtype == dtype
    torch.testing.assert_close(with_residual.float(), (got + x.to(dtype)).float(), rtol=2e-2, atol=2e-2)
    exact = [t.detach().double().requires_grad_() for t in (x, *ws)]
    oracle = written_out(*exact, "silu")
    assert_matches_oracle(got, want, oracle, "out", reduced=40)
    grad = torch.randn_like(got)
    pairs = zip(torch.autograd.grad(got, [x, *ws], grad), torch.autograd.grad(want, [x, *ws], grad),
                torch.autograd.grad(oracle, exact, grad.double()))
    for name, (a, b, c) in zip(("x", "gate_weight", "up_weight", "down_weight"), pairs):
        assert a.dtype == b.dtype == torch.float32, name
        assert_matches_oracle(a, b, c, name, reduced=40, floor_dtype=dtype)


def test_bad_input_is_rejected():
    x = torch.randn(4, 8)
    wg, wu, wd = weights(8, 16, 8, "cpu", torch.float32)
    with pytest.raises(ValueError, match="activation must be one of"):
        kf.gated_mlp(x, wg, wu, wd, activation="tanh")
    # shape checks raise RuntimeError (torch._check: also under tracing)
    with pytest.raises(RuntimeError, match=r"gate_weight must be \(intermediate, 8\)"):
        kf.gated_mlp(x, wg[:, :4], wu, wd)
    with pytest.raises(RuntimeError, match="up_weight must have gate_weight's shape"):
        kf.gated_mlp(x, wg, wu[:8], wd)
    with pytest.raises(RuntimeError, match=r"down_weight must be \(out, 16\)"):
        kf.gated_mlp(x, wg, wu, wd[:, :4])
    with pytest.raises(RuntimeError, match="to have the same dtype"):
        kf.gated_mlp(x, wg, wu, wd.double())
    with pytest.raises(TypeError, match="up_weight must be a tensor"):
        kf.gated_mlp(x, wg, None, wd)
    with pytest.raises(TypeError, match="residual must be a tensor, got list"):
        kf.gated_mlp(x, wg, wu, wd, residual=[0.0])
    with pytest.raises(RuntimeError, match=r"residual must have the output's shape \(4, 8\), got \(4, 7\)"):
        kf.gated_mlp(x, wg, wu, wd, residual=x[:, :7])
    with pytest.raises(RuntimeError, match="to have the same dtype"):
        kf.gated_mlp(x, wg, wu, wd, residual=x.double())
    with pytest.raises(TypeError):
        kf.gated_mlp(x.long(), wg, wu, wd)
