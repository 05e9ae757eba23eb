"""Split-K on the Triton TMA kernel (gemm_tma_kernel's SPLIT_K; at 8a845ed a second kernel
summed the slices, since 97faeaf the last unit of each tile does) at the issue's few-row LLM
shapes, each slice count forced, against the baselines.

    PYTHONPATH=. python3 benchmarks/gemm_split_k_experiment.py [--splits 1 2 4 8] [--shapes M,N,K ...]
        [--deep] [--profile]

Per shape: bf16 x @ W^T against cuBLAS; bias + gelu_tanh against eager linear + gelu (and its
torch.compile); e4m3 with per-row scales, promoted and fast, against torch._scaled_mm. Each
kf.gemm line runs the TMA kernel (USE_TMA True, the Gluon kernel off) at one slice count
("tuned": the autotuner picks the split among _split_choices). Device time, as in
gluon_gemm_experiment.py (whose report() prints the lines). --profile: each kernel's device
time instead (torch.profiler, no L2 flush) and the tile configs the autotuner chose.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import kernelforge as kf
from benchmarks.gluon_gemm_experiment import report, row_quantized
from kernelforge.triton import gemm as triton_gemm

SHAPES = ["16,4096,4096", "16,14336,4096", "16,4096,14336", "128,4096,4096", "128,14336,4096", "128,4096,14336"]


def forced(split, fn):
    """fn run on the TMA kernel at `split` slices (None: the autotuner's pick)."""
    def run():
        saved = triton_gemm.USE_TMA, triton_gemm.USE_GLUON, triton_gemm.SPLIT_K
        triton_gemm.USE_TMA, triton_gemm.USE_GLUON, triton_gemm.SPLIT_K = True, False, split
        try:
            return fn()
        finally:
            triton_gemm.USE_TMA, triton_gemm.USE_GLUON, triton_gemm.SPLIT_K = saved

    return run


def runs_at(splits, fn, prefix="kf.gemm"):
    unforced = (f"{prefix} unforced (the library's kernel and split)", fn)
    return [unforced] + [(f"{prefix} tma split {'tuned' if s is None else s}", forced(s, fn)) for s in splits]


# --deep: candidates with more bytes in flight per SM (a few-row product is latency bound:
# each SM streams its slice of b), added to the TMA kernel's lists before its tuner is built
# (the first run's picks among them, 128x128x64 / 4 warps / 6 stages, 64x128x128 / 4 / 4 and fp8's
# 128x128x128 / 4 / 6, are in the library's lists now)
DEEP_16BIT = [triton_gemm._config(128, 128, 64, 8, 6), triton_gemm._config(64, 256, 64, 4, 6)]
DEEP_FP8 = [triton_gemm._config(64, 128, 256, 4, 4), triton_gemm._config(64, 256, 128, 4, 6)]


def profile(label, fn, calls=20):
    """Each kernel's mean device time over `calls` calls of fn (torch.profiler), and the
    configs the launcher chose."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    parts = ", ".join(f"{e.key[:40]} {e.device_time_total / calls:.1f} us" for e in kernels)
    print(f"  profile {label}: {parts}", flush=True)


def chosen_configs():
    for signature, (config, _, launch_kwargs) in triton_gemm._CHOSEN.items():
        print(f"  chosen {signature[:6]} -> {config} warps {launch_kwargs.get('num_warps')} "
              f"stages {launch_kwargs.get('num_stages')}", flush=True)
    triton_gemm._CHOSEN.clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--splits", nargs="*", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    ap.add_argument("--deep", action="store_true", help="add the DEEP_* candidates to the TMA kernel's lists")
    ap.add_argument("--profile", action="store_true", help="only profile bf16 and fp8 at each split")
    args = ap.parse_args()
    if args.deep:
        triton_gemm.CONFIGS_TMA = triton_gemm.CONFIGS_TMA + DEEP_16BIT
        triton_gemm.CONFIGS_FP8 = triton_gemm.CONFIGS_FP8 + DEEP_FP8
    torch.manual_seed(0)
    splits = [None, *args.splits]
    for spec in args.shapes:
        if args.profile:
            profile_shape(*map(int, spec.split(",")), splits)
            continue
        M, N, K = map(int, spec.split(","))
        flops = 2 * M * N * K
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        print(f"{spec}: the autotuner's split choices {triton_gemm._split_choices(M, N, K, sms)}", flush=True)
        report(f"{M}x{N}x{K} bf16", flops, "cuBLAS", lambda: torch.matmul(x, w.t()),
               runs_at(splits, lambda: kf.gemm(x, w.t())))

        def eager():
            return F.gelu(F.linear(x, w, bias), approximate="tanh")

        report(f"{M}x{N}x{K} bias+gelu_tanh", flops, "eager", eager,
               [("torch.compile", torch.compile(eager, dynamic=False))]
               + runs_at(splits, lambda: kf.gemm(x, w.t(), bias=bias, activation="gelu_tanh")))
        qa, qw, sa, sb = row_quantized(x.float(), w.float())
        for fast in (False, True):
            report(f"{M}x{N}x{K} fp8 row {'fast accum' if fast else 'promoted'}", flops, "torch._scaled_mm",
                   lambda fast=fast: torch._scaled_mm(qa, qw.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                      use_fast_accum=fast),
                   runs_at(splits, lambda fast=fast: kf.gemm(qa, qw.t(), scale_a=sa, scale_b=sb,
                                                            fp8_fast_accum=fast)))


def profile_shape(M, N, K, splits):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    qa, qw = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    sa, sb = torch.ones(M, 1, device="cuda"), torch.ones(1, N, device="cuda")
    profile(f"{M}x{N}x{K} cuBLAS bf16", lambda: torch.matmul(x, w.t()))
    profile(f"{M}x{N}x{K} _scaled_mm", lambda: torch._scaled_mm(qa, qw.t(), scale_a=sa, scale_b=sb,
                                                                out_dtype=torch.bfloat16))
    for split in splits:
        profile(f"{M}x{N}x{K} bf16 split {split}", forced(split, lambda: kf.gemm(x, w.t())))
        profile(f"{M}x{N}x{K} fp8 split {split}", forced(split, lambda: kf.gemm(qa, qw.t(), scale_a=sa, scale_b=sb)))
        chosen_configs()


if __name__ == "__main__":
    main()
