"""How close the Triton attention's float32 errors sit to the test suite's bound, over many seeds.

tests/ops/test_attention.py::check asserts, for out, dQ, dK and dV, max error <= 2 x PyTorch's
error at the same dtype + a floor (tests/numerics.py). One run draws one seed; this script draws
--seeds of them for each case and prints, per tensor, the ratio error / bound (a ratio > 1 is a
failure) and PyTorch's own error, so a marginal bound shows up as a distribution, not as a
coin flip in CI. It also times forward + backward of each case (float32 is the slow path).

    PYTHONPATH=. python3 benchmarks/attention_error_seeds.py [--seeds 24] [--case 0 --case 2]
"""
from __future__ import annotations

import argparse
import statistics

import torch

import kernelforge as kf
import tests.ops.test_attention as attention_tests
from tests import numerics

# (B, H, Hkv, Sq, Sk, D, Dv, causal, window, mask): the GPU case that missed the bound at bd29c39
# (dV at ~1.1x in two runs), its no-mask twin, and one without grouped heads
CASES = [
    (2, 8, 2, 1000, 1000, 128, None, False, None, "bool"),
    (2, 8, 2, 1000, 1000, 128, None, False, None, None),
    (2, 8, 8, 1000, 1000, 128, None, False, None, "bool"),
]


def record_ratios(into: dict):
    """A stand-in for assert_matches_oracle that records (error / bound, PyTorch's error) by
    tensor name instead of asserting."""
    def record(ours, torch_same_dtype, oracle, what="", reduced=1, terms_scale=0.0, floor_dtype=None):
        oracle = oracle.to(ours.device)
        finite = oracle[oracle.isfinite()]
        scale = max(1.0, terms_scale, finite.abs().max().item() if finite.numel() else 0.0)
        err, base = numerics.max_error(ours, oracle), numerics.max_error(torch_same_dtype, oracle)
        dtype = floor_dtype or ours.dtype
        bound = 2 * base + numerics.floor_ulps(dtype, reduced) * numerics.ulp(dtype) * scale
        into.setdefault(what.split()[-1], []).append((err / bound, err, base))
    return record


def time_fwd_bwd(case, dtype, reps=10) -> float:
    B, H, Hkv, Sq, Sk, D, Dv, causal, window, mask = case
    q = torch.randn(B, H, Sq, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, Sk, Dv or D, device="cuda", dtype=dtype, requires_grad=True)
    attn_mask = attention_tests.make_mask(mask, B, H, Sq, Sk, "cuda")

    def step():
        with kf.use_backend("triton"):
            out = kf.flash_attention(q, k, v, causal=causal, window=window, attn_mask=attn_mask)
        out.backward(torch.ones_like(out))

    step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=24)
    parser.add_argument("--case", type=int, action="append", help="an index into CASES (default: all)")
    args = parser.parse_args()
    for case in [CASES[i] for i in args.case] if args.case else CASES:
        ratios: dict = {}
        attention_tests.assert_matches_oracle = record_ratios(ratios)
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            attention_tests.check("triton", "cuda", torch.float32, *case)
        print(f"case {case}: fwd+bwd {time_fwd_bwd(case, torch.float32):.2f} ms (float32)")
        for name, rows in ratios.items():
            r = sorted(x[0] for x in rows)
            fails = sum(x > 1 for x in r)
            print(f"  {name:4s} error/bound median {statistics.median(r):.2f} max {r[-1]:.2f} "
                  f"failures {fails}/{len(r)}; error median {statistics.median(x[1] for x in rows):.2e}, "
                  f"PyTorch's {statistics.median(x[2] for x in rows):.2e}")


if __name__ == "__main__":
    main()
