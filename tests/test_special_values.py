"""NaN and infinities: every op's outputs and gradients are NaN, +inf and -inf exactly where torch's
equivalent gives them (computed in float64 from the same inputs), on every backend, for a NaN,
+inf, -inf, a whole row of -inf, and a mix planted in an input (docs/special_values.md).
flash_attention's cases (SDPA's semantics, masks, decode) are in tests/ops/test_attention.py."""
import math

import pytest
import torch
import torch.nn.functional as F

import kernelforge as kf
from tests.conftest import backend_cases

NAN, INF = math.nan, math.inf
# (row, column) of a (4, C) input and the value planted there
SPOTS = {"nan": [((1, 2), NAN)], "+inf": [((1, 2), INF)], "-inf": [((1, 2), -INF)],
         "row of -inf": [((1, slice(None)), -INF)], "mixed": [((0, 1), INF), ((0, 3), -INF), ((2, 0), NAN)]}
C = 37


def planted(spots, *shape):
    x = torch.randn(*shape)
    for index, value in spots:
        x[index] = value
    return x


def rotate_half(t):
    a, b = t.chunk(2, -1)
    return torch.cat((-b, a), -1)


def gather_scatter_in_torch(reduce):
    def f(x, src, dst):
        out = torch.zeros(4, x.shape[1], dtype=x.dtype).index_add(0, dst, x[src])
        if reduce == "mean":
            out = out / torch.bincount(dst, minlength=4).clamp(min=1).unsqueeze(1).to(x.dtype)
        return out
    return f


def convrnn_in_torch(x, kernel, hidden):
    """The recurrence step by step: h_t = tanh(x_t + conv1d(h_{t-1}, kernel, padding=K // 2))."""
    h, steps = hidden, []
    for t in range(x.shape[1]):
        h = torch.tanh(x[:, t] + F.conv1d(h.unsqueeze(1), kernel, padding=kernel.shape[-1] // 2).squeeze(1))
        steps.append(h)
    return torch.stack(steps, 1)


def cases(spots):
    """(name, backends with a kernel for it, inputs, indices of the differentiable ones, kernelforge's
    call, torch's equivalent)."""
    x = planted(spots, 4, C)
    w, b, other = torch.randn(C), torch.randn(C), torch.randn(4, C)
    target = torch.tensor([2, 5, 0, 9])
    weight = torch.randn(C, 5)
    src, dst = torch.tensor([0, 1, 2, 3, 1, 2]), torch.tensor([0, 0, 1, 2, 2, 3])
    q = planted([((0, 1, row, col), v) for (row, col), v in spots if isinstance(col, int)], 1, 2, 4, 8)
    cos, sin = torch.randn(4, 8), torch.randn(4, 8)
    everywhere, no_cuda = ("reference", "triton", "cuda"), ("reference", "triton")
    yield "softmax", everywhere, [x], (0,), kf.softmax, lambda x: torch.softmax(x, -1)
    yield "log_softmax", everywhere, [x], (0,), kf.log_softmax, lambda x: torch.log_softmax(x, -1)
    yield ("layer_norm", everywhere, [x, w, b], (0, 1, 2), kf.layer_norm,
           lambda x, w, b: F.layer_norm(x, (C,), w, b))
    yield ("rms_norm", everywhere, [x, w], (0, 1), lambda x, w: kf.rms_norm(x, w, eps=1e-6),
           lambda x, w: F.rms_norm(x, (C,), w, eps=1e-6))
    yield ("add_rms_norm", everywhere, [x, other, w], (0, 1, 2), lambda x, r, w: kf.add_rms_norm(x, r, w, eps=1e-6)[0],
           lambda x, r, w: F.rms_norm(x + r, (C,), w, eps=1e-6))
    for name, torch_act in (("gelu", F.gelu), ("silu", F.silu), ("relu", F.relu)):  # CUDA kernels: gelu's only
        yield name, everywhere if name == "gelu" else no_cuda, [x], (0,), getattr(kf, name), torch_act
    yield "gelu tanh", everywhere, [x], (0,), lambda x: kf.gelu(x, "tanh"), lambda x: F.gelu(x, approximate="tanh")
    yield "bias_silu", no_cuda, [x, b], (0, 1), kf.bias_silu, lambda x, b: F.silu(x + b)
    yield "swiglu (gate)", no_cuda, [x, other], (0, 1), kf.swiglu, lambda g, u: F.silu(g) * u
    yield "swiglu (up)", no_cuda, [other, x], (0, 1), kf.swiglu, lambda g, u: F.silu(g) * u
    yield "geglu", no_cuda, [x, other], (0, 1), kf.geglu, lambda g, u: F.gelu(g) * u
    for reduction in ("none", "mean"):
        yield (f"cross_entropy {reduction}", no_cuda, [x, target], (0,),
               lambda x, t, r=reduction: kf.cross_entropy(x, t, reduction=r),
               lambda x, t, r=reduction: F.cross_entropy(x, t, reduction=r))
    yield ("cross_entropy smoothed", no_cuda, [x, target], (0,),
           lambda x, t: kf.cross_entropy(x, t, reduction="none", label_smoothing=0.1),
           lambda x, t: F.cross_entropy(x, t, reduction="none", label_smoothing=0.1))
    yield ("fused_linear_cross_entropy", no_cuda, [x, weight.t().contiguous(), target[:4] % 5], (0, 1),
           lambda x, w, t: kf.fused_linear_cross_entropy(x, w, t, reduction="none"),
           lambda x, w, t: F.cross_entropy(x @ w.t(), t, reduction="none"))
    yield "gemm", everywhere, [x, weight], (0, 1), kf.gemm, torch.matmul
    yield ("gemm + gelu", everywhere, [x, weight], (0, 1), lambda a, b: kf.gemm(a, b, activation="gelu"),
           lambda a, b: F.gelu(a @ b))
    yield ("gemm + residual", everywhere, [planted(spots[:1], 4, 5) if spots and spots[0][0][0] < 4 else torch.randn(4, 5),
                                           other, weight], (0, 1, 2),
           lambda r, a, b: kf.gemm(a, b, residual=r), lambda r, a, b: a @ b + r)
    for reduce in ("sum", "mean"):
        yield (f"gather_scatter {reduce}", no_cuda, [x, src, dst], (0,),
               lambda x, s, d, r=reduce: kf.gather_scatter(x, s, d, 4, r), gather_scatter_in_torch(reduce))
    sequence = torch.randn(4, 3, C)
    sequence[:, 1] = x  # the special values at the second of three steps
    yield ("convrnn", everywhere, [sequence, torch.randn(1, 1, 3) * 0.3, torch.randn(4, C)], (0, 1, 2),
           lambda x, k, h: kf.convrnn(x, k, h)[0], convrnn_in_torch)
    yield ("rope", no_cuda, [q, torch.randn(1, 1, 4, 8), cos, sin], (0,),
           lambda q, k, c, s: kf.rope(q, k, c, s)[0], lambda q, k, c, s: q * c + rotate_half(q) * s)


def special(t: torch.Tensor) -> torch.Tensor:
    return torch.stack([t.isnan(), t == INF, t == -INF])


def _on(t, device, dtype, requires_grad):
    if not t.is_floating_point():
        return t.to(device)
    return t.to(device, dtype).requires_grad_(requires_grad)


@pytest.mark.parametrize("backend,device", backend_cases())
@pytest.mark.parametrize("spot", list(SPOTS))
def test_special_values_land_where_torchs_do(backend, device, spot):
    dtype = torch.float16 if backend == "cuda" else torch.float32  # the CUDA GEMM takes half types
    checked = 0
    for name, backends, inputs, differentiable, mine, theirs in cases(SPOTS[spot]):
        if backend not in backends:
            continue
        inputs = [t.to(dtype) if t.is_floating_point() else t for t in inputs]  # the same values both sides
        xs = [_on(t, device, dtype, i in differentiable) for i, t in enumerate(inputs)]
        exact = [_on(t, "cpu", torch.float64, i in differentiable) for i, t in enumerate(inputs)]
        with kf.use_backend(backend):
            got = mine(*xs)
        want = theirs(*exact)
        what = f"{name}, {backend} {dtype}, {spot}"
        assert torch.equal(special(got.double()).cpu(), special(want)), what
        finite = want.isfinite()  # and the rest as torch's (a -inf logit's probability 0, a relu's 0)
        torch.testing.assert_close(got.double().cpu()[finite], want.detach()[finite], rtol=1e-2, atol=1e-2, msg=what)
        grad = torch.randn_like(want)
        with kf.use_backend(backend):
            got_grads = torch.autograd.grad(got, [xs[i] for i in differentiable], grad.to(device, got.dtype))
        want_grads = torch.autograd.grad(want, [exact[i] for i in differentiable], grad)
        for i, g, e in zip(differentiable, got_grads, want_grads):
            assert torch.equal(special(g.double()).cpu(), special(e)), f"{what}: the gradient of input {i}"
            finite = e.isfinite()  # and the finite ones as torch's (relu's at a NaN: the gradient passes)
            torch.testing.assert_close(g.double().cpu()[finite], e[finite], rtol=2e-2, atol=2e-2,
                                       msg=f"{what}: the gradient of input {i}")
        checked += 1
    assert checked >= 8
