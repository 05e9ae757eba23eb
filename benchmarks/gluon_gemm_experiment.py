"""The warp-specialized Gluon GEMM (kernelforge/triton/gemm_gluon.py) against cuBLAS, eager
PyTorch, torch.compile and the library's Triton kernels, at the issue's shapes.

    PYTHONPATH=. python3 benchmarks/gluon_gemm_experiment.py [--mode bf16|epilogue|fp8] [--shapes M,N,K ...]

Modes:
- bf16: the plain product, both layouts of b (a Linear weight read K-major, "nt"; row-major
  b, "nn"), several tile configs, against torch.matmul (cuBLAS);
- epilogue: y = gelu_tanh(x @ W^T + bias), bf16, through kf.gemm (Gluon, and the Triton TMA
  kernel with USE_GLUON False) against eager F.gelu(F.linear(...)) and its torch.compile;
- fp8: e4m3 operands with per-row scales, bf16 out, with the float32 promotion and with fast
  accumulation, several stage counts, against torch._scaled_mm the same two ways; and the
  Triton kernel through kf.gemm.

Times are device time (kernelforge.bench.timing.time_function: an L2 flush before each run and
the GPU held until the call is queued, so host time does not count), median of 100. Each line:
time, TFLOP/s, the baseline's time over this one (eager / cuBLAS: timed right before and
after the shape's runs, their mean), and the max error against the baseline's result
relative to its largest magnitude.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import kernelforge as kf
from kernelforge.bench.timing import time_function
from kernelforge.reference.gemm import fp8_scale, quantize_fp8
from kernelforge.triton import gemm as triton_gemm
from kernelforge.triton import gemm_gluon

BF16_CONFIGS = [
    dict(block_m=128, block_n=256, block_k=64, group_m=8, stages=3),
    dict(block_m=128, block_n=256, block_k=64, group_m=16, stages=3),
    dict(block_m=128, block_n=128, block_k=64, group_m=8, stages=4),
    # the same 144 KB of ring in finer stages: 5 of them prefetched while one is read, not 2
    dict(block_m=128, block_n=256, block_k=32, group_m=8, stages=6),
]
FP8_CONFIGS = [  # (label, fast accumulation, arguments() keywords)
    ("promoted 128x128x128 4 stages", False, dict(stages=4)),
    ("promoted 128x128x128 6 stages", False, dict(stages=6)),
    ("promoted 128x128x128 g16 6 stages", False, dict(stages=6, group_m=16)),
    ("fast 128x256x128 3 stages", True, dict(stages=3)),
    ("fast 128x128x128 6 stages", True, dict(block_n=128, stages=6)),
]
SHAPES = ["4096,4096,4096", "8192,8192,8192", "4096,14336,4096", "4096,4096,14336"]


def device_ms(fn) -> float:
    return time_function(fn, "cuda", warmup=10, repeat=100).median_ms


def report(title: str, flops: int, baseline_label: str, baseline, runs) -> None:
    """Time the baseline before and after `runs` ((label, fn) pairs), then print each."""
    want = baseline()
    scale = want.float().abs().max().item()
    before = device_ms(baseline)
    results = []
    for label, fn in runs:
        try:
            err = (fn().float() - want.float()).abs().max().item() / scale
            results.append((label, device_ms(fn), err))
        except Exception as e:  # noqa: BLE001 - a config that fails is a result too
            results.append((label, None, f"{type(e).__name__}: {str(e)[:200]}"))
    after = device_ms(baseline)
    reference_ms = (before + after) / 2
    print(f"{title} {baseline_label}: {before * 1e3:.1f} / {after * 1e3:.1f} us, "
          f"{flops / reference_ms / 1e9:.0f} TFLOP/s", flush=True)
    for label, ms, err in results:
        if ms is None:
            print(f"  {label}: failed {err}", flush=True)
        else:
            print(f"  {label}: {ms * 1e3:.1f} us, {flops / ms / 1e9:.0f} TFLOP/s, {reference_ms / ms:.3f}x "
                  f"(err {err:.2e})", flush=True)


def with_gluon(use: bool, fn):
    def run():
        previous, triton_gemm.USE_GLUON = triton_gemm.USE_GLUON, use
        try:
            return fn()
        finally:
            triton_gemm.USE_GLUON = previous

    return run


def bf16(M, N, K, sms):
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    for layout, b in (("nt", w.t()), ("nn", w.t().contiguous())):
        runs = [("kf.gemm", lambda: kf.gemm(a, b))]
        runs += [(f"gluon {c['block_m']}x{c['block_n']}x{c['block_k']} g{c['group_m']} {c['stages']}s",
                  lambda c=c: gemm_gluon.gemm(a, b, sms, **c)) for c in BF16_CONFIGS]
        report(f"{M}x{N}x{K} {layout}", 2 * M * N * K, "cuBLAS", lambda: torch.matmul(a, b), runs)


def epilogue(M, N, K, sms):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)

    def eager():
        return F.gelu(F.linear(x, w, bias), approximate="tanh")

    compiled = torch.compile(eager, dynamic=False)
    fused = lambda: kf.gemm(x, w.t(), bias=bias, activation="gelu_tanh")  # noqa: E731
    runs = [("torch.compile", compiled), ("kf.gemm (gluon)", with_gluon(None, fused)),
            ("kf.gemm (triton)", with_gluon(False, fused))]
    report(f"{M}x{N}x{K} bias+gelu_tanh", 2 * M * N * K, "eager", eager, runs)


def row_quantized(a, w):
    """(e4m3 a (M, K), e4m3 w (N, K), scale_a (M, 1), scale_b (1, N)): per-row scales of a and of
    w's rows, the columns of b = w^T, as torch._scaled_mm takes them."""
    sa, sw = fp8_scale(a, "row", -1), fp8_scale(w, "row", -1)
    return quantize_fp8(a, sa), quantize_fp8(w, sw), sa, sw.reshape(1, -1)


def fp8(M, N, K, sms):
    a = torch.randn(M, K, device="cuda")
    w = torch.randn(N, K, device="cuda") / K ** 0.5
    qa, qw, sa, sb = row_quantized(a, w)
    for fast in (False, True):
        mode = "fast accum" if fast else "promoted"
        runs = [(f"kf.gemm triton {mode}", with_gluon(False, lambda fast=fast: kf.gemm(
            qa, qw.t(), scale_a=sa, scale_b=sb, fp8_fast_accum=fast)))]
        runs += [(f"gluon {label}", lambda c=c, f=f: gemm_gluon.gemm(
            qa, qw.t(), sms, out_dtype=torch.bfloat16, scale_a=sa[:, 0], scale_b=sb[0], fast_accum=f, **c))
            for label, f, c in FP8_CONFIGS if f == fast]
        report(f"{M}x{N}x{K} fp8 row {mode}", 2 * M * N * K, "torch._scaled_mm",
               lambda fast=fast: torch._scaled_mm(qa, qw.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                  use_fast_accum=fast), runs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["bf16", "epilogue", "fp8"], default="bf16")
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    args = ap.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for spec in args.shapes:
        M, N, K = map(int, spec.split(","))
        {"bf16": bf16, "epilogue": epilogue, "fp8": fp8}[args.mode](M, N, K, sms)


if __name__ == "__main__":
    main()
