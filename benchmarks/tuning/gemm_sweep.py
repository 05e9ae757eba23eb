"""How far is each of kernelforge's Triton GEMM kernels from cuBLAS, tile config by tile
config (no autotuning), on this GPU?

For each shape (M, N, K), bf16, b a Linear weight (N, K) read transposed ("nt", x @ W^T) or
a row-major (K, N) matrix ("nn"):
- cuBLAS: torch.matmul (with --epilogue also eager linear + gelu(tanh));
- ptr <config>: gemm_kernel (pointers; kernelforge/triton/gemm.py's CONFIGS_16BIT);
- tma <config>: gemm_tma_kernel (TMA descriptors, Hopper; CONFIGS_TMA and EXTRA_TMA).

    python3 benchmarks/tuning/gemm_sweep.py [--shapes 4096,4096,4096 ...] [--epilogue] [--fp8]

--fp8: e4m3 operands with per-row scales, bf16 out, against torch._scaled_mm, each config
with the float32 promotion per K tile ("precise") and without ("fast"), both kernels.

The first run (before gemm_tma_kernel existed) also timed Triton's warp specialization and
an epilogue stored in two halves: neither helped on the H200 (results/nvidia-h200/0.1.0/gemm/sweep/).

--tiny: one small float16 product on the CPU (the interpreter's bfloat16 dot is wrong), one config
of each kernel (Triton through TRITON_INTERPRET=1): checks the script runs.
"""
from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from kernelforge.bench.timing import time_function
from kernelforge.reference.gemm import fp8_scale, quantize_fp8
from kernelforge.triton.gemm import (CONFIGS_16BIT, CONFIGS_FP8, CONFIGS_TMA, _config, _even_k, _tma_block_shapes,
                                     _tma_operands)
from kernelforge.triton.gemm_kernels import gemm_kernel, gemm_tma_kernel

FAST_BF16 = True  # --precise-epilogue: the exp + division activation at bf16 outputs as well
EXTRA_TMA = [_config(128, 256, 64, 8, 3, group=4), _config(128, 256, 64, 8, 3, group=16),
             _config(256, 128, 64, 8, 3), _config(128, 256, 32, 8, 4)]
EXTRA_FP8 = [_config(128, 256, 64, 8, 4), _config(128, 128, 256, 8, 3), _config(256, 128, 128, 8, 3),
             _config(128, 256, 128, 8, 3, group=16)]
# small enough (shared memory: stages x (BLOCK_M + BLOCK_N) x BLOCK_K x 2 bytes + the output
# tile's staging) that two persistent programs may share an SM
TWO_PER_SM = [_config(128, 128, 64, 4, 2), _config(128, 128, 64, 4, 3), _config(128, 128, 64, 8, 2),
              _config(64, 256, 64, 4, 2), _config(128, 128, 32, 4, 4), _config(128, 256, 32, 8, 3)]
COMPUTE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8"}
TINY = False  # --tiny: the CPU, Triton's interpreter, timings by time_function


def _sms(device):
    if device.type != "cuda":  # the interpreter runs one program at a time: a few persistent ones
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def bench_ms(fn) -> float:
    """do_bench's time (100 ms of runs) on the GPU; under --tiny two timed calls on the CPU (a check only)."""
    return time_function(fn, "cpu", warmup=1, repeat=2).median_ms if TINY else do_bench(fn, rep=100)


def _scales(scales, c):
    """(SA, SB, their row / column strides, the SCALED / FP8_PRECISE flags) of fp8 scales, or
    placeholders."""
    if scales is None:
        return c, c, 0, 0, dict(SCALED=False, FP8_PRECISE=False)
    sa, sb, precise = scales
    return sa, sb, sa.stride(0), sb.stride(1), dict(SCALED=True, FP8_PRECISE=precise)


def tma_gemm(a, b, bias, activation, config, scales=None, per_sm=1):
    """gemm_tma_kernel at one config; b is the (K, N) operand (a view, either memory order;
    K-major for fp8); scales: (scale_a (M, 1), scale_b (1, N), precise) for e4m3 operands;
    per_sm: persistent programs an SM (two hide each one's epilogue under the other's K loop,
    if both fit)."""
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, device=a.device, dtype=torch.bfloat16 if scales else a.dtype)
    compute = COMPUTE[a.dtype]
    descriptors, orders = _tma_operands(a[None], b[None], c[None], compute)
    sa, sb, ssam, ssbn, fp8 = _scales(scales, c)
    kw = dict(config.kwargs)
    _tma_block_shapes(dict(zip(("a_desc", "b_desc", "c_desc"), descriptors), **orders, **kw))
    sms = _sms(a.device) * per_sm
    grid = (min(sms, triton.cdiv(M, kw["BLOCK_M"]) * triton.cdiv(N, kw["BLOCK_N"])),)
    # unsplit: the split-K partials and arrival counts are never read (c stands in), SPLIT_CHOICES
    # is 1 << 1
    gemm_tma_kernel[grid](*descriptors, bias if bias is not None else c, c, c, sa, sb, c, c, M, N, K, 0, 0, 0, 0,
                          ssam, ssbn, M * N, triton.next_power_of_2(M), 2, sms, COMPUTE=compute, PRECISION="tf32",
                          **orders, ACTIVATION=activation or "none", HAS_BIAS=bias is not None, HAS_RESIDUAL=False,
                          SAVE_PREACT=False, PRECISE=True, BF16_OUT=FAST_BF16 and c.dtype == torch.bfloat16, **kw,
                          SPLIT_K=1, **fp8, num_warps=config.num_warps, num_stages=config.num_stages)
    return c


_LIB = triton.heuristics({"EVEN_K": _even_k})(gemm_kernel)


def pointer_gemm(a, b, bias, activation, config, scales=None):
    """gemm_kernel at one config; b is the (K, N) operand (a view, any strides; K-major for
    fp8); scales as tma_gemm's."""
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, device=a.device, dtype=torch.bfloat16 if scales else a.dtype)
    sa, sb, ssam, ssbn, fp8 = _scales(scales, c)
    kw = dict(config.kwargs)
    tiles = triton.cdiv(M, kw["BLOCK_M"]) * triton.cdiv(N, kw["BLOCK_N"])
    grid = (min(_sms(a.device), tiles),)
    _LIB[grid](a, b, c, bias if bias is not None else c, c, c, sa, sb, M, N, K, 0, *a.stride(), 0, *b.stride(),
               0, *c.stride(), 0, 0, 0, 0, 0, 0, 0, ssam, 0, ssbn, 1, triton.next_power_of_2(M),
               COMPUTE=COMPUTE.get(a.dtype, "fp32"), PRECISION="tf32",
               ACTIVATION=activation or "none", HAS_BIAS=bias is not None, HAS_RESIDUAL=False, SAVE_PREACT=False,
               PRECISE=True, BF16_OUT=FAST_BF16 and c.dtype == torch.bfloat16, **kw, **fp8,
               num_warps=config.num_warps, num_stages=config.num_stages)
    return c


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["4096,4096,4096", "8192,8192,8192", "4096,14336,4096",
                                                    "128,14336,4096", "16,4096,14336"])
    ap.add_argument("--epilogue", action="store_true", help="also time bias + gelu_tanh fused")
    ap.add_argument("--precise-epilogue", action="store_true", help="no SFU tanh at bf16 outputs")
    ap.add_argument("--configs", choices=("all", "best", "two-per-sm"), default="all",
                    help="best: the 128x256x64 tiles of both kernels only; two-per-sm: TMA tiles small enough "
                         "for two persistent programs an SM, at one and two an SM")
    ap.add_argument("--fp8", action="store_true", help="e4m3 operands against torch._scaled_mm instead")
    ap.add_argument("--tiny", action="store_true", help="a small product on the CPU: checks the script runs")
    args = ap.parse_args(argv)
    global FAST_BF16, TINY
    TINY = args.tiny
    shapes = ["16,64,64"] if args.tiny else args.shapes
    device, dtype = ("cpu", torch.float16) if args.tiny else ("cuda", torch.bfloat16)
    if args.fp8:
        return sweep_fp8(shapes, device)
    FAST_BF16 = not args.precise_epilogue
    torch.manual_seed(0)
    for spec in shapes:
        M, N, K = map(int, spec.split(","))
        flops = 2 * M * N * K
        a = torch.randn(M, K, device=device, dtype=dtype)
        w = torch.randn(N, K, device=device, dtype=dtype) / K ** 0.5
        w_kn = w.t().contiguous()
        bias = torch.randn(N, device=device, dtype=dtype)
        for activation in ((None, "gelu_tanh") if args.epilogue else (None,)):
            b_ = bias if activation else None
            if activation:
                def torch_call():
                    return F.gelu(F.linear(a, w, bias), approximate="tanh")
            else:
                def torch_call():
                    return torch.matmul(a, w.t())
            want = torch_call().float()
            ms = bench_ms(torch_call)
            tag = f"{M}x{N}x{K} {activation or 'plain'}"
            print(f"{tag} cublas{'+eager' if activation else ''}: {ms * 1e3:.1f} us, {flops / ms / 1e9:.0f} TFLOP/s",
                  flush=True)
            for layout, b_view in (("nt", w.t()), ("nn", w_kn)):
                if layout == "nn" and activation:
                    continue
                runs = [("ptr", pointer_gemm, c) for c in CONFIGS_16BIT]
                runs += [("tma", tma_gemm, c) for c in CONFIGS_TMA + EXTRA_TMA]
                if args.configs == "best":
                    runs = [r for r in runs if (r[2].kwargs["BLOCK_M"], r[2].kwargs["BLOCK_N"]) == (128, 256)]
                if args.configs == "two-per-sm":
                    runs = [("tma", tma_gemm, CONFIGS_TMA[0])]
                    runs += [(f"tma{n}/sm", functools.partial(tma_gemm, per_sm=n), c) for c in TWO_PER_SM
                             for n in (1, 2)]
                if args.tiny:  # the first config of each kernel
                    runs = [next(r for r in runs if r[0] == kind) for kind in ("ptr", "tma")]
                for kind, fn, cfg in runs:
                    kw = cfg.kwargs
                    label = (f"{tag} {layout} {kind} {kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} g{kw['GROUP_M']} "
                             f"{cfg.num_warps}w/{cfg.num_stages}s")
                    try:
                        err = (fn(a, b_view, b_, activation, cfg).float() - want).abs().max().item()
                        t = bench_ms(lambda: fn(a, b_view, b_, activation, cfg))
                        print(f"{label}: {t * 1e3:.1f} us, {flops / t / 1e9:.0f} TFLOP/s, {ms / t:.2f}x "
                              f"(err {err:.3g})", flush=True)
                    except Exception as e:  # noqa: BLE001 - a config that does not fit is a result too
                        print(f"{label}: failed {str(e)[:150]}", flush=True)


def sweep_fp8(shapes, device="cuda"):
    torch.manual_seed(0)
    for spec in shapes:
        M, N, K = map(int, spec.split(","))
        flops = 2 * M * N * K
        a = torch.randn(M, K, device=device)
        w = torch.randn(N, K, device=device) / K ** 0.5
        sa, sw = fp8_scale(a, "row", -1), fp8_scale(w, "row", -1)
        qa, qw, sb = quantize_fp8(a, sa), quantize_fp8(w, sw), sw.reshape(1, N)
        times = {}
        for fast in (False, True):
            def cublas(fast=fast):
                return torch._scaled_mm(qa, qw.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)
            want = cublas().float()
            times[fast] = ms = bench_ms(cublas)
            print(f"{M}x{N}x{K} _scaled_mm {'fast' if fast else 'precise'}: {ms * 1e3:.1f} us, "
                  f"{flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        # the launcher's choice: pointers under 65 rows, TMA above
        runs = ([("ptr", pointer_gemm, c) for c in CONFIGS_FP8] if M < 65 else
                [("tma", tma_gemm, c) for c in CONFIGS_FP8 + EXTRA_FP8])
        for (kind, fn, cfg), precise in ((r, p) for r in runs for p in (True, False)):
            kw = cfg.kwargs
            label = (f"{M}x{N}x{K} {kind} {kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} g{kw['GROUP_M']} "
                     f"{cfg.num_warps}w/{cfg.num_stages}s {'precise' if precise else 'fast'}")
            scales = (sa, sb, precise)
            try:
                err = (fn(qa, qw.t(), None, None, cfg, scales).float() - want).abs().max().item()
                t = bench_ms(lambda: fn(qa, qw.t(), None, None, cfg, scales))
                print(f"{label}: {t * 1e3:.1f} us, {flops / t / 1e9:.0f} TFLOP/s, {times[not precise] / t:.2f}x "
                      f"_scaled_mm {'precise' if precise else 'fast'} (diff {err:.3g})", flush=True)
            except Exception as e:  # noqa: BLE001 - a config that does not fit is a result too
                print(f"{label}: failed {str(e)[:150]}", flush=True)


if __name__ == "__main__":
    main()
