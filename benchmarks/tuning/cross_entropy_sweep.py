"""The cross-entropy kernels' launch shapes on this GPU: block and warps of the forward (which only
reads the logits: bytes = rows * classes * elt) and of the backward (reads them and writes the
gradient: twice that), timed on L2-cold logits and checked against torch's logsumexp / against one
fixed launch shape.

A first version also swept a lane-wise running max and sum and pipelining stages in the forward
(19a6889, results in benchmarks/results/nvidia-h200/0.1.0/models/937951e-loss/ce-sweep.log): slower at
every shape, removed.

    python benchmarks/tuning/cross_entropy_sweep.py [--shapes 4096x128256,16384x32000]

--tiny: a small shape in float32 on the CPU, two launch shapes a direction (Triton through
TRITON_INTERPRET=1): checks the script runs.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from kernelforge.bench.timing import time_function
from kernelforge.triton.cross_entropy import (LaunchConfig, cross_entropy_backward_rows, cross_entropy_forward_rows,
                                              default_config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x128256,16384x32000,16384x256")
    parser.add_argument("--tiny", action="store_true", help="a small shape on the CPU: checks the script runs")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    shapes, dtype = ("8x300", torch.float32) if args.tiny else (args.shapes, torch.bfloat16)
    launch_shapes = list(itertools.product((1024, 2048, 4096, 8192), (2, 4, 8, 16, 32)))
    if args.tiny:
        launch_shapes = [(1024, 4), (1024, 8)]
    print("| shape | direction | block | warps | ms | GB/s | max error |")
    print("|---|---|---|---|---|---|---|")
    for shape in shapes.split(","):
        rows, classes = map(int, shape.split("x"))
        logits = torch.randn(rows, classes, device=device, dtype=dtype) * 4
        target = torch.randint(0, classes, (rows,), device=device)
        expected_lse = torch.logsumexp(logits.float(), dim=1)
        _, lse = cross_entropy_forward_rows(logits, target, -100, 0.0)
        grad_loss = torch.full((rows,), 1.0 / rows, device=device)
        expected_grad = cross_entropy_backward_rows(grad_loss, logits, target, lse, -100, 0.0,
                                                    LaunchConfig(1024, 4)).float()
        nbytes = logits.numel() * logits.element_size()
        for backward, (block, warps) in itertools.product((False, True), launch_shapes):
            if block > max(1024, 2 * classes):
                continue
            cfg = LaunchConfig(block, warps)
            if backward:
                def call():
                    return cross_entropy_backward_rows(grad_loss, logits, target, lse, -100, 0.0, cfg)
                err = (call().float() - expected_grad).abs().max().item()
            else:
                def call():
                    return cross_entropy_forward_rows(logits, target, -100, 0.0, config=cfg)
                err = (call()[1] - expected_lse).abs().max().item()
            t = time_function(call, device, warmup=1 if args.tiny else 5, repeat=2 if args.tiny else 30)
            gbps = (2 if backward else 1) * nbytes / (t.median_ms * 1e-3) / 1e9
            mark = " (default)" if cfg == default_config(classes, backward) else ""
            print(f"| {shape} | {'backward' if backward else 'forward'} | {block} | {warps}{mark} | "
                  f"{t.median_ms:.4f} | {gbps:.0f} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
