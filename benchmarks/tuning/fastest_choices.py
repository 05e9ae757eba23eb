"""Which functions the fastest level should take from kernelforge and which from torch: each example
workload at the fastest level (torch.compile, CUDA graphs) with its kernel set varied one function
group at a time, against the all-torch set (torch.compile plus CUDA graphs alone). Wall clock per
call as the demo times it (median of back-to-back calls, synchronized), realistic sizes, bf16.

    PYTHONPATH=. python benchmarks/tuning/fastest_choices.py [--out DIR]     (a CUDA GPU)

Prints one line per (workload, variant): median ms and the ratio to the all-torch set; writes
fastest_choices.json. kernelforge.models.levels.FastestKernels cites what this measured.
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from kernelforge.bench.timing import time_function
from kernelforge.demo import _runner, workloads
from kernelforge.models import levels

# function groups a variant takes from kernelforge (KernelforgeKernels) instead of torch
GROUPS = {
    "norms": ("norm", "add_norm"),
    "swiglu": ("swiglu",),
    "cross_entropy": ("cross_entropy",),
    "gather_scatter": ("gather_scatter",),
    "linear": ("linear",),
    "attention": ("attention",),
}
# which groups each workload exercises (a group a workload never calls would measure noise)
PLAN = {
    "LM forward": ("norms", "swiglu", "linear", "attention"),
    "LM train step": ("norms", "swiglu", "cross_entropy"),
    "ViT forward": ("norms",),
    "GNN forward": ("gather_scatter", "norms"),
}


def kernel_set(kernelforge_groups: tuple) -> levels.TorchKernels:
    """A kernel set with the named groups' functions from KernelforgeKernels, the rest from torch."""
    chosen = {name: getattr(levels.KernelforgeKernels, name)
              for group in kernelforge_groups for name in GROUPS[group]}
    return type("Variant", (levels.TorchKernels,), {"name": "variant", **chosen})()


def time_variant(work, groups: tuple, repeat: int) -> float:
    torch._dynamo.reset()
    levels.FASTEST_KERNELS = kernel_set(groups)
    model = copy.deepcopy(work.model).set_level(levels.FASTEST)
    call = _runner(work, model)
    call()  # compile and capture
    ms = time_function(call, torch.device("cuda"), warmup=2, repeat=repeat, back_to_back=True,
                       calls_per_sample=1).median_ms
    del model, call
    return ms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args(argv)
    original = levels.FASTEST_KERNELS
    rows = []
    try:
        for work in workloads(torch.device("cuda"), torch.bfloat16, realistic=True):
            if work.name not in PLAN:
                continue
            base = time_variant(work, (), args.repeat)
            print(f"{work.name:14s} {'all torch':26s} {base:9.3f} ms  1.000x", flush=True)
            rows.append({"workload": work.name, "kernelforge": [], "median_ms": base, "vs_all_torch": 1.0})
            for group in PLAN[work.name]:
                ms = time_variant(work, (group,), args.repeat)
                print(f"{work.name:14s} {'kernelforge ' + group:26s} {ms:9.3f} ms  {base / ms:.3f}x", flush=True)
                rows.append({"workload": work.name, "kernelforge": [group], "median_ms": ms, "vs_all_torch": base / ms})
    finally:
        levels.FASTEST_KERNELS = original
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fastest_choices.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                                      "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
