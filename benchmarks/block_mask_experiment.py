"""Experiment: block-sparse attention at two BlockMask tile sizes against FlexAttention.

For each pattern (a causal sliding window of 512, Longformer-style local + global, a dilated
causal window; S = 8192, 2 x 16 heads, d128, bf16): kernelforge with its BlockMask built on
128 x 128 and on 64 x 64 tiles (the Gluon forward's tile: finer mask tiles skip the empty
halves of the coarse ones), the dense band path where the pattern is a band, and Flex with
its default 128 x 128 BlockMask and with 64 x 64 (BLOCK_SIZE=64), forward and forward +
backward, timed by triton.testing.do_bench.

    python3 benchmarks/block_mask_experiment.py [--s 8192]
"""
from __future__ import annotations

import argparse

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from triton.testing import do_bench

import kernelforge as kf
from kernelforge.bench.attention_suites import BLOCK_PATTERNS


def _window(b, h, q_idx, kv_idx):
    d = q_idx - kv_idx
    return (d >= 0) & (d <= 512)


PATTERNS = {"window": _window, **BLOCK_PATTERNS}


def time_both(fn, q, k, v, g):
    fwd = do_bench(lambda: fn(q, k, v), rep=200)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def step():
        torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), g)

    return fwd, do_bench(step, rep=200)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--s", type=int, default=8192)
    S = ap.parse_args().s
    B, H, D = 16384 // S, 16, 128
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    g = torch.randn_like(q)
    flex = torch.compile(flex_attention, dynamic=False)
    for name, fn in PATTERNS.items():
        rows = {}
        ref = None
        for tile in (128, 64):
            bm = kf.BlockMask.from_mask_function(fn, S, S, block_q=tile, block_k=tile, device="cuda")
            rows[f"kernelforge {tile}x{tile}"] = lambda q, k, v, bm=bm: kf.flash_attention(q, k, v, block_mask=bm)
            if ref is None:
                ref = kf.flash_attention(q, k, v, block_mask=bm)
            print(f"{name}: {bm}", flush=True)
        if name == "window":
            rows["kernelforge band"] = lambda q, k, v: kf.flash_attention(q, k, v, causal=True, window=(512, None))
        for tile in (128, 64):
            try:
                fbm = create_block_mask(fn, None, None, S, S, device="cuda", BLOCK_SIZE=tile)
                rows[f"flex {tile}x{tile}"] = lambda q, k, v, fbm=fbm: flex(q, k, v, block_mask=fbm)
            except Exception as err:  # noqa: BLE001 - an experiment reports and goes on
                print(f"{name}: flex {tile} mask failed: {str(err)[:200]}", flush=True)
        times = {}
        for label, run in rows.items():
            try:
                diff = (run(q, k, v).float() - ref.float()).abs().max().item()
                times[label] = time_both(run, q, k, v, g)
            except Exception as err:  # noqa: BLE001
                print(f"{name}: {label} failed: {str(err)[:300]}", flush=True)
                continue
            print(f"{name}: {label:18s} fwd {times[label][0] * 1e3:7.1f} us  fwd+bwd {times[label][1] * 1e3:7.1f} us"
                  f"  (max diff from kernelforge 128x128: {diff:.3g})", flush=True)
        flex_best = [min(t[i] for lbl, t in times.items() if lbl.startswith("flex")) for i in (0, 1)]
        for label, (fwd, both) in times.items():
            if label.startswith("kernelforge"):
                print(f"{name}: {label} against the best Flex: fwd {flex_best[0] / fwd:.2f}x, fwd+bwd "
                      f"{flex_best[1] / both:.2f}x", flush=True)


if __name__ == "__main__":
    main()
