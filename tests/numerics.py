"""The accuracy rule of the test suite (the float64 oracle, 2x PyTorch's own error plus a floor).

A kernel passes when its max error against a float64 oracle is at most twice the error
of PyTorch's own implementation at the same dtype on the same inputs, plus a floor of a
few units in the last place at the output's scale:
- float16 / bfloat16: 1 ulp. One rounding of the output dominates every error there.
- float32: 4 ulp. The arithmetic dominates (an exp of ~1-2 ulp, a row sum, a division),
  so PyTorch's own error ranges from under 1 ulp to a few ulp with the inputs, and twice
  a lucky-small one is a coin flip (seen on an H100: 2.3e-7 against a bound of 2.2e-7 for
  the plain-PyTorch reference itself). Still ~20x tighter than a 1e-5 relative bound.
- float64: max(64, 4 sqrt(n)) ulp, n the number of terms reduced into each output. There
  is no more precise oracle here: PyTorch's float64 error against itself is 0 by
  construction, so the bound must hold the gap between two correct float64 computations
  that sum in different orders. That gap is a random walk of n roundings and grows like
  sqrt(n): for the log-softmax gradient (dx = dy - exp(y) * sum(dy)) the worst of 80
  rows was 8 ulp at n=1000, 38 at 4097, 99 at 65537 and 354 at 262147 (about
  0.7 sqrt(n)); a flat 64 ulp failed CI at n=65537.
- float32 summed in an order that varies from run to run (float32 atomics, `unordered=True`):
  max(4, 4 sqrt(n)) ulp, for float64's reason. PyTorch's own error is then one draw of a random
  walk of n roundings, and so is ours: twice one draw plus 4 ulp failed 2 of 60 random-order
  trials of a 200-term sum (simulated on a CPU with shuffled index_add_ orders).
  float16 / bfloat16 keep their 1 ulp: the kernels sum in float32 and round once, and that
  rounding dominates.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

FLOOR_ULPS = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 4, torch.float64: 64}


def ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def floor_ulps(dtype: torch.dtype, reduced: int, unordered: bool = False) -> float:
    if dtype == torch.float64 or (unordered and dtype == torch.float32):
        return max(FLOOR_ULPS[dtype], 4 * math.sqrt(reduced))
    return FLOOR_ULPS[dtype]


def max_error(t: torch.Tensor, oracle: torch.Tensor) -> float:
    diff = (t.double() - oracle).abs()
    both_nan = t.isnan() & oracle.isnan()
    same_inf = (t.double() == oracle) & oracle.isinf()
    diff = torch.where(both_nan | same_inf, torch.zeros_like(diff), diff)
    return diff.max().item() if diff.numel() else 0.0


def assert_matches_oracle(
    ours: torch.Tensor, torch_same_dtype: torch.Tensor, oracle: torch.Tensor, what: str = "", reduced: int = 1,
    terms_scale: float = 0.0, floor_dtype: Optional[torch.dtype] = None, unordered: bool = False,
) -> None:
    """ours and torch_same_dtype in the tested dtype, oracle in float64 (same shape);
    reduced: how many terms each output sums over (the row length for a row op);
    terms_scale: the largest term that cancels into an output, when it can exceed the
    output (a norm's gradient is rstd * (g - ...): its rounding errors scale with rstd * |g|
    however small the difference), so the floor is taken at that scale;
    floor_dtype: the precision the floor is counted in when the computation rounds to a
    narrower type than ours' dtype (a GEMM at bf16 precision on float32 tensors);
    unordered: ours sums its `reduced` terms in a run-dependent order (float32 atomics)."""
    assert ours.shape == oracle.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(oracle.shape)}"
    assert ours.dtype == torch_same_dtype.dtype, f"{what}: dtype {ours.dtype} != {torch_same_dtype.dtype}"
    oracle = oracle.to(ours.device)
    assert torch.equal(ours.isnan(), oracle.isnan()), f"{what}: NaN positions differ from the oracle"
    finite = oracle[oracle.isfinite()]
    scale = max(1.0, terms_scale, finite.abs().max().item() if finite.numel() else 0.0)
    err, base = max_error(ours, oracle), max_error(torch_same_dtype, oracle)
    floor_dtype = floor_dtype or ours.dtype
    floor = floor_ulps(floor_dtype, reduced, unordered) * ulp(floor_dtype) * scale
    bound = 2 * base + floor
    assert err <= bound, (
        f"{what}: max error {err:.3e} exceeds 2 x PyTorch's {base:.3e} + floor "
        f"{floor:.3e} (dtype {ours.dtype})"
    )


def assert_compiled_matches_eager(eager, compiled, inputs, relative_floor: float = 0.0) -> None:
    """A scalar-valued function and its torch.compile agree in value and in the gradients of
    every input (to assert_close's default tolerance for the dtype; relative_floor widens the
    absolute tolerance of each tensor to that fraction of its largest magnitude, for sums whose
    cancelling terms Inductor adds in its own order)."""
    expected = eager(*inputs)
    grads = torch.autograd.grad(expected, inputs)
    got = compiled(*inputs)
    got_grads = torch.autograd.grad(got, inputs)
    for a, e in zip((got, *got_grads), (expected, *grads)):
        floor = relative_floor * e.abs().max().item() if e.numel() else 0.0
        defaults = torch.testing._comparison.default_tolerances(e)
        torch.testing.assert_close(a, e, rtol=defaults[0], atol=max(defaults[1], floor))


def same_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy of t with t's sizes and strides (clone() makes a strided or expanded view dense:
    the kernels would never see the layout a test builds)."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)
    flat = torch.zeros(span if t.numel() else 0, dtype=t.dtype, device=t.device)
    distinct = tuple(slice(0, 1) if stride == 0 else slice(None) for stride in t.stride())
    flat.as_strided(t[distinct].shape, t.stride()).copy_(t[distinct])
    return flat.as_strided(t.shape, t.stride())
