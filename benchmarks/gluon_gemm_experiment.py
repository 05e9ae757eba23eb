"""The warp-specialized Gluon GEMM (kernelforge/triton/gemm_gluon.py) against cuBLAS and the
library's Triton TMA kernel, bf16, at the issue's shapes, both layouts of b, several configs.

    PYTHONPATH=. python3 benchmarks/gluon_gemm_experiment.py [--shapes 4096,4096,4096 ...]

Each line: time (triton.testing.do_bench, median), TFLOP/s, the ratio cuBLAS time / this time
(cuBLAS timed right before and after each shape's runs, their mean), and the max error against
cuBLAS's result relative to its largest magnitude.
"""
from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import kernelforge as kf
from kernelforge.triton import gemm_gluon

CONFIGS = [
    dict(block_m=128, block_n=256, block_k=64, group_m=8, stages=3),
    dict(block_m=128, block_n=256, block_k=64, group_m=4, stages=3),
    dict(block_m=128, block_n=256, block_k=64, group_m=16, stages=3),
    dict(block_m=128, block_n=128, block_k=64, group_m=8, stages=4),
    dict(block_m=128, block_n=128, block_k=64, group_m=8, stages=5),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["4096,4096,4096", "8192,8192,8192", "4096,14336,4096",
                                                    "4096,4096,14336"])
    args = ap.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for spec in args.shapes:
        M, N, K = map(int, spec.split(","))
        flops = 2 * M * N * K
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        for layout, b in (("nt", w.t()), ("nn", w.t().contiguous())):
            want = torch.matmul(a, b)
            scale = want.abs().max().item()
            runs = [("kf.gemm (triton)", lambda: kf.gemm(a, b))]
            runs += [(f"gluon {c['block_m']}x{c['block_n']}x{c['block_k']} g{c['group_m']} {c['stages']}s",
                      lambda c=c: gemm_gluon.gemm(a, b, sms, **c)) for c in CONFIGS]
            before = do_bench(lambda: torch.matmul(a, b), rep=200)
            results = []
            for label, fn in runs:
                try:
                    err = (fn().float() - want.float()).abs().max().item() / scale
                    results.append((label, do_bench(fn, rep=200), err))
                except Exception as e:  # noqa: BLE001 - a config that fails is a result too
                    results.append((label, None, str(e)[:160]))
            after = do_bench(lambda: torch.matmul(a, b), rep=200)
            cublas = (before + after) / 2
            print(f"{M}x{N}x{K} {layout} cublas: {before * 1e3:.1f} / {after * 1e3:.1f} us, "
                  f"{flops / cublas / 1e9:.0f} TFLOP/s", flush=True)
            for label, ms, err in results:
                if ms is None:
                    print(f"  {label}: failed {err}", flush=True)
                else:
                    print(f"  {label}: {ms * 1e3:.1f} us, {flops / ms / 1e9:.0f} TFLOP/s, {cublas / ms:.3f}x "
                          f"(err {err:.2e})", flush=True)


if __name__ == "__main__":
    main()
