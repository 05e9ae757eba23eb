"""Where an op's time goes on a GPU, per implementation: the device time of each kernel in
one forward or forward+backward (torch.profiler), the wall time per call, and at latency
shapes the host-side functions that cost most (cProfile).

    python benchmarks/tools/profile_ops.py [OP ...] [--dtype bf16] [--shapes 16384x4096,8192x16384]
        [--host-shape 1x4096] [--impls kernelforge,kernelforge[triton],kernelforge[cuda],torch eager]

OP names a suite of kernelforge.bench.suites (default: every suite). --tiny: softmax (or the OPs
named) at a small float32 shape on the CPU, CPU time per op instead of kernels: checks the
script runs."""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

from kernelforge.bench.runner import DTYPES, prepare_call
from kernelforge.bench.suites import SUITES, kernelforge_implementations
from kernelforge.bench.timing import wall_us_per_call

ITERATIONS = 5
TINY = dict(ops=["softmax"], dtype="fp32", shapes="4x64", host_shape="1x64", impls="kernelforge,torch eager")


def implementations(suite, inputs, wanted):
    found = {**kernelforge_implementations(suite, inputs), **suite.baselines()}
    return {name: fn for name, fn in found.items() if name in wanted}


def kernel_table(call, device: torch.device) -> str:
    """Device time per kernel (one call's worth) and the wall time of one synchronized call; on the
    CPU (--tiny) CPU time per op instead."""
    on_gpu = device.type == "cuda"
    wall_us = wall_us_per_call(call, calls=ITERATIONS, warmup=3, device=device)
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(ITERATIONS):
            call()
        if on_gpu:
            torch.cuda.synchronize()

    def own_us(e):
        return e.self_device_time_total if on_gpu else e.self_cpu_time_total

    events = sorted((e for e in prof.key_averages() if own_us(e) > 0), key=own_us, reverse=True)
    total = sum(own_us(e) for e in events) / ITERATIONS
    lines = [f"    wall {wall_us:8.1f} us/call, {'device' if on_gpu else 'cpu'} {total:8.1f} us/call"]
    lines += [f"    {own_us(e) / ITERATIONS:8.1f} us  x{e.count / ITERATIONS:<4g} {e.key[:90]}" for e in events[:8]]
    return "\n".join(lines)


def host_profile(call, device: torch.device, calls: int = 300) -> str:
    """Wall time per back-to-back call (host-bound at latency shapes) and the top functions."""
    per_call = wall_us_per_call(call, calls=calls, warmup=20, device=device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    if device.type == "cuda":
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    body = [line for line in text.getvalue().splitlines() if line.strip()][4:]
    return "\n".join([f"    {per_call:.1f} us/call back to back"] + ["    " + line for line in body])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ops", nargs="*", help="suites to profile (default: every suite; --tiny: softmax)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--shapes", default="16384x4096,8192x16384")
    parser.add_argument("--host-shape", default="1x4096")
    parser.add_argument("--impls", default="kernelforge,kernelforge[triton],kernelforge[cuda],torch eager")
    parser.add_argument("--tiny", action="store_true", help="a small shape on the CPU: checks the script runs")
    args = parser.parse_args(argv)
    ops = args.ops or (TINY["ops"] if args.tiny else list(SUITES))
    if args.tiny:
        args.dtype, args.shapes, args.host_shape, args.impls = (TINY[k] for k in ("dtype", "shapes", "host_shape",
                                                                                  "impls"))
    device = torch.device("cpu" if args.tiny else "cuda")
    host_calls = 20 if args.tiny else 300
    dtype, wanted = DTYPES[args.dtype], args.impls.split(",")
    parse = lambda text: tuple(int(s) for s in text.split("x"))  # noqa: E731
    for op in ops:
        suite = SUITES[op]
        for shape in [parse(s) for s in args.shapes.split(",") if s]:
            inputs = suite.make_inputs(shape, dtype, device)
            for direction in suite.directions:
                for name, fn in implementations(suite, inputs, wanted).items():
                    print(f"{op} {'x'.join(map(str, shape))} {args.dtype} {direction} {name}")
                    print(kernel_table(prepare_call(fn, inputs, direction), device), flush=True)
        if args.host_shape:
            shape = parse(args.host_shape)
            inputs = suite.make_inputs(shape, dtype, device)
            for direction in suite.directions:
                for name, fn in implementations(suite, inputs, wanted).items():
                    print(f"{op} {args.host_shape} {args.dtype} {direction} {name} (host)")
                    print(host_profile(prepare_call(fn, inputs, direction), device, host_calls), flush=True)


if __name__ == "__main__":
    main()
