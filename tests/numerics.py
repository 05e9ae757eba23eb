"""The accuracy rule of the test suite (DESIGN.md, "Numerics and tests").

A kernel passes when its max error against a float64 oracle is at most twice the error
of PyTorch's own implementation at the same dtype on the same inputs, plus a floor of
one unit in the last place at the output's scale (so exact results, where PyTorch's own
error is 0, still leave room for one rounding).

float64 has no more precise oracle here (PyTorch's float64 error against itself is 0 by
construction), so float64 results must agree with it within 64 ulp at the output's scale:
two float64 evaluations of a reduction over a few thousand terms differ by about that.
"""
from __future__ import annotations

import torch


def ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def max_error(t: torch.Tensor, oracle: torch.Tensor) -> float:
    diff = (t.double() - oracle).abs()
    both_nan = t.isnan() & oracle.isnan()
    same_inf = (t.double() == oracle) & oracle.isinf()
    diff = torch.where(both_nan | same_inf, torch.zeros_like(diff), diff)
    return diff.max().item() if diff.numel() else 0.0


def assert_matches_oracle(ours: torch.Tensor, torch_same_dtype: torch.Tensor, oracle: torch.Tensor, what: str = "") -> None:
    """ours and torch_same_dtype in the tested dtype, oracle in float64 (same shape)."""
    assert ours.shape == oracle.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(oracle.shape)}"
    assert ours.dtype == torch_same_dtype.dtype, f"{what}: dtype {ours.dtype} != {torch_same_dtype.dtype}"
    oracle = oracle.to(ours.device)
    assert torch.equal(ours.isnan(), oracle.isnan()), f"{what}: NaN positions differ from the oracle"
    finite = oracle[oracle.isfinite()]
    scale = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
    err, base = max_error(ours, oracle), max_error(torch_same_dtype, oracle)
    floor = (64 if ours.dtype == torch.float64 else 1) * ulp(ours.dtype) * scale
    bound = 2 * base + floor
    assert err <= bound, (
        f"{what}: max error {err:.3e} exceeds 2 x PyTorch's {base:.3e} + floor "
        f"{floor:.3e} (dtype {ours.dtype})"
    )
