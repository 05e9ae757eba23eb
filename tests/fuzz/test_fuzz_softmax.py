"""Fuzzing softmax and log_softmax: any rank (0-d included), any dim, sizes of 0, 1, primes and
2^k +- 1, transposed / gapped / expanded inputs, every dtype each backend takes, -inf entries
(masking; whole rows of them too) and NaN / +inf entries (the ops agree with torch there: NaN in the
same places), forward and gradient against the float64 oracle with torch's same-dtype error as the
yardstick (tests/numerics.py)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch
from hypothesis import strategies as st

import kernelforge as kf
from tests.fuzz.strategies import (
    BACKENDS, Layout, Maker, dtypes_for, exact, fuzz, layouts, leaf, seeds, shapes)
from tests.numerics import assert_matches_oracle

pytestmark = pytest.mark.fuzz

FUNCS = {"softmax": (kf.softmax, torch.softmax), "log_softmax": (kf.log_softmax, torch.log_softmax)}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    shape: tuple
    dim: int
    dtype: torch.dtype
    layout: Layout
    scale: float
    special: Optional[float]  # -inf (masking), NaN or +inf at some entries
    fraction: float  # of the entries set to `special`
    seed: int


@st.composite
def cases(draw, backend):
    shape = draw(shapes(min_rank=0, max_rank=4, max_numel=3000))
    rank = len(shape)
    dim = draw(st.integers(-max(rank, 1), max(rank, 1) - 1))
    return Case(name=draw(st.sampled_from(sorted(FUNCS))), shape=shape, dim=dim,
                dtype=draw(st.sampled_from(dtypes_for(backend))), layout=draw(layouts(rank, expand=True)),
                scale=draw(st.sampled_from([0.1, 1.0, 3.0, 20.0])),
                special=draw(st.sampled_from([None, None, float("-inf"), float("-inf"), float("nan"), float("inf")])),
                fraction=draw(st.sampled_from([0.05, 0.3, 1.0])), seed=draw(seeds()))


def cancelling_terms(name, x64, g64, dim):
    """The scale of the gradient's rounding (tests/ops/test_softmax.py): g - p * sum(g) for
    log_softmax, p * (g - sum(p g)) for softmax, the sum a float32 reduction of n terms whose error
    walks like sqrt(n) ulps of its largest term."""
    if x64.dim() == 0 or x64.numel() == 0:
        return 0.0
    with torch.no_grad():
        p = torch.softmax(x64, dim)
        p = torch.where(p.isnan(), torch.zeros_like(p), p)
        terms = (g64 if name == "log_softmax" else p * g64).abs()
        n = x64.shape[dim]
        return max(terms.max().item(), p.max().item() * n ** 0.5 * terms.max().item())


def check(backend, case: Case):
    make = Maker(case.seed)
    ours_fn, torch_fn = FUNCS[case.name]
    x = make.tensor(case.shape, case.dtype, case.layout, scale=case.scale,
                    fill=None if case.special is None else (case.special, case.fraction))
    n = x.shape[case.dim] if x.dim() else 1
    what = f"{backend} {case}"
    mine, theirs, x64 = leaf(x), leaf(x), exact(x)
    g = make.randn(x.shape, case.dtype)
    with kf.use_backend(backend):
        y = ours_fn(mine, case.dim)
    y_theirs, y64 = torch_fn(theirs, case.dim), torch_fn(x64, case.dim)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_matches_oracle(y.detach(), y_theirs.detach(), y64.detach(), f"{what} out", reduced=n)
    if x.numel() == 0:
        return
    with kf.use_backend(backend):
        (gx,) = torch.autograd.grad(y, mine, g)
    (gx_theirs,) = torch.autograd.grad(y_theirs, theirs, g)
    (gx64,) = torch.autograd.grad(y64, x64, g.double())
    assert_matches_oracle(gx, gx_theirs, gx64, f"{what} grad", reduced=n,
                          terms_scale=cancelling_terms(case.name, x64.detach(), g.double(), case.dim))


@pytest.mark.parametrize("backend", BACKENDS)
def test_softmax_matches_oracle(backend):
    fuzz(backend, cases, check, reference=100, triton=100)
