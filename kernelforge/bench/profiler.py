"""The profiling API: KernelProfiler (compare and plot implementations)
and profile_model_inference (time, peak memory and top kernels of a model's forward)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from kernelforge.bench.timing import compare_implementations, device_of, time_function


class KernelProfiler:
    """profiler = KernelProfiler(); results = profiler.compare_implementations(impls, args=(x,));
    profiler.plot_comparison(results)  # writes a PNG, returns its path"""

    def __init__(self, warmup: int = 10, repeat: int = 100):
        self.warmup, self.repeat = warmup, repeat

    def compare_implementations(self, implementations: dict[str, Callable], args: tuple = (), kwargs: Optional[dict] = None) -> dict:
        kwargs = kwargs or {}
        bound = {name: (lambda f: lambda *a: f(*a, **kwargs))(fn) for name, fn in implementations.items()}
        return compare_implementations(bound, *args, warmup=self.warmup, repeat=self.repeat)

    def plot_comparison(self, results: dict, path: str | Path = "kernel_comparison.png", title: str = "") -> Path:
        """Median time per implementation, with 20-80% whiskers; failures are labelled."""
        from kernelforge.bench.report import pyplot

        plt = pyplot()

        names = list(results)
        medians = [results[n].get("median_ms", 0.0) for n in names]
        low = [m - results[n].get("p20_ms", m) for n, m in zip(names, medians)]
        high = [results[n].get("p80_ms", m) - m for n, m in zip(names, medians)]
        fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(names)), 4))
        ax.bar(names, medians, yerr=[low, high], capsize=4)
        for i, n in enumerate(names):
            if "error" in results[n]:
                ax.text(i, 0, "failed", ha="center", va="bottom", color="red")
        ax.set_ylabel("median ms")
        ax.set_title(title or "implementation comparison")
        ax.tick_params(axis="x", labelsize=8)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


@dataclass
class InferenceReport:
    median_ms: float
    peak_memory_bytes: Optional[int]  # None where the device cannot report it (CPU)
    top_kernels: list[dict] = field(default_factory=list)  # name, self time ms, calls

    def __str__(self) -> str:
        memory = f"{self.peak_memory_bytes / 2**20:.1f} MiB" if self.peak_memory_bytes is not None else "n/a on CPU"
        lines = [f"forward: {self.median_ms:.3f} ms median, peak memory {memory}", "top kernels by self time:"]
        lines += [f"  {k['self_ms']:9.3f} ms  {k['calls']:5d} calls  {k['name']}" for k in self.top_kernels]
        return "\n".join(lines)


def profile_model_inference(model: torch.nn.Module, inputs, warmup: int = 3, repeat: int = 10, top: int = 10) -> InferenceReport:
    """Time model(*inputs) under no_grad, its peak device memory, and the `top` kernels
    (operators on CPU) by self time from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    device = device_of(inputs)

    with torch.no_grad():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        timing = time_function(lambda: model(*inputs), device, warmup=warmup, repeat=repeat)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            model(*inputs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    kernels = [{"name": e.key, "self_ms": getattr(e, attr) / 1e3, "calls": e.count} for e in events[:top]]
    return InferenceReport(timing.median_ms, peak, kernels)
