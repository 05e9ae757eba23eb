"""Fuzzing the gated activations (swiglu, geglu with either gelu, separate gate and up or packed
[gate | up]) and gated_mlp: any rank, sizes of 0, 1, primes and 2^k +- 1, transposed / gapped /
expanded gate and up (each its own layout), NaN entries in gate and up and +-inf in gate (the gated
ops agree with torch there), transposed and gapped x and weights; outputs and every input's gradient against
the float64 oracle (tests/numerics.py)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

import kernelforge as kf
from tests.fuzz.strategies import (
    BACKENDS, REFERENCE_DTYPES, Layout, Maker, dtypes_for, exact, fuzz, layouts, leaf,
    seeds, shapes, sizes)
from tests.fuzz.strategies import assert_matches_oracle_with_specials, three_gradients
from tests.numerics import assert_matches_oracle

pytestmark = pytest.mark.fuzz

TORCH_ACT = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}
PUBLIC = {"silu": kf.swiglu, "gelu": kf.geglu, "gelu_tanh": lambda g, u=None: kf.geglu(g, u, approximate="tanh")}


# ----------------------------------------------------------------------------- swiglu / geglu
@dataclasses.dataclass(frozen=True)
class GluCase:
    kind: str
    packed: bool
    shape: tuple  # gate's and up's (packed: the output's; the input's last dim is twice it)
    dtype: torch.dtype
    gate_layout: Layout
    up_layout: Layout
    scale: float
    special: Optional[float]  # NaN or +-inf at some entries of gate (NaN: of up too)
    seed: int


@st.composite
def glu_cases(draw, backend):
    shape = draw(shapes(min_rank=1, max_rank=4, max_numel=2000))
    rank = len(shape)
    return GluCase(kind=draw(st.sampled_from(sorted(PUBLIC))), packed=draw(st.booleans()), shape=shape,
                   dtype=draw(st.sampled_from(dtypes_for(backend))), gate_layout=draw(layouts(rank, expand=True)),
                   up_layout=draw(layouts(rank, expand=True)), scale=draw(st.sampled_from([0.5, 1.0, 3.0, 30.0])),
                   special=draw(st.sampled_from([None] * 5 + [float("nan"), float("inf"), float("-inf")])),
                   seed=draw(seeds()))


def check_glu(backend, case: GluCase):
    make = Maker(case.seed)
    act = TORCH_ACT[case.kind]
    # An infinite up times an activation whose tail rounds to 0 is NaN or +-inf depending on how far
    # each computation resolves the tail (gelu_tanh(-8.8) * inf: -inf on Triton, which resolves
    # -6.7e-27; NaN in torch's float64): infinities go into gate only
    fill = None if case.special is None else (case.special, 0.05)
    up_fill = fill if case.special is not None and math.isnan(case.special) else None
    if case.packed:
        inputs = [make.tensor(case.shape[:-1] + (2 * case.shape[-1],), case.dtype, case.gate_layout, case.scale,
                              fill=up_fill)]

        def theirs_fn(gate_up):
            gate, up = gate_up.chunk(2, -1)
            return act(gate) * up
    else:
        inputs = [make.tensor(case.shape, case.dtype, case.gate_layout, case.scale, fill=fill),
                  make.tensor(case.shape, case.dtype, case.up_layout, fill=up_fill)]

        def theirs_fn(gate, up):
            return act(gate) * up
    mine, theirs, exact_in = [leaf(t) for t in inputs], [leaf(t) for t in inputs], [exact(t) for t in inputs]
    what = f"{backend} {case}"
    with kf.use_backend(backend):
        y = PUBLIC[case.kind](*mine)
    y_theirs, y64 = theirs_fn(*theirs), theirs_fn(*exact_in)
    assert y.shape == case.shape and y.dtype == case.dtype
    assert_matches_oracle_with_specials(y.detach(), y_theirs.detach(), y64.detach(), f"{what} out")
    if y.numel() == 0:
        return
    g = make.randn(y.shape, y.dtype)
    got, base, want = three_gradients(backend, y, y_theirs, y64, g, mine, theirs, exact_in)
    for name, a, b, c, t in zip(("gate", "up"), got, base, want, inputs):
        assert a.shape == t.shape and a.dtype == t.dtype
        assert_matches_oracle_with_specials(a, b, c, f"{what} grad {name}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gated_activations_match_oracle(backend):
    fuzz(backend, glu_cases, check_glu, reference=100, triton=80)


# ----------------------------------------------------------------------------- gated_mlp
@dataclasses.dataclass(frozen=True)
class MlpCase:
    activation: str
    batch: tuple  # x's leading dims
    hidden: int
    inner: int
    out: int
    dtype: torch.dtype
    x_layout: Layout
    weight_layouts: tuple  # gate's, up's, down's
    seed: int


# The GEMMs are torch's (any dtype, either backend); the gated activation between them is the
# backend's. tests/ops/test_gated_mlp.py runs bfloat16 on the interpreted Triton too: the GEMMs'
# rounding hides the interpreter's bf16 stores.
def mlp_dtypes(backend):
    return REFERENCE_DTYPES if backend == "reference" else tuple(dtypes_for(backend)) + (torch.bfloat16,)


@st.composite
def mlp_cases(draw, backend):
    batch = draw(shapes(min_rank=0, max_rank=2, max_numel=40, max_size=40))
    hidden, inner, out = draw(sizes(48)), draw(sizes(64)), draw(sizes(48))
    return MlpCase(activation=draw(st.sampled_from(sorted(TORCH_ACT))), batch=batch, hidden=hidden, inner=inner,
                   out=out, dtype=draw(st.sampled_from(mlp_dtypes(backend))),
                   x_layout=draw(layouts(len(batch) + 1)), weight_layouts=tuple(draw(layouts(2)) for _ in range(3)),
                   seed=draw(seeds()))


def written_out(x, wg, wu, wd, activation):
    return F.linear(TORCH_ACT[activation](F.linear(x, wg)) * F.linear(x, wu), wd)


def mlp_term_scales(x, wg, wu, wd, g, activation):
    """The sums of absolute terms that round into the output and each gradient (float64), as
    tests/ops/test_gemm.py's term_scale: a GEMM's rounding scales with sum |a_ik b_kj|, which
    cancellation does not shrink; propagated through the activation by its derivative."""
    x, wg, wu, wd, g = (t.detach().double() for t in (x, wg, wu, wd, g))
    gate = F.linear(x, wg).requires_grad_()
    up = F.linear(x, wu)
    a = TORCH_ACT[activation](gate)
    (da,) = torch.autograd.grad(a.sum(), gate)
    a, gate = a.detach().abs(), gate.detach()
    gate_terms, up_terms = F.linear(x.abs(), wg.abs()), F.linear(x.abs(), wu.abs())
    h_terms = a * up_terms + (da * up).abs() * gate_terms
    dh_terms = g.abs() @ wd.abs()
    dgate, dup = dh_terms * (da * up).abs(), dh_terms * a
    rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    top = lambda t: t.max().item() if t.numel() else 0.0  # noqa: E731
    return {"out": top(F.linear(h_terms, wd.abs())), "x": top(dgate @ wg.abs() + dup @ wu.abs()),
            "gate_weight": top(rows(dgate).t() @ rows(x.abs())), "up_weight": top(rows(dup).t() @ rows(x.abs())),
            "down_weight": top(rows(g.abs()).t() @ rows(h_terms))}


def check_mlp(backend, case: MlpCase):
    make = Maker(case.seed)
    x = make.tensor(case.batch + (case.hidden,), case.dtype, case.x_layout)
    weights = [make.tensor(shape, case.dtype, layout, scale=shape[1] ** -0.5)
               for shape, layout in zip(((case.inner, case.hidden), (case.inner, case.hidden),
                                         (case.out, case.inner)), case.weight_layouts)]
    params = [x, *weights]
    mine, same, exact_in = [leaf(t) for t in params], [leaf(t) for t in params], [exact(t) for t in params]
    what = f"{backend} {case}"
    with kf.use_backend(backend):
        y = kf.gated_mlp(*mine, activation=case.activation)
    yard, oracle = written_out(*same, case.activation), written_out(*exact_in, case.activation)
    rows = max(1, x.numel() // max(1, case.hidden))
    g = make.randn(yard.shape, case.dtype)
    terms = mlp_term_scales(*params, g, case.activation)
    assert y.shape == oracle.shape and y.dtype == case.dtype
    assert_matches_oracle(y.detach(), yard.detach(), oracle.detach(), f"{what} out", reduced=case.inner,
                          terms_scale=terms["out"])
    if y.numel() == 0:
        return
    got, base, want = three_gradients(backend, y, yard, oracle, g, mine, same, exact_in)
    reduced = {"x": max(case.inner, case.out), "gate_weight": rows * case.out, "up_weight": rows * case.out,
               "down_weight": rows}
    for name, a, b, c in zip(("x", "gate_weight", "up_weight", "down_weight"), got, base, want):
        assert a.shape == c.shape and a.dtype == b.dtype, f"{what} grad {name}"
        assert_matches_oracle(a, b, c, f"{what} grad {name}", reduced=reduced[name], terms_scale=terms[name])


@pytest.mark.parametrize("backend", BACKENDS)
def test_gated_mlp_matches_oracle(backend):
    fuzz(backend, mlp_cases, check_mlp, reference=25, triton=30)
