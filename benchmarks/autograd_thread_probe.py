"""Why a Triton launch costs ~60 us on autograd's device thread and ~9 us on the calling thread.

gemm/e0bda68/backward-thread-profile.log: an autograd step whose backward makes one bare Triton
launch costs 84 us, the launch alone 8.9 us on the main thread; a kf.gemm forward+backward
step at 16x4096x4096 costs ~870 us for 39 us of device time, ~400 of them unexplained. This
probe times the same small calls (a bare Triton launch, the CUDA queries a launch makes, an
allocation, a Python no-op) on the main thread, on a Python thread, inside a backward on
autograd's device thread and inside a backward run on the calling thread
(torch.autograd.set_multithreading_enabled(False)), and profiles the launches in each place.

    PYTHONPATH=. python3 benchmarks/autograd_thread_probe.py
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import threading
import time

import torch
import triton
import triton.language as tl

from kernelforge.bench.timing import CallInBackward


@triton.jit
def _touch(X):
    tl.store(X, 1.0)


def _noop():
    return None


X = torch.zeros(16, device="cuda")
CALLS = {
    "triton launch": lambda: _touch[(1,)](X),
    "torch.cuda.current_device": torch.cuda.current_device,
    "torch.cuda.current_stream": torch.cuda.current_stream,
    "triton get_current_stream": lambda: triton.runtime.driver.active.get_current_stream(0),
    "triton get_current_device": lambda: triton.runtime.driver.active.get_current_device(),
    "torch.empty(16) cuda": lambda: torch.empty(16, device="cuda"),
    "python no-op": _noop,
}
REPS = 400


def time_calls(into: dict, where: str):
    for name, fn in CALLS.items():
        fn()
        start = time.perf_counter()
        for _ in range(REPS):
            fn()
        into[(where, name)] = (time.perf_counter() - start) / REPS * 1e6


def profile_launches(into: dict, where: str):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(REPS):
        _touch[(1,)](X)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    into[where] = out.getvalue()


def _in_backward_named(job):
    """job(where) with where naming the thread the backward runs on."""
    def call():
        on_main = threading.current_thread() is threading.main_thread()
        job("backward, calling thread" if on_main else "backward, autograd thread")
    return call


def in_backward(job, multithreading: bool):
    x = torch.zeros(4, device="cuda", requires_grad=True)
    with torch.autograd.set_multithreading_enabled(multithreading):
        CallInBackward.apply(x, _in_backward_named(job)).sum().backward()


def step_time(backward_launches: int, multithreading: bool, steps: int = 300) -> float:
    """us per forward+backward step whose backward makes `backward_launches` bare launches."""
    def job():
        for _ in range(backward_launches):
            _touch[(1,)](X)

    x = torch.zeros(4, device="cuda", requires_grad=True)
    with torch.autograd.set_multithreading_enabled(multithreading):
        for _ in range(20):
            CallInBackward.apply(x, job).sum().backward()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            CallInBackward.apply(x, job).sum().backward()
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e6


def gemm_step_time(multithreading: bool, steps: int = 100, profile: bool = False) -> float:
    """us per kf.gemm forward+backward step at 16x4096x4096 bf16, back to back; profile: print
    cProfile's view of the steps (the backward on the calling thread, where cProfile sees it)."""
    import kernelforge as kf
    a = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(multithreading):
        for _ in range(10):
            kf.gemm(a, w.t()).sum().backward()
        torch.cuda.synchronize()
        if profile:
            prof.enable()
        start = time.perf_counter()
        for _ in range(steps):
            kf.gemm(a, w.t()).sum().backward()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if profile:
            prof.disable()
            for key in ("tottime", "cumtime"):
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats(key).print_stats(30)
                print(f"\n== cProfile of {steps} kf.gemm steps by {key}\n{out.getvalue()}")
    return elapsed / steps * 1e6


def main():
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, "
          f"switch interval {sys.getswitchinterval()} s, threads {[t.name for t in threading.enumerate()]}")
    times: dict = {}
    profiles: dict = {}
    time_calls(times, "main thread")
    worker = threading.Thread(target=time_calls, args=(times, "python thread"))
    worker.start()
    worker.join()
    in_backward(lambda where: time_calls(times, where), multithreading=True)
    in_backward(lambda where: time_calls(times, where), multithreading=False)
    wheres = list(dict.fromkeys(w for w, _ in times))
    print(f"\nus per call, {REPS} calls back to back")
    print(f"{'call':28s}" + "".join(f"{w[:34]:>36s}" for w in wheres))
    for name in CALLS:
        print(f"{name:28s}" + "".join(f"{times[(w, name)]:36.2f}" for w in wheres))
    print("\nforward+backward step, us (backward makes N bare launches):")
    for multithreading in (True, False):
        row = {n: step_time(n, multithreading) for n in (0, 1, 10)}
        per_launch = (row[10] - row[1]) / 9
        print(f"  {'autograd thread' if multithreading else 'calling thread ':16s} N=0 {row[0]:7.1f}  N=1 {row[1]:7.1f}"
              f"  N=10 {row[10]:7.1f}  -> {per_launch:.1f} us a launch")
    for multithreading in (True, False):
        print(f"  kf.gemm 16x4096x4096 bf16, backward on the {'autograd' if multithreading else 'calling'} thread: "
              f"{gemm_step_time(multithreading):.1f} us a step")
    gemm_step_time(False, profile=True)
    profile_launches(profiles, "main thread")
    in_backward(lambda where: profile_launches(profiles, where), multithreading=True)
    for where, text in profiles.items():
        print(f"\n== cProfile of {REPS} launches, {where}\n{text}")


if __name__ == "__main__":
    main()
