"""Where the GEMM backward's host time goes when autograd runs it on its CUDA device thread.

kf.gemm forward+backward (16x4096x4096, bf16) costs ~800 us a step back to back, ~380 us with
the backward called on the calling thread, and ~190 us with the CUDA backend's C++ launches
through the same Python op layer (results/nvidia-h200/gemm/2523458/). This profiles the
backward function itself (cProfile enabled inside it, so on whichever thread autograd runs
it) and times one bare Triton launch on the main thread and inside a backward.

    PYTHONPATH=. python benchmarks/backward_thread_profile.py
"""
from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch
import triton
import triton.language as tl

import kernelforge as kf
from kernelforge.bench.timing import wall_us_per_call
from kernelforge.ops import gemm as gemm_ops


@triton.jit
def _touch(X):
    tl.store(X + tl.program_id(0), 1.0)


def per_call_us(fn, calls=200):
    return wall_us_per_call(fn, calls=calls, warmup=20)


class _LaunchInBackward(torch.autograd.Function):
    """A backward that only launches one trivial Triton kernel."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _touch[(1,)](g)
        return g


def main():
    torch.manual_seed(0)
    buf = torch.zeros(4, device="cuda")
    print(f"bare Triton launch, main thread: {per_call_us(lambda: _touch[(1,)](buf)):.1f} us")
    x = torch.zeros(4, device="cuda", requires_grad=True)
    g = torch.ones(4, device="cuda")
    print(f"clone + backward with one bare Triton launch: "
          f"{per_call_us(lambda: torch.autograd.grad(_LaunchInBackward.apply(x), x, g)):.1f} us")

    M, N, K = 16, 4096, 4096
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    step = lambda: torch.autograd.grad(kf.gemm(a, w.t()), (a, w), grad)  # noqa: E731
    print(f"kf.gemm fwd+bwd {M}x{N}x{K}: {per_call_us(step):.1f} us a step")

    profiler = cProfile.Profile()
    inner = gemm_ops._gemm_backward
    seconds = []
    use_profiler = [False]

    def timed(*args):
        start = time.perf_counter()
        if use_profiler[0]:
            profiler.enable()
        try:
            return inner(*args)
        finally:
            if use_profiler[0]:
                profiler.disable()
            seconds.append(time.perf_counter() - start)

    gemm_ops._gemm_backward = timed
    try:
        for profiled in (False, True):
            use_profiler[0] = profiled
            us = per_call_us(step, calls=100)
            print(f"  {'profiled' if profiled else 'timed'}: {us:.1f} us a step, of which the backward function "
                  f"{sum(seconds[-100:]) / 100 * 1e6:.1f} us")
    finally:
        gemm_ops._gemm_backward = inner
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())


if __name__ == "__main__":
    main()
