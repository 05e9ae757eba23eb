"""fp8 GEMM: what promoting the accumulator to float32 per K tile costs and buys.

Hopper's fp8 tensor-core instruction accumulates at reduced precision; cuBLAS promotes to
float32 periodically unless torch._scaled_mm(use_fast_accum=True). This times kf.gemm with
fp8_fast_accum off and on next to torch._scaled_mm both ways (triton.testing.do_bench,
median; e4m3 operands, per-row scales, bf16 out), and measures each one's error against the
float64 product of the same e4m3 values (float32 out, so the output's rounding does not
hide the accumulation's).

    python benchmarks/gemm_fp8_accumulation.py
"""
from __future__ import annotations

import torch
import triton.testing

import kernelforge as kf
from kernelforge.reference.gemm import fp8_scale, quantize_fp8

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (4096, 14336, 4096), (4096, 4096, 14336)]


def operands(M, N, K):
    a = torch.randn(M, K, device="cuda")
    w = torch.randn(N, K, device="cuda") / K ** 0.5
    sa, sw = fp8_scale(a, "row", -1), fp8_scale(w, "row", -1)
    return quantize_fp8(a, sa), quantize_fp8(w, sw), sa, sw.reshape(1, N)


def calls(qa, qw, sa, sb, out_dtype):
    def ours(precise):
        return lambda: kf.gemm(qa, qw.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype, fp8_fast_accum=not precise)

    def cublas(fast):
        return lambda: torch._scaled_mm(qa, qw.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast)

    return {"kernelforge precise": ours(True), "kernelforge fast": ours(False),
            "_scaled_mm precise": cublas(False), "_scaled_mm fast": cublas(True)}


def main() -> None:
    print("time (bf16 out, median ms) and TFLOP/s")
    for M, N, K in SHAPES:
        impls = calls(*operands(M, N, K), torch.bfloat16)
        for name, fn in impls.items():
            ms = triton.testing.do_bench(fn, return_mode="median")
            print(f"  {M}x{N}x{K} {name:22s} {ms:.4f} ms {2 * M * N * K / ms / 1e9:7.1f}", flush=True)
    print("max |error| / max |exact| against float64 of the e4m3 values (float32 out)")
    for M, N, K in ((1024, 1024, 8192), (1024, 1024, 1024)):
        qa, qw, sa, sb = operands(M, N, K)
        exact = (qa.double() * sa.double()) @ (qw.double() * sb.double().t()).t()
        for name, fn in calls(qa, qw, sa, sb, torch.float32).items():
            err = (fn().double() - exact).abs().max().item() / exact.abs().max().item()
            print(f"  K={K} {name:22s} {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
