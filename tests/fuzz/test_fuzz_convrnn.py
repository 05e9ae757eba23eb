"""Fuzzing convrnn: batch, time and features from 0 (1 step, 1 feature, taps wider than the row),
taps 1..9, transposed / gapped / expanded x and hidden, a gapped kernel; out, h_T and the gradients
through time of x, kernel and hidden against the float64 oracle (tests/numerics.py, with
tests/ops/test_convrnn.py's error model of the recurrence)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import strategies as st

import kernelforge as kf
from kernelforge.reference.convrnn import convrnn_backward as reference_backward
from kernelforge.reference.convrnn import convrnn_forward as reference_forward
from tests.fuzz.strategies import (
    BACKENDS, Layout, Maker, dtypes_for, fuzz, laid_out, layouts, leaf, seeds, sizes)
from tests.numerics import assert_matches_oracle
from tests.ops.test_convrnn import torch_loop

pytestmark = pytest.mark.fuzz


@dataclasses.dataclass(frozen=True)
class Case:
    B: int
    T: int
    F: int
    K: int
    dtype: torch.dtype
    x_layout: Layout
    hidden_layout: Layout
    kernel_layout: Layout
    seed: int


@st.composite
def cases(draw, backend):
    # the interpreter runs the recurrence one launch a step: few steps on Triton
    T = draw(sizes(12 if backend == "triton" else 24, min_size=0))
    return Case(B=draw(sizes(4, min_size=0)), T=T, F=draw(sizes(65, min_size=0)),
                K=draw(st.sampled_from([1, 3, 5, 7, 9])), dtype=draw(st.sampled_from(dtypes_for(backend))),
                x_layout=draw(layouts(3, expand=True)), hidden_layout=draw(layouts(2, expand=True)),
                kernel_layout=draw(layouts(3)), seed=draw(seeds()))


def recurrence_scale(case: Case, terms: int = 1) -> float:
    """float32's floor scale (tests/ops/test_convrnn.py): each output carries the roundings of T
    steps of K taps (a dkernel entry sums `terms` such products), a random walk of about
    sqrt(T (K + 2) terms) ulps; half precision needs none (PyTorch's loop rounds its state every
    step, ours keeps float32)."""
    return (case.T * (case.K + 2) * terms) ** 0.5 if case.dtype == torch.float32 else 0.0


def grads(outputs, leaves, grad_outputs):
    """The leaves' gradients; zeros for those no output depends on (no time steps, no features)."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    found = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True) if pairs \
        else [None] * len(leaves)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(found, leaves)]


def check(backend, case: Case):
    make = Maker(case.seed)
    x = make.tensor((case.B, case.T, case.F), case.dtype, case.x_layout)
    # taps summing to less than 1 in magnitude: the recurrence contracts (tests/ops/test_convrnn.py)
    kernel = laid_out(((make.rand((1, 1, case.K), torch.float64) * 2 - 1) / case.K).to(case.dtype),
                      case.kernel_layout)
    hidden = make.tensor((case.B, case.F), case.dtype, case.hidden_layout)
    inputs = (x, kernel, hidden)
    mine = [leaf(t) for t in inputs]
    what = f"{backend} {case}"
    with kf.use_backend(backend):
        out, h_last = kf.convrnn(*mine)
    o64, h64 = reference_forward(*(t.detach().double() for t in inputs))
    if case.dtype == torch.float64 or not hidden.numel():  # (torch's conv1d takes no empty rows)
        same_out, same_h = o64.to(case.dtype), h64.to(case.dtype)
    else:
        same_out, same_h = torch_loop(*(t.detach() for t in inputs))
    assert out.shape == x.shape and h_last.shape == hidden.shape and out.dtype == case.dtype
    scale = recurrence_scale(case)
    assert_matches_oracle(out.detach(), same_out, o64, f"{what} out", reduced=case.K, terms_scale=scale)
    assert_matches_oracle(h_last.detach(), same_h, h64, f"{what} h_T", reduced=case.K, terms_scale=scale)
    grad_out, grad_h = make.randn(out.shape, case.dtype), make.randn(h_last.shape, case.dtype)
    with kf.use_backend(backend):
        ours = torch.autograd.grad((out, h_last), mine, (grad_out, grad_h))
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    oracle = grads(reference_forward(*leaves), leaves, (grad_out.double(), grad_h.double()))
    if case.dtype == torch.float64 or not hidden.numel():
        same = [o.to(case.dtype) for o in oracle]
    elif case.dtype in (torch.float16, torch.bfloat16):
        # The backward reads the states as the forward rounded them into `out` (as PyTorch's own
        # half-precision loop does): judged against the float64 backward of those states
        # (tests/ops/test_convrnn.py)
        oracle = reference_backward(*(t.detach().double() for t in (grad_out, grad_h, kernel, hidden, out)))
        same = [o.to(case.dtype) for o in oracle]
    else:
        theirs = [leaf(t) for t in inputs]
        same = grads(torch_loop(*theirs), theirs, (grad_out, grad_h))
    for name, o, s, ref, terms in zip(("dx", "dkernel", "dhidden"), ours, same, oracle, (1, case.B * case.F, 1)):
        assert o.shape == inputs[("dx", "dkernel", "dhidden").index(name)].shape, f"{what} {name}"
        assert_matches_oracle(o, s, ref, f"{what} {name}", reduced=case.K * case.T * terms,
                              terms_scale=recurrence_scale(case, terms))


@pytest.mark.parametrize("backend", BACKENDS)
def test_convrnn_matches_oracle(backend):
    fuzz(backend, cases, check, reference=8, triton=25)


# ----------------------------------------------------------------------------- found by the fuzzing
def test_no_batch_rows_backward():
    # a kernelforge bug the fuzzing found, fixed since: the reference backward's F.conv1d(groups=batch)
    # refused a batch of 0
    # shrunk from Case(B=0, T=1, F=1, K=1, dtype=torch.float32, ...): any T >= 1, F >= 1, dtype; the
    # CPU's default backend
    x, hidden = torch.randn(0, 3, 4, requires_grad=True), torch.randn(0, 4, requires_grad=True)
    kernel = torch.full((1, 1, 3), 0.2, requires_grad=True)
    with kf.use_backend("reference"):
        out, h_last = kf.convrnn(x, kernel, hidden)
        dx, dkernel, dhidden = torch.autograd.grad(out.sum() + h_last.sum(), (x, kernel, hidden))
    assert dx.shape == x.shape and dhidden.shape == hidden.shape and torch.equal(dkernel, torch.zeros_like(kernel))
