"""Shared pieces of the fuzz suite: example budgets, the backends and dtypes each takes on the CPU,
hypothesis strategies for sizes, shapes and memory layouts, and a seeded tensor factory.

Every example is a frozen dataclass of plain values (sizes, a dtype, options, a Layout per operand and
an integer seed); the tensors are made from it with a torch.Generator seeded by that seed (Maker), so
the falsifying example hypothesis prints ("Draw 1 (case): Case(...)") is a complete reproducer, and
pastes into the test file's REGRESSIONS list.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.numerics import same_layout

# ----------------------------------------------------------------------------- budgets
PROFILE = {"name": "short", "factor": 1, "examples": None}


def configure(name: str, factor: int, examples: Optional[int]) -> None:
    """Called by tests/fuzz/conftest.py before the test modules are imported."""
    PROFILE.update(name=name, factor=factor, examples=examples)


def describe_budget() -> str:
    if PROFILE["examples"] is not None:
        return f"{PROFILE['examples']} examples a test"
    return f"{PROFILE['factor']}x each test's short budget"


def budget(examples: int) -> int:
    return PROFILE["examples"] if PROFILE["examples"] is not None else examples * PROFILE["factor"]


def fuzz_settings(examples: int) -> settings:
    """@settings for a fuzz test whose short-profile budget is `examples`."""
    return settings(settings.get_profile("kernelforge-fuzz"), max_examples=budget(examples))


def fuzz(backend: str, cases: Callable, check: Callable, **examples: int) -> None:
    """Runs check(backend, case) over hypothesis examples of cases(backend): examples[backend] of
    them in the short profile (a budget a backend, sized to what one of its examples costs: the
    reference's take milliseconds, the interpreted Triton kernels' up to a second), LONG_FACTOR times
    as many in the long one. On a failure hypothesis shrinks the case and prints it as "Draw 1 (case)"."""

    @fuzz_settings(examples[backend])
    @given(data=st.data())
    def run(data):
        check(backend, data.draw(cases(backend), label="case"))

    run()


# ----------------------------------------------------------------------------- backends, dtypes
TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"

BACKENDS = [
    pytest.param("reference", id="reference"),
    pytest.param("triton", id="triton", marks=pytest.mark.skipif(
        not TRITON_ON_CPU, reason="Triton on the CPU needs TRITON_INTERPRET=1")),
]

REFERENCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# Triton's interpreter truncates float32 -> bfloat16 stores instead of rounding to nearest, and its
# bfloat16 tl.dot is wrong (tests/ops/test_softmax.py, test_gemm.py): bf16 Triton is the GPU suite's.
TRITON_CPU_DTYPES = (torch.float32, torch.float16)


def dtypes_for(backend: str) -> Sequence[torch.dtype]:
    return REFERENCE_DTYPES if backend == "reference" else TRITON_CPU_DTYPES


# ----------------------------------------------------------------------------- sizes, shapes
# 0 and 1, primes, powers of two and their neighbours: tile edges and the sizes around them
INTERESTING_SIZES = (0, 1, 2, 3, 4, 5, 7, 8, 9, 11, 13, 15, 16, 17, 19, 23, 31, 32, 33, 37, 61, 63, 64, 65, 97,
                     127, 128, 129, 199, 255, 256, 257)


def sizes(max_size: int, min_size: int = 1):
    """A dim's size in [min_size, max_size]: mostly an interesting one, else any."""
    special = [s for s in INTERESTING_SIZES if min_size <= s <= max_size]
    plain = st.integers(min_size, max(min_size, max_size))
    return st.one_of(st.sampled_from(special), plain) if special else plain


@st.composite
def shapes(draw, min_rank: int = 1, max_rank: int = 4, max_numel: int = 4096, max_size: int = 300,
           empty: bool = True):
    """A shape of min_rank..max_rank dims, at most max_numel elements (counting the non-empty dims),
    dims of 0 (when `empty`) to max_size."""
    rank = draw(st.integers(min_rank, max_rank))
    dims, room = [], max_numel
    for _ in range(rank):
        d = draw(sizes(max(1, min(max_size, room)), min_size=0 if empty else 1))
        dims.append(d)
        room //= max(d, 1)
    return tuple(dims)


def seeds():
    return st.integers(0, 2 ** 31 - 1)


# ----------------------------------------------------------------------------- layouts
@dataclasses.dataclass(frozen=True)
class Layout:
    """How a tensor of a given shape sits in memory: its dims stored in `order` (outermost first; a
    permutation of the dims: transposed views), every dim sliced with `steps` from `offsets` (a view
    with gaps), and the dims in `expanded` stored once and expanded (stride 0)."""
    order: tuple = ()
    steps: tuple = ()
    offsets: tuple = ()
    expanded: tuple = ()

    @staticmethod
    def dense(rank: int) -> "Layout":
        return Layout(tuple(range(rank)), (1,) * rank, (0,) * rank, ())

    def fits(self, rank: int) -> "Layout":
        """This layout, or a dense one where it was made for another rank (Layout() in a case
        written by hand)."""
        if len(self.order) == len(self.steps) == len(self.offsets) == rank:
            return self
        return Layout.dense(rank)


@st.composite
def layouts(draw, rank: int, expand: bool = False, transpose: bool = True, gaps: bool = True):
    """A Layout for `rank` dims: dense, transposed (any permutation), sliced with a step and an
    offset, and (where the op allows a broadcast input: `expand`) expanded dims, alone or together."""
    order = tuple(range(rank))
    if transpose and rank >= 2 and draw(st.booleans()):
        order = tuple(draw(st.permutations(range(rank))))
    steps, offsets = (1,) * rank, (0,) * rank
    if gaps and rank and draw(st.booleans()):
        steps = tuple(draw(st.lists(st.sampled_from([1, 2, 3]), min_size=rank, max_size=rank)))
        offsets = tuple(draw(st.lists(st.sampled_from([0, 1, 5]), min_size=rank, max_size=rank)))
    expanded = ()
    if expand and rank and draw(st.integers(0, 3)) == 0:
        expanded = tuple(sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1))))
    return Layout(order, steps, offsets, expanded)


# ----------------------------------------------------------------------------- tensors
class Maker:
    """Tensors of an example, all from one seeded generator (so the example's seed reproduces them)."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, shape, dtype=torch.float32, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        t = torch.randn(tuple(shape), generator=self.gen, dtype=torch.float64 if dtype == torch.float64
                        else torch.float32)
        return (t * scale + shift).to(dtype)

    def rand(self, shape, dtype=torch.float32) -> torch.Tensor:
        return torch.rand(tuple(shape), generator=self.gen).to(dtype)

    def randint(self, low: int, high: int, shape, dtype=torch.int64) -> torch.Tensor:
        return torch.randint(low, high, tuple(shape), generator=self.gen).to(dtype)

    def tensor(self, shape, dtype, layout: Optional[Layout] = None, scale: float = 1.0, shift: float = 0.0,
               values: str = "normal", fill: Optional[tuple[float, float]] = None) -> torch.Tensor:
        """A tensor of `shape` and `dtype` laid out as `layout` (a view into a larger buffer when
        the layout has gaps or expanded dims). values: "normal" (scale * N(0, 1) + shift) or
        "integers" (whole numbers in [-3, 3] times scale, plus shift: ties, exact zeros).
        fill (value, fraction): that fraction of the entries, at random, set to value (-inf, NaN)."""
        shape = tuple(shape)
        rank = len(shape)
        layout = (layout or Layout.dense(rank)).fits(rank)
        stored = [1 if d in layout.expanded else shape[d] for d in range(rank)]
        alloc = [stored[d] * layout.steps[d] + layout.offsets[d] for d in range(rank)]
        memory_shape = [alloc[d] for d in layout.order]
        if values == "integers":
            memory = (self.randint(-3, 4, memory_shape, torch.float64) * scale + shift).to(dtype)
        else:
            memory = self.randn(memory_shape, dtype, scale, shift)
        if fill is not None:
            memory = memory.masked_fill(self.rand(memory_shape) < fill[1], fill[0])
        return _view(memory, layout, stored, shape)


def _view(memory: torch.Tensor, layout: Layout, stored, shape) -> torch.Tensor:
    """The view of `memory` (dims in layout.order, each stored[d] * steps[d] + offsets[d] long) that
    is the tensor of `shape`."""
    rank = len(shape)
    if not rank:
        return memory
    t = memory.permute([layout.order.index(d) for d in range(rank)])
    t = t[tuple(slice(layout.offsets[d], layout.offsets[d] + max(stored[d] - 1, 0) * layout.steps[d] + 1
                      if stored[d] else layout.offsets[d], layout.steps[d]) for d in range(rank))]
    return t.expand(shape) if layout.expanded else t


def laid_out(values: torch.Tensor, layout: Optional[Layout]) -> torch.Tensor:
    """values (dense) as a tensor laid out as `layout`: along an expanded dim, the first slice of
    values repeated."""
    rank = values.dim()
    layout = (layout or Layout.dense(rank)).fits(rank)
    first = values[tuple(slice(0, 1) if d in layout.expanded else slice(None) for d in range(rank))]
    alloc = [first.shape[d] * layout.steps[d] + layout.offsets[d] for d in range(rank)]
    memory = torch.zeros([alloc[d] for d in layout.order], dtype=values.dtype)
    t = _view(memory, layout, first.shape, first.shape)
    t.copy_(first)
    return t.expand(values.shape) if layout.expanded else t


def leaf(t: Optional[torch.Tensor], requires_grad: bool = True) -> Optional[torch.Tensor]:
    """A leaf with t's values, dtype, sizes and strides (a gap or a stride 0 kept)."""
    return None if t is None else same_layout(t.detach()).requires_grad_(requires_grad)


def exact(t: Optional[torch.Tensor], requires_grad: bool = True) -> Optional[torch.Tensor]:
    """t in float64, as a leaf: the oracle's input."""
    return None if t is None else t.detach().double().requires_grad_(requires_grad)


def reconcile_special(ours: torch.Tensor, yardstick: torch.Tensor, oracle: torch.Tensor):
    """(yardstick, oracle) for inputs holding NaN or infinities. Where PyTorch at the tested dtype
    gives NaN for an infinite exact result, the NaN comes of the dtype (0 * inf after gelu's tail
    rounds to 0: erf(x / sqrt 2) is -1 in float32 below about -5.5; torch's vectorized float32 /
    bfloat16 CPU gelu gives NaN at +inf, where its float64 and kernelforge give inf): there ours may
    be NaN or the exact infinity. And where only the yardstick is NaN, it counts as exact (else
    PyTorch's error, the bound's yardstick, would be NaN)."""
    dtype_nan = yardstick.isnan() & oracle.isinf() & ours.isnan()
    oracle = oracle.masked_fill(dtype_nan, float("nan"))
    yardstick = torch.where(yardstick.isnan() & ~oracle.isnan(), oracle.to(yardstick.dtype), yardstick)
    return yardstick, oracle


def assert_matches_oracle_with_specials(ours: torch.Tensor, yardstick: torch.Tensor, oracle: torch.Tensor, what: str,
                                        **bound) -> None:
    """tests.numerics.assert_matches_oracle after reconcile_special (inputs with NaN / infinities)."""
    from tests.numerics import assert_matches_oracle

    assert_matches_oracle(ours, *reconcile_special(ours, yardstick, oracle), what, **bound)


def three_gradients(backend: str, mine, theirs, exact_out, grad, mine_in, theirs_in, exact_in):
    """The gradients of kernelforge's output (on `backend`), torch's same-dtype output (the
    yardstick) and the float64 oracle's, for one incoming gradient `grad`."""
    import kernelforge as kf

    with kf.use_backend(backend):
        got = torch.autograd.grad(mine, mine_in, grad)
    base = torch.autograd.grad(theirs, theirs_in, grad)
    want = torch.autograd.grad(exact_out, exact_in, grad.double())
    return got, base, want
