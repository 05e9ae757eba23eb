"""Where an op's time goes on a GPU, per implementation: the device time of each kernel in
one forward or forward+backward (torch.profiler), the wall time per call, and at latency
shapes the host-side functions that cost most (cProfile).

    python benchmarks/profile_ops.py [OP ...] [--dtype bf16] [--shapes 16384x4096,8192x16384]
        [--host-shape 1x4096] [--impls kernelforge,kernelforge[triton],kernelforge[cuda],torch eager]

OP names a suite of kernelforge.bench.suites (default: every suite)."""
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


def implementations(suite, inputs, wanted):
    found = {**kernelforge_implementations(suite, inputs), **suite.baselines()}
    return {name: fn for name, fn in found.items() if name in wanted}


def kernel_table(call) -> str:
    """Device time per kernel (one call's worth) and the wall time of one synchronized call."""
    wall_us = wall_us_per_call(call, calls=ITERATIONS, warmup=3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERATIONS):
            call()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                    key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) / ITERATIONS
    lines = [f"    wall {wall_us:8.1f} us/call, device {total:8.1f} us/call"]
    lines += [f"    {e.self_device_time_total / ITERATIONS:8.1f} us  x{e.count / ITERATIONS:<4g} {e.key[:90]}"
              for e in events[:8]]
    return "\n".join(lines)


def host_profile(call, calls: int = 300) -> str:
    """Wall time per back-to-back call (host-bound at latency shapes) and the top functions."""
    per_call = wall_us_per_call(call, calls=calls, warmup=20)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    body = [line for line in text.getvalue().splitlines() if line.strip()][4:]
    return "\n".join([f"    {per_call:.1f} us/call back to back"] + ["    " + line for line in body])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ops", nargs="*", default=list(SUITES))
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--shapes", default="16384x4096,8192x16384")
    parser.add_argument("--host-shape", default="1x4096")
    parser.add_argument("--impls", default="kernelforge,kernelforge[triton],kernelforge[cuda],torch eager")
    args = parser.parse_args()
    dtype, wanted = DTYPES[args.dtype], args.impls.split(",")
    parse = lambda text: tuple(int(s) for s in text.split("x"))  # noqa: E731
    for op in args.ops:
        suite = SUITES[op]
        for shape in [parse(s) for s in args.shapes.split(",") if s]:
            inputs = suite.make_inputs(shape, dtype, torch.device("cuda"))
            for direction in suite.directions:
                for name, fn in implementations(suite, inputs, wanted).items():
                    print(f"{op} {'x'.join(map(str, shape))} {args.dtype} {direction} {name}")
                    print(kernel_table(prepare_call(fn, inputs, direction)), flush=True)
        if args.host_shape:
            shape = parse(args.host_shape)
            inputs = suite.make_inputs(shape, dtype, torch.device("cuda"))
            for direction in suite.directions:
                for name, fn in implementations(suite, inputs, wanted).items():
                    print(f"{op} {args.host_shape} {args.dtype} {direction} {name} (host)")
                    print(host_profile(prepare_call(fn, inputs, direction)), flush=True)


if __name__ == "__main__":
    main()
