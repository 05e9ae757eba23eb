"""Benchmarking with kernelforge.bench: time a call, compare implementations, plot them, and
profile a model's forward.

Timings on a CPU are wall clock around each call (perf_counter); on a GPU they are CUDA events
with an L2 flush before each run (kernelforge/bench/timing.py). The shapes here are small so the
script runs in seconds on a CPU: the numbers show how to use the tools, not how fast the GPU
kernels are (on a CPU kernelforge's ops run their PyTorch reference; Triton's interpreter is a
simulator, far too slow to time). For the full op suites use `kernelforge bench`.

    python examples/02_benchmarking.py                    # plots into a new temporary directory
    python examples/02_benchmarking.py --out plots/ --repeat 50
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import kernelforge as kf
from kernelforge.bench import (KernelProfiler, benchmark_kernel, compare_implementations, profile_model_inference,
                               quick_benchmark)
from kernelforge.models import LanguageModel


def time_one_call(device, repeat: int) -> dict:
    """quick_benchmark (a few runs) and benchmark_kernel (the full statistics) of one op."""
    x = torch.randn(64, 1024, device=device)
    quick = quick_benchmark(kf.softmax, x)
    print(f"quick_benchmark(kf.softmax, x): {quick['mean_time'] * 1e6:.1f} us a call (mean over {quick['runs']} runs)")
    stats = benchmark_kernel(kf.softmax, (x,), warmup=3, repeat=repeat)
    print(f"benchmark_kernel: median {stats['median_ms']:.4f} ms, 20-80% {stats['p20_ms']:.4f}-"
          f"{stats['p80_ms']:.4f} ms, min {stats['min_ms']:.4f} ms over {stats['runs']} runs")
    return stats


def rms_norm_implementations(weight) -> dict:
    """The same RMS norm three ways. The last one forces the CUDA backend: on a CPU it fails,
    and the comparison reports the failure instead of dropping the row."""

    def kernelforge_cuda(x):
        with kf.use_backend("cuda"):
            return kf.rms_norm(x, weight, 1e-6)

    return {
        "kf.rms_norm": lambda x: kf.rms_norm(x, weight, 1e-6),
        "F.rms_norm": lambda x: torch.nn.functional.rms_norm(x, weight.shape, weight, 1e-6),
        "torch, by hand": lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight,
        "kf.rms_norm on cuda": kernelforge_cuda,
    }


def compare_and_plot(device, out_dir: Path, repeat: int) -> tuple[dict, Path]:
    """compare_implementations (plain dicts) and KernelProfiler.plot_comparison (a PNG)."""
    x, weight = torch.randn(256, 512, device=device), torch.randn(512, device=device)
    implementations = rms_norm_implementations(weight)
    results = compare_implementations(implementations, x, warmup=3, repeat=repeat)
    for name, row in results.items():
        print(f"  {name:<20} " + (f"failed: {row['error']}" if "error" in row else f"{row['median_ms']:.4f} ms"))

    profiler = KernelProfiler(warmup=3, repeat=repeat)  # the same comparison through the profiler's API
    results = profiler.compare_implementations(implementations, args=(x,))
    path = profiler.plot_comparison(results, out_dir / "rms_norm_comparison.png", title=f"rms_norm 256x512, {device}")
    print(f"KernelProfiler.plot_comparison wrote {path}")
    return results, path


def sweep_sizes(device, out_dir: Path, repeat: int, sizes=(256, 1024, 4096, 16384)) -> tuple[dict, Path]:
    """Median time of softmax over rows of growing length, kernelforge against torch, as a line plot."""
    from kernelforge.bench.report import pyplot  # matplotlib on its file-only Agg backend

    implementations = {"kf.softmax": kf.softmax, "torch.softmax": lambda x: torch.softmax(x, -1)}
    medians = {name: [] for name in implementations}
    for columns in sizes:
        x = torch.randn(32, columns, device=device)
        for name, fn in implementations.items():
            medians[name].append(benchmark_kernel(fn, (x,), warmup=2, repeat=repeat)["median_ms"])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, ms in medians.items():
        ax.plot(sizes, ms, marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="row length (32 rows)", ylabel="median ms", title=f"softmax, {device}")
    ax.legend()
    fig.tight_layout()
    path = out_dir / "softmax_sweep.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"size sweep: {path}")
    return medians, path


def profile_a_model(device):
    """profile_model_inference: the forward's median time, peak memory (GPU) and top kernels
    (operators on a CPU) of a tiny language model at the reference level (kernelforge's ops)."""
    model = LanguageModel(vocab_size=128, dim=64, n_layers=2, n_heads=4, max_seq_len=64, level="reference")
    model = model.to(device).eval()
    ids = torch.randint(0, 128, (2, 64), device=device)
    report = profile_model_inference(model, ids, warmup=1, repeat=3, top=5)
    print(report)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--out", default=None, help="where the plots go (default: a new temporary directory)")
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per measurement (default 10)")
    args = parser.parse_args(argv)
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="kernelforge-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    torch.manual_seed(0)

    time_one_call(device, args.repeat)
    print("\ncompare_implementations: rms_norm 256x512")
    compare_and_plot(device, out_dir, args.repeat)
    print()
    sweep_sizes(device, out_dir, args.repeat)
    print("\nprofile_model_inference: a tiny LanguageModel's forward")
    profile_a_model(device)
    print(f"\nplots in {out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
