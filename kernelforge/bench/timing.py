"""Timing a function by the project's performance method (docs/performance.md).

On a GPU: CUDA events after warm-up, every run preceded by an L2 flush (a write over a
buffer larger than L2) so no run is served from the previous run's cache; the median and
20/80% quantiles over many runs. Before each flush the GPU is held back (a sleep kernel
longer than the host's time per call), so it never reaches the start event before the host
has queued the call: a flushed run is device time only. Without the hold, a call whose host
side outlasts the flush left the GPU idle inside the timed window by however much the host
lost the race: the same decode kernel timed 25 us in one run and 44 us in the next (H200).
`back_to_back=True` instead times a loop of calls with no flush between them, which is what
a small shape costs in a model: per-call Python and dispatcher overhead shows up there when
the GPU outruns the CPU.
On the CPU: perf_counter around each call, same statistics.
"""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    min_ms: float
    max_ms: float
    mean_ms: float
    runs: int

    def as_dict(self) -> dict:
        return asdict(self)


def _summary(times_ms: list[float]) -> Timing:
    q = statistics.quantiles(times_ms, n=5) if len(times_ms) > 1 else [times_ms[0]] * 4
    return Timing(statistics.median(times_ms), q[0], q[3], min(times_ms), max(times_ms),
                  statistics.fmean(times_ms), len(times_ms))


@functools.lru_cache(maxsize=None)
def _sleep_cycles_per_us(device_index: int) -> float:
    """Clock cycles per microsecond of torch.cuda._sleep on a device, measured once."""
    with torch.cuda.device(device_index):
        torch.cuda._sleep(1000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(2_000_000)
        end.record()
        end.synchronize()
        return 2_000_000 / (start.elapsed_time(end) * 1e3)


def _host_us_per_call(fn: Callable[[], object], calls: int = 3) -> float:
    """Wall microseconds per call without synchronizing: the host's time to queue a call
    (more if fn synchronizes, which only lengthens the hold)."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def time_function(fn: Callable[[], object], device: torch.device | str = "cuda", warmup: int = 10,
                  repeat: int = 100, back_to_back: bool = False, calls_per_sample: int = 20) -> Timing:
    device = torch.device(device)
    if device.type != "cuda":
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return _summary(times)

    with torch.cuda.device(device):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        if back_to_back:
            for _ in range(repeat):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls_per_sample):
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / calls_per_sample)
        else:
            flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
            # the hold covers the host's queueing of the flush, the events and the call, twice over
            hold_us = 2 * _host_us_per_call(fn) + 50
            torch.cuda.synchronize()
            hold_cycles = int(hold_us * _sleep_cycles_per_us(torch.cuda.current_device()))
            for start, end in events:
                torch.cuda._sleep(hold_cycles)
                flush.zero_()
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) for s, e in events]
        return _summary(times)


def autotune_timing(kernel_call, quantiles):
    """Triton autotuners' timing (their do_bench): device time with an L2 flush before each run
    and the GPU held until the run is queued (time_function), the quantiles Triton asks for.
    Triton's own do_bench records events around each call as it is queued; a few-row product
    runs in 10-20 us, less than the host takes to launch it, so every candidate timed as the
    host's pace and the picks were noise: 64x128x128 at 2 slices ran 20.6 us where the tuner's
    pick ran 23.3 (kf.gemm 128 x 4096 x 4096, H200)."""
    timing = time_function(kernel_call, "cuda", warmup=3, repeat=25)
    by_quantile = {0.5: timing.median_ms, 0.2: timing.p20_ms, 0.8: timing.p80_ms}
    return [by_quantile[q] for q in quantiles] if quantiles else timing.median_ms


def wall_us_per_call(fn: Callable[[], object], calls: int = 100, warmup: int = 10,
                     device: torch.device | str = "cuda") -> float:
    """Wall-clock microseconds per call over `calls` back-to-back calls of fn, the device
    synchronized before and after: on a GPU the host's cost per call wherever it exceeds the
    GPU's (latency shapes), else the GPU's."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def device_of(inputs) -> torch.device:
    """The device of the first tensor found in (nested) inputs; CPU if there is none."""
    stack = list(inputs)
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            return item.device
        if isinstance(item, (list, tuple)):
            stack[:0] = list(item)
        elif isinstance(item, dict):
            stack[:0] = list(item.values())
    return torch.device("cpu")


def stats(t: Timing) -> dict:
    """A Timing as the plain dict the public helpers return (ms fields, plus seconds under
    the names of the earlier API: mean_time, median_time)."""
    d = t.as_dict()
    d["mean_time"] = t.mean_ms / 1e3
    d["median_time"] = t.median_ms / 1e3
    return d


def benchmark_kernel(fn: Callable, inputs=(), warmup: int = 10, repeat: int = 100,
                     back_to_back: bool = False) -> dict:
    """Time fn(*inputs) on the inputs' device: median, 20/80% quantiles, min, max, mean."""
    inputs = tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
    return stats(time_function(lambda: fn(*inputs), device_of(inputs), warmup, repeat, back_to_back))


def quick_benchmark(fn: Callable, *inputs, warmup: int = 3, repeat: int = 20) -> dict:
    """A short benchmark_kernel: `quick_benchmark(op, x)["mean_time"]` is seconds per call."""
    return benchmark_kernel(fn, inputs, warmup=warmup, repeat=repeat)


def compare_implementations(implementations: dict, *inputs, warmup: int = 10, repeat: int = 100) -> dict:
    """{name: stats} for each implementation on the same inputs; one that raises is
    reported as {"error": "..."} rather than dropped."""
    results = {}
    for name, fn in implementations.items():
        try:
            results[name] = benchmark_kernel(fn, inputs, warmup=warmup, repeat=repeat)
        except Exception as err:  # a failing implementation is a result too
            results[name] = {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"}
    return results


class CallInBackward(torch.autograd.Function):
    """y = x.clone() whose backward calls `job()` on whichever thread runs it (autograd's device
    thread for CUDA tensors, unless multithreading is off): host-time probes time, profile or
    pin that thread from inside a backward (docs/notes/host_time.md: the probes that used it)."""

    @staticmethod
    def forward(ctx, x, job):
        ctx.job = job
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.job()
        return grad, None
