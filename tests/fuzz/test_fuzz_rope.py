"""Fuzzing rope against transformers' apply_rotary_pos_emb written out (float64 oracle): both head
orders (unsqueeze_dim 1 and 2), grouped kv heads, batch and sequence from 0 or 1, full and partial
rotary, odd head dims beyond the rotated ones, angles per batch (B, S, rot), shared (1, S, rot) or
(S, rot), or tables indexed by int32 / int64 position_ids ((S,), (1, S) or (B, S), repeats
included), real angles or arbitrary cos / sin (in q's dtype or float32), transposed / gapped /
expanded q, k, cos and sin; the outputs and the gradients of q, k, cos and sin (tests/numerics.py)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch
from hypothesis import strategies as st

import kernelforge as kf
from tests.fuzz.strategies import (
    BACKENDS, Layout, Maker, dtypes_for, exact, fuzz, laid_out, layouts, leaf, seeds, sizes)
from tests.numerics import assert_matches_oracle
from tests.ops.test_rope import transformers_rope

pytestmark = pytest.mark.fuzz


@dataclasses.dataclass(frozen=True)
class Case:
    B: int
    H: int
    Hkv: int
    S: int
    D: int
    rot: int
    unsqueeze_dim: int
    angles: str  # "batch" (B, S, rot), "shared" (1, S, rot), "seq" (S, rot), "table1" / "table1S" / "tableBS"
    table: int  # positions in a table
    random_angles: bool  # arbitrary cos / sin values (each half as given) instead of real angles
    dtype: torch.dtype
    angle_dtype: Optional[torch.dtype]  # None: q's
    position_dtype: torch.dtype
    angle_grads: bool
    q_layout: Layout
    k_layout: Layout
    angle_layout: Layout
    seed: int


@st.composite
def cases(draw, backend):
    Hkv = draw(st.integers(1, 3))
    H = Hkv * draw(st.sampled_from([1, 1, 2, 3]))
    B, S = draw(sizes(3, min_size=0)), draw(sizes(17, min_size=0))
    D = draw(sizes(32, min_size=2))
    rot = draw(st.integers(1, D // 2)) * 2
    angles = draw(st.sampled_from(["batch", "shared", "seq", "table1", "table1S", "tableBS"]))
    dtype = draw(st.sampled_from(dtypes_for(backend)))
    angle_dtype = draw(st.sampled_from([None, None, torch.float32]))
    rank = 2 if angles in ("seq",) or angles.startswith("table") else 3
    return Case(B=B, H=H, Hkv=Hkv, S=S, D=D, rot=rot, unsqueeze_dim=draw(st.sampled_from([1, 2])), angles=angles,
                table=draw(st.integers(1, 40)), random_angles=draw(st.booleans()), dtype=dtype,
                angle_dtype=None if angle_dtype == dtype else angle_dtype,
                position_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
                angle_grads=draw(st.booleans()), q_layout=draw(layouts(4, expand=True)),
                k_layout=draw(layouts(4, expand=True)), angle_layout=draw(layouts(rank, expand=True)),
                seed=draw(seeds()))


def check(backend, case: Case):
    make = Maker(case.seed)
    heads_first = case.unsqueeze_dim == 1
    shape = (lambda h: (case.B, h, case.S, case.D)) if heads_first else (lambda h: (case.B, case.S, h, case.D))
    q = make.tensor(shape(case.H), case.dtype, case.q_layout)
    k = make.tensor(shape(case.Hkv), case.dtype, case.k_layout)
    angle_dtype = case.angle_dtype or case.dtype
    tabled = case.angles.startswith("table")
    rows = case.table if tabled else case.S
    angle_shape = {"batch": (case.B, rows, case.rot), "shared": (1, rows, case.rot)}.get(case.angles, (rows, case.rot))
    if case.random_angles:
        cos = make.tensor(angle_shape, angle_dtype, case.angle_layout)
        sin = make.tensor(angle_shape, angle_dtype, case.angle_layout)
    else:  # transformers' default angles (both halves the same), at offset positions, laid out as asked
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, case.rot, 2, dtype=torch.float64) / case.rot)
        positions = torch.arange(rows, dtype=torch.float64) + make.randint(0, 50, ()).item()
        emb = (positions[:, None] * inv_freq[None, :]).repeat(1, 2).expand(angle_shape)
        cos = laid_out(emb.cos().to(angle_dtype), case.angle_layout)
        sin = laid_out(emb.sin().to(angle_dtype), case.angle_layout)
    position_ids = None
    if tabled:
        pshape = {"table1": (case.S,), "table1S": (1, case.S), "tableBS": (case.B, case.S)}[case.angles]
        position_ids = make.randint(0, case.table, pshape, case.position_dtype)
    cos_t, sin_t = (cos, sin) if position_ids is None else (cos[position_ids.long()], sin[position_ids.long()])
    if cos_t.dim() == 2:  # (S, rot): transformers' form is (1, S, rot)
        cos_t, sin_t = cos_t.unsqueeze(0), sin_t.unsqueeze(0)

    mine = [leaf(t) for t in (q, k)] + [leaf(t, case.angle_grads) for t in (cos, sin)]
    same = [leaf(t) for t in (q, k)] + [leaf(t, case.angle_grads) for t in (cos, sin)]
    exact_in = [exact(t) for t in (q, k)] + [exact(t, case.angle_grads) for t in (cos, sin)]

    def gathered(c, s):
        if position_ids is not None:
            c, s = c[position_ids.long()], s[position_ids.long()]
        return (c.unsqueeze(0), s.unsqueeze(0)) if c.dim() == 2 else (c, s)

    what = f"{backend} {case}"
    with kf.use_backend(backend):
        outs = kf.rope(*mine, position_ids=position_ids, unsqueeze_dim=case.unsqueeze_dim)
    # PyTorch's own math in the inputs' dtypes (a float32 cos promotes q's product), rounded to q's
    yard = [o.to(case.dtype) for o in transformers_rope(*same[:2], *gathered(*same[2:]), case.unsqueeze_dim)]
    oracle = transformers_rope(*exact_in[:2], *gathered(*exact_in[2:]), case.unsqueeze_dim)
    for name, out, x, y, z in zip("qk", outs, (q, k), yard, oracle):
        assert out.shape == x.shape and out.dtype == x.dtype, f"{what} {name}"
        assert_matches_oracle(out.detach(), y.detach(), z.detach(), f"{what} {name}", reduced=2)
    if q.numel() == 0:
        return
    grads = [make.randn(o.shape, o.dtype) for o in outs]
    leaves = [i for i, t in enumerate(mine) if t.requires_grad]
    with kf.use_backend(backend):
        got = torch.autograd.grad(outs, [mine[i] for i in leaves], grads)
    want = torch.autograd.grad(oracle, [exact_in[i] for i in leaves], [g.double() for g in grads])
    base = torch.autograd.grad(yard, [same[i] for i in leaves], grads)
    # cos's and sin's gradients sum g * x (g * rotate_half(x)) over heads, the batch (shared angles)
    # and the tokens reading a table row: their floors are at those sums of |g x|, the same
    # gradients of |q|, |k| against |g|
    sums = [0.0, 0.0, 0.0, 0.0]
    if case.angle_grads:
        angles64 = [exact(t) for t in (cos, sin)]
        magnitudes = transformers_rope(q.double().abs(), k.double().abs(), *gathered(*angles64), case.unsqueeze_dim)
        sums[2:] = [t.abs().max().item() if t.numel() else 0.0 for t in torch.autograd.grad(
            magnitudes, angles64, [g.double().abs() for g in grads])]
    for i, a, b, c in zip(leaves, got, base, want):
        name = "q k cos sin".split()[i]
        assert a.shape == (q, k, cos, sin)[i].shape and a.dtype == (q, k, cos, sin)[i].dtype, f"{what} grad {name}"
        assert_matches_oracle(a, b.to(a.dtype), c, f"{what} grad {name}", reduced=2 if i < 2 else case.B * case.S *
                              (case.H + case.Hkv), terms_scale=sums[i])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_matches_transformers(backend):
    fuzz(backend, cases, check, reference=60, triton=8)


# ----------------------------------------------------------------------------- found by the fuzzing
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens_with_position_ids(backend):
    # a kernelforge bug the fuzzing found, fixed since: position_ids of no tokens: view(-1, 0)
    # shrunk from Case(B=1, H=1, Hkv=1, S=0, D=2, rot=2, angles='table1', ...): position_ids (0,), (1, 0), (B, 0)
    q, k, table = torch.randn(2, 4, 0, 8), torch.randn(2, 2, 0, 8), torch.randn(10, 8)
    with kf.use_backend(backend):
        qo, ko = kf.rope(q, k, table, table, position_ids=torch.zeros(0, dtype=torch.long))
    assert qo.shape == q.shape and ko.shape == k.shape
