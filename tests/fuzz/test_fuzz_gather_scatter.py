"""Fuzzing gather_scatter: x (N, ...) with 0-2 trailing dims, N, num_nodes, edges and features from
0, int32 / int64 ids (src and dst each, gapped views of an (E, 2) tensor included), hubs, self loops,
duplicate edges and nodes no edge reaches, transposed / gapped / expanded x, NaN and +-inf entries in
x (the op agrees with torch there), sum and mean; the output
and x's gradient against the float64 oracle (tests/numerics.py; the Triton kernel's float32 atomics
sum in a run-dependent order: `unordered`)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch
from hypothesis import strategies as st

import kernelforge as kf
from tests.fuzz.strategies import (
    BACKENDS, Layout, Maker, dtypes_for, exact, fuzz, layouts, leaf, seeds, shapes, sizes)
from tests.numerics import assert_matches_oracle

pytestmark = pytest.mark.fuzz


@dataclasses.dataclass(frozen=True)
class Case:
    rows: int  # x's
    trailing: tuple  # x's feature dims
    num_nodes: int
    edges: int
    hub: float  # the fraction of edges into one node
    src_dtype: torch.dtype
    dst_dtype: torch.dtype
    paired: bool  # src and dst as the columns of one (E, 2) tensor (stride 2)
    reduce: str
    dtype: torch.dtype
    layout: Layout
    special: Optional[float]  # NaN or +-inf at some entries of x (the op agrees with torch there)
    seed: int


@st.composite
def cases(draw, backend):
    trailing = draw(shapes(min_rank=0, max_rank=2, max_numel=64, max_size=64))
    rows, num_nodes = draw(sizes(64, min_size=0)), draw(sizes(64, min_size=0))
    edges = draw(sizes(200, min_size=0)) if rows and num_nodes else 0
    index_dtype = st.sampled_from([torch.int64, torch.int32])
    return Case(rows=rows, trailing=trailing, num_nodes=num_nodes, edges=edges,
                hub=draw(st.sampled_from([0.0, 0.0, 0.5])), src_dtype=draw(index_dtype), dst_dtype=draw(index_dtype),
                paired=draw(st.booleans()), reduce=draw(st.sampled_from(["sum", "mean"])),
                dtype=draw(st.sampled_from(dtypes_for(backend))), layout=draw(layouts(1 + len(trailing), expand=True)),
                special=draw(st.sampled_from([None] * 5 + [float("nan"), float("inf"), float("-inf")])),
                seed=draw(seeds()))


def degrees(idx, n):
    return torch.bincount(idx.long(), minlength=n)


def oracle(x64, src, dst, num_nodes, reduce):
    out = torch.zeros((num_nodes,) + tuple(x64.shape[1:]), dtype=torch.float64)
    out = out.index_add(0, dst.long(), x64.index_select(0, src.long()))
    if reduce == "mean":
        deg = degrees(dst, num_nodes).clamp(min=1).to(torch.float64)
        out = out / deg.view((num_nodes,) + (1,) * (x64.dim() - 1))
    return out


def torch_same_dtype(x, src, dst, num_nodes, reduce):
    """What a user writes in torch at x's dtype (index_add_ sums in that dtype): the yardstick."""
    out = x.new_zeros((num_nodes,) + tuple(x.shape[1:])).index_add(0, dst.long(), x.index_select(0, src.long()))
    if reduce == "mean":
        deg = degrees(dst, num_nodes).clamp(min=1).to(x.dtype)
        out = out / deg.view((num_nodes,) + (1,) * (x.dim() - 1))
    return out


def check(backend, case: Case):
    make = Maker(case.seed)
    x = make.tensor((case.rows,) + case.trailing, case.dtype, case.layout,
                    fill=None if case.special is None else (case.special, 0.05))
    src = make.randint(0, max(case.rows, 1), (case.edges,))
    dst = make.randint(0, max(case.num_nodes, 1), (case.edges,))
    if case.edges:
        dst = torch.where(make.rand((case.edges,)) < case.hub, dst[:1].expand(case.edges), dst)
        loops = torch.arange(min(case.rows, case.num_nodes, 3))
        src, dst = torch.cat([src, loops, src[:4]]), torch.cat([dst, loops, dst[:4]])  # self loops, duplicates
    if case.paired:
        pairs = torch.stack([src.to(case.src_dtype), dst.to(case.src_dtype)], dim=1)
        src, dst = pairs[:, 0], pairs[:, 1].to(case.dst_dtype) if case.dst_dtype != case.src_dtype else pairs[:, 1]
    else:
        src, dst = src.to(case.src_dtype), dst.to(case.dst_dtype)
    out_shape = (case.num_nodes,) + case.trailing
    ours, theirs, x64 = leaf(x), leaf(x), exact(x)
    g = make.randn(out_shape, case.dtype)
    what = f"{backend} {case}"
    with kf.use_backend(backend):
        y = kf.gather_scatter(ours, src, dst, case.num_nodes, case.reduce)
        (gx,) = torch.autograd.grad(y, ours, g)
    y_torch = torch_same_dtype(theirs, src, dst, case.num_nodes, case.reduce)
    y64 = oracle(x64, src, dst, case.num_nodes, case.reduce)
    assert y.shape == out_shape and y.dtype == x.dtype and y.is_contiguous(), what
    max_in = int(degrees(dst, case.num_nodes).max()) if src.numel() else 1
    max_out = int(degrees(src, case.rows).max()) if src.numel() else 1
    unordered = backend == "triton"  # float32 atomics: a run-dependent order (tests/numerics.py)
    assert_matches_oracle(y.detach(), y_torch.detach(), y64.detach(), f"{what} out", reduced=max_in,
                          unordered=unordered)
    if y.numel() == 0 and x.numel() == 0:
        return
    (gx_torch,) = torch.autograd.grad(y_torch, theirs, g) if y_torch.requires_grad else (torch.zeros_like(x),)
    (gx64,) = torch.autograd.grad(y64, x64, g.double()) if y64.requires_grad else (torch.zeros_like(x64),)
    assert gx.shape == x.shape and gx.dtype == x.dtype
    assert_matches_oracle(gx, gx_torch, gx64, f"{what} grad", reduced=max_out, unordered=unordered)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_scatter_matches_oracle(backend):
    fuzz(backend, cases, check, reference=100, triton=80)
