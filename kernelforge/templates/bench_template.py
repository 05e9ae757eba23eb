"""Benchmark my_op through the project's harness (kernelforge.bench): kernelforge on every
backend that takes the case, against the plain-PyTorch reference run eagerly and under
torch.compile; ms, GB/s and % of the measured bandwidth ceiling, JSON + CSV + Markdown + PNG.

    python benchmarks/bench_my_op.py [--dtype bf16,fp32] [--quick] [--out bench-my_op]

Written by `kernelforge new-op my_op`. The cost model assumes an elementwise op (forward
reads x and writes y; backward reads x and dy and writes dx): change _cost if yours moves more.
"""
from __future__ import annotations

import argparse
import sys

import torch

from kernelforge.bench import report
from kernelforge.bench.roofline import Cost
from kernelforge.bench.runner import run_bench
from kernelforge.bench.suite_types import Suite
from kernelforge.ops.my_op import my_op
from kernelforge.reference.my_op import my_op_forward as reference_forward

SHAPES = [(16384, 4096), (4096, 65536), (8, 4096)]  # large (bandwidth) first, then one latency case
QUICK_SHAPES = [(64, 1000)]


def _inputs(shape, dtype: torch.dtype, device: torch.device) -> tuple:
    return (torch.randn(shape, dtype=dtype, device=device),)


def _cost(shape, dtype: torch.dtype, direction: str) -> Cost:
    tensors = 2 if direction == "fwd" else 5
    return Cost(tensors * torch.Size(shape).numel() * dtype.itemsize)


SUITE = Suite(op="my_op", shapes=SHAPES, quick_shapes=QUICK_SHAPES, make_inputs=_inputs, cost=_cost,
              kernelforge=my_op,
              baselines=lambda: {"torch eager": reference_forward,
                                 "torch.compile": torch.compile(reference_forward, dynamic=False)})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16,fp32")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="bench-my_op")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = run_bench(["my_op"], args.dtype.split(","), device, quick=args.quick, progress=sys.stderr,
                       suites={"my_op": SUITE})
    paths = report.write_results(result, args.out)
    sys.stdout.write(report.markdown(result) + "wrote " + ", ".join(map(str, paths)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
