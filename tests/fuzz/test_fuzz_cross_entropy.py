"""Fuzzing cross_entropy and fused_linear_cross_entropy against F.cross_entropy in float64.

cross_entropy: torch's layouts ((C,) with a 0-d target, (N, C), (N, C, d1, ...)), classes from 1,
rows from 0, gapped / transposed / expanded logits, int64 and int32 targets, ignore_index (torch's
-100, a class, one past int32), some, none or all targets ignored, label smoothing up to 1, every
reduction, -inf (masked classes), +inf and NaN logits (the op agrees with torch there); the loss and
the logits' gradient.
fused_linear_cross_entropy: x (..., hidden) with 0-2 batch dims, the weight read transposed or from
gapped storage, with and without a bias, every reduction, ignore_index, label smoothing, softcap,
z-loss, chunk_rows (chunks that do and do not divide the rows), vocabulary slices in the recomputing
backward, and which of x, weight and bias need a gradient (the gradients-in-the-forward path, the
recomputing one, or none); the loss and every gradient. All against the float64 oracle
(tests/numerics.py)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

import kernelforge as kf
from kernelforge.ops import linear_cross_entropy as lce
from tests.fuzz.strategies import (
    BACKENDS, Layout, Maker, dtypes_for, exact, fuzz, layouts, leaf, seeds, shapes, sizes)
from tests.numerics import assert_matches_oracle
from tests.ops.test_linear_cross_entropy import loss_of_logits

pytestmark = pytest.mark.fuzz

INT32_PAST = 2 ** 31 + 5  # an ignore_index no int32 target can hold (compared as int64, not wrapped)


def draw_targets(make: Maker, shape, classes: int, ignore_index: int, ignored: float, dtype) -> torch.Tensor:
    """Class indices, the `ignored` fraction of them ignore_index (where dtype can hold it)."""
    target = make.randint(0, classes, shape)
    hidden = make.rand(shape) < ignored
    if target.numel() and torch.iinfo(dtype).min <= ignore_index <= torch.iinfo(dtype).max:
        target = torch.where(hidden, torch.full_like(target, ignore_index), target)
    return target.to(dtype)


# ----------------------------------------------------------------------------- cross_entropy
@dataclasses.dataclass(frozen=True)
class CeCase:
    shape: tuple  # logits: (C,), (N, C) or (N, C, d1, ...)
    dtype: torch.dtype
    layout: Layout
    target_dtype: torch.dtype
    ignore_index: int
    ignored: float  # the fraction of targets set to ignore_index
    label_smoothing: float
    reduction: str
    scale: float
    special: Optional[float]  # -inf (masked classes), +inf or NaN at some logits
    seed: int


@st.composite
def ce_cases(draw, backend):
    classes = draw(sizes(300))
    form = draw(st.sampled_from(["C", "NC", "NC", "NCd"]))
    if form == "C":
        shape = (classes,)
    else:
        # the interpreter runs a program a row, a few milliseconds each: fewer rows on Triton
        rows = 96 if backend == "triton" else 3000
        rest = draw(shapes(min_rank=1 if form == "NC" else 2, max_rank=1 if form == "NC" else 3,
                           max_numel=max(1, min(rows, 3000 // classes)), max_size=200))
        shape = (rest[0], classes) + rest[1:]
    target_dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    ignore_choices = [-100, -1, draw(st.integers(0, classes - 1))] + ([INT32_PAST] if target_dtype == torch.int32
                                                                        else [])
    return CeCase(shape=shape, dtype=draw(st.sampled_from(dtypes_for(backend))),
                  layout=draw(layouts(len(shape), expand=True)), target_dtype=target_dtype,
                  ignore_index=draw(st.sampled_from(ignore_choices)),
                  ignored=draw(st.sampled_from([0.0, 0.2, 0.2, 1.0])),
                  label_smoothing=draw(st.sampled_from([0.0, 0.0, 0.1, 0.5, 1.0])),
                  reduction=draw(st.sampled_from(["none", "sum", "mean"])),
                  scale=draw(st.sampled_from([1.0, 4.0, 20.0])),
                  special=draw(st.sampled_from([None] * 4 + [-math.inf, -math.inf, math.inf, math.nan])),
                  seed=draw(seeds()))


def logit_rows(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() == 1:
        return logits[None]
    return logits.movedim(1, -1).reshape(-1, logits.shape[1])


def check_ce(backend, case: CeCase):
    make = Maker(case.seed)
    logits = make.tensor(case.shape, case.dtype, case.layout, scale=case.scale,
                         fill=None if case.special is None else (case.special, 0.2))
    target_shape = () if len(case.shape) == 1 else (case.shape[0],) + case.shape[2:]
    ignore = case.ignore_index if case.ignore_index != INT32_PAST or case.target_dtype == torch.int32 else -100
    target = draw_targets(make, target_shape, case.shape[1 if len(case.shape) > 1 else 0], ignore, case.ignored,
                          case.target_dtype)
    options = dict(ignore_index=ignore, reduction=case.reduction, label_smoothing=case.label_smoothing)
    mine, same, x64 = leaf(logits), leaf(logits), exact(logits)
    what = f"{backend} {case}"
    with kf.use_backend(backend):
        loss = kf.cross_entropy(mine, target, **options)
    yard_dtype = torch.float64 if case.dtype == torch.float64 else torch.float32  # the float32-loss recipe
    yard = F.cross_entropy(same.to(yard_dtype), target.long(), **options)
    oracle = F.cross_entropy(x64, target.long(), **options)
    assert loss.shape == oracle.shape and loss.dtype == yard.dtype, what
    # A row's loss is lse - (1 - eps) x_t - eps mean(x): it cancels to far below its terms (a row the
    # model gets right), so its rounding is at |lse| + max |x| a row; a sum adds the counted rows',
    # a mean averages them (tests/ops/test_cross_entropy.py)
    rows64 = logit_rows(x64.detach())
    t = target.reshape(-1).long()
    counted = t != ignore
    count = int(counted.sum())
    lse = torch.logsumexp(rows64, -1).abs() if rows64.numel() else rows64.new_zeros(0)
    row_terms = lse + rows64.abs().amax(-1) if rows64.numel() else lse
    row_terms = torch.where(counted & row_terms.isfinite(), row_terms, torch.zeros_like(row_terms))  # finite rows'
    top = row_terms.max().item() if row_terms.numel() else 0.0
    loss_terms = {"none": top, "mean": top, "sum": row_terms.sum().item()}[case.reduction]
    n_classes = rows64.shape[-1]
    assert_matches_oracle(loss.detach(), yard.detach(), oracle.detach(), f"{what} loss", reduced=n_classes,
                          terms_scale=loss_terms)
    if logits.numel() == 0:
        return
    g = make.randn(loss.shape, loss.dtype)
    with kf.use_backend(backend):
        (got,) = torch.autograd.grad(loss, mine, g)
    (base,) = torch.autograd.grad(yard, same, g.to(yard.dtype))
    (want,) = torch.autograd.grad(oracle, x64, g.double())
    # g * (softmax - (1 - eps) onehot - eps / C) from the lse kept in float32, which rounds it by half
    # an ulp of |lse|: every p of the row moves by that (tests/ops/test_cross_entropy.py), so the
    # floor is at |g_row| (1 + |lse| / 8); the mean divides g by the count
    g_rows = g.double().abs().reshape(-1) if case.reduction == "none" else g.double().abs().expand(t.shape[0])
    if case.reduction == "mean":
        g_rows = g_rows / max(count, 1)
    grad_terms = (g_rows * (1 + lse / 8)).nan_to_num(0.0, 0.0, 0.0).max().item() if lse.numel() else 0.0
    assert got.dtype == logits.dtype and got.shape == logits.shape
    assert_matches_oracle(got, base.to(got.dtype), want, f"{what} grad", reduced=n_classes, terms_scale=grad_terms)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_matches_oracle(backend):
    fuzz(backend, ce_cases, check_ce, reference=100, triton=50)


# ----------------------------------------------------------------------------- fused_linear_cross_entropy
@dataclasses.dataclass(frozen=True)
class LceCase:
    batch: tuple  # x's leading dims (the rows)
    hidden: int
    vocab: int
    dtype: torch.dtype
    bias: bool
    x_layout: Layout
    weight_transposed: bool  # the weight a (hidden, vocab) buffer read transposed
    weight_layout: Layout
    ignore_index: int
    ignored: float
    label_smoothing: float
    softcap: Optional[float]
    z_loss: float
    reduction: str
    chunk_rows: Optional[int]
    min_slice_classes: Optional[int]  # the backward's narrowest vocabulary slice (None: the default)
    needs: tuple  # x, weight, bias requiring a gradient
    seed: int


@st.composite
def lce_cases(draw, backend):
    batch = draw(shapes(min_rank=0, max_rank=2, max_numel=48, max_size=48))
    rows = math.prod(batch)
    hidden, vocab = draw(sizes(48)), draw(sizes(300))
    bias = draw(st.booleans())
    chunk_rows = draw(st.one_of(st.none(), st.integers(1, max(1, rows + 1))))
    if backend == "triton" and chunk_rows is not None:
        chunk_rows = max(chunk_rows, -(-rows // 3))  # 3 chunks at most: each is interpreted GEMMs
    slices = [None, 37, 128] if backend == "reference" else [None, 128]
    reduction = draw(st.sampled_from(["mean", "sum", "none"]))
    needs = (draw(st.booleans()), draw(st.booleans()), bias and draw(st.booleans()))
    return LceCase(batch=batch, hidden=hidden, vocab=vocab, dtype=draw(st.sampled_from(dtypes_for(backend))),
                   bias=bias, x_layout=draw(layouts(len(batch) + 1)), weight_transposed=draw(st.booleans()),
                   weight_layout=draw(layouts(2)), ignore_index=draw(st.sampled_from([-100, 0, vocab - 1])),
                   ignored=draw(st.sampled_from([0.0, 0.25, 1.0])),
                   label_smoothing=draw(st.sampled_from([0.0, 0.0, 0.2])),
                   softcap=draw(st.sampled_from([None, None, 1.0, 5.0])), z_loss=draw(st.sampled_from([0.0, 1e-3])),
                   reduction=reduction, chunk_rows=chunk_rows, min_slice_classes=draw(st.sampled_from(slices)),
                   needs=needs, seed=draw(seeds()))


def torch_loss(x, weight, target, bias, **options):
    logits = x @ weight.t() if bias is None else x @ weight.t() + bias
    return loss_of_logits(logits, target, **options)


def check_lce(backend, case: LceCase):
    make = Maker(case.seed)
    x = make.tensor(case.batch + (case.hidden,), case.dtype, case.x_layout)
    w_shape = (case.hidden, case.vocab) if case.weight_transposed else (case.vocab, case.hidden)
    weight = make.tensor(w_shape, case.dtype, case.weight_layout, scale=case.hidden ** -0.5)
    weight = weight.t() if case.weight_transposed else weight
    bias = make.tensor((case.vocab,), case.dtype) if case.bias else None
    target = draw_targets(make, case.batch, case.vocab, case.ignore_index, case.ignored, torch.int64)
    options = dict(ignore_index=case.ignore_index, reduction=case.reduction, label_smoothing=case.label_smoothing,
                   softcap=case.softcap, z_loss=case.z_loss)
    inputs = [x, weight, bias]
    needs = [n and t is not None for n, t in zip(case.needs, inputs)]
    mine = [leaf(t, n) for t, n in zip(inputs, needs)]
    same = [leaf(t, n) for t, n in zip(inputs, needs)]
    exact_in = [exact(t, n) for t, n in zip(inputs, needs)]
    what = f"{backend} {case}"
    slices = mock.patch.object(lce, "MIN_SLICE_CLASSES", case.min_slice_classes or lce.MIN_SLICE_CLASSES)
    with kf.use_backend(backend), slices:
        loss = kf.fused_linear_cross_entropy(mine[0], mine[1], target, mine[2], chunk_rows=case.chunk_rows, **options)
    yard = torch_loss(*same[:2], target, same[2], **options)
    oracle = torch_loss(*exact_in[:2], target, exact_in[2], **options)
    assert loss.shape == yard.shape and loss.dtype == yard.dtype, what

    # The logits are a GEMM rounded to x's dtype: each within an ulp of its terms' sum |x_k w_k| + |b|
    # (ours and PyTorch's round independently); a row's loss moves by twice that (lse and z_t); a
    # sum adds the counted rows', a mean averages them. Counted in x's dtype.
    x64, w64 = x.detach().double().reshape(-1, case.hidden), weight.detach().double()
    b64 = bias.detach().double() if bias is not None else torch.zeros(case.vocab, dtype=torch.float64)
    t = target.reshape(-1)
    counted = (t != case.ignore_index).double()
    count = int(counted.sum())
    logit_terms = (x64.abs() @ w64.abs().t() + b64.abs()).amax(-1) if x64.numel() else x64.new_zeros(x64.shape[0])
    rows_counted = {"none": 1, "mean": 1, "sum": max(count, 1)}[case.reduction]
    terms = 2 * (logit_terms.max().item() if logit_terms.numel() else 0.0) * rows_counted
    wide = case.dtype != torch.float64
    assert_matches_oracle(loss.detach(), yard.detach(), oracle.detach(), f"{what} loss", reduced=case.hidden,
                          terms_scale=terms if wide else 0.0, floor_dtype=case.dtype if wide else None)
    if not any(needs) or not torch.is_grad_enabled():
        assert not loss.requires_grad
        return
    g = make.randn(loss.shape, loss.dtype)
    grads_of = [m for m, n in zip(mine, needs) if n]
    with kf.use_backend(backend), slices:
        got = torch.autograd.grad(loss, grads_of, g)
    base = torch.autograd.grad(yard, [s for s, n in zip(same, needs) if n], g)
    want = torch.autograd.grad(oracle, [e for e, n in zip(exact_in, needs) if n], g.double())
    # The logits' gradient dz (float64, from the oracle) enters a GEMM over the vocabulary (x's
    # gradient) or the rows (the weight's; the bias's sums it): their floors are at the sums of the
    # terms' magnitudes. A loss reduced with gradients computed in the forward sums grad_W into W's
    # dtype a row chunk at a time (kernelforge/ops/linear_cross_entropy.py: rounded once a chunk),
    # so its error grows with the number of chunks.
    z64 = (x64 @ w64.t() + b64).requires_grad_()
    (dz,) = torch.autograd.grad(loss_of_logits(z64.view(case.batch + (case.vocab,)), target, **options), z64,
                                g.double())
    dz = dz.abs().nan_to_num(0.0, 0.0, 0.0)
    rows = x64.shape[0]
    chunks = -(-rows // (case.chunk_rows or lce.default_chunk_rows(
        rows, case.vocab, case.hidden, gradients_in_forward=case.reduction != "none" and needs[1]))) if rows else 1
    top = lambda t: t.max().item() if t.numel() else 0.0  # noqa: E731
    grad_terms = {"x": top(dz @ w64.abs()),
                  "weight": top(dz.t() @ x64.abs()) * (chunks if case.reduction != "none" else 1),
                  "bias": top(dz.sum(0))}
    names = [n for n, need in zip(("x", "weight", "bias"), needs) if need]
    for name, a, b, c in zip(names, got, base, want):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what} grad {name}"
        assert_matches_oracle(a, b, c, f"{what} grad {name}", reduced=case.vocab if name == "x" else rows,
                              terms_scale=grad_terms[name])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_cross_entropy_matches_oracle(backend):
    fuzz(backend, lce_cases, check_lce, reference=25, triton=10)


# ----------------------------------------------------------------------------- found by the fuzzing
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_rows_backward_with_reduction_none(backend):
    # a kernelforge bug the fuzzing found, fixed since: no rows walked range(0, 0, 0) in the recomputing backward
    # shrunk from LceCase(batch=(0,), hidden=1, vocab=1, reduction='none', needs=(False, True, False), ...)
    x, weight = torch.randn(0, 4), torch.randn(7, 4, requires_grad=True)
    with kf.use_backend(backend):
        loss = kf.fused_linear_cross_entropy(x, weight, torch.zeros(0, dtype=torch.long), reduction="none")
        (grad,) = torch.autograd.grad(loss.sum(), weight)
    assert torch.equal(grad, torch.zeros_like(weight))
