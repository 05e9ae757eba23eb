"""The cross-entropy forward kernel's launch shapes on this GPU: walk variant (one running max a
program, reduced every block, or one a lane, merged at the end), block, warps and pipelining
stages, timed on L2-cold logits and checked against torch's logsumexp. The forward only reads the
logits, so its ceiling is the read bandwidth (bytes = rows * classes * elt).

    python benchmarks/cross_entropy_sweep.py [--shapes 4096x128256,16384x32000]
"""
from __future__ import annotations

import argparse
import itertools

import torch

from kernelforge.bench.timing import time_function
from kernelforge.triton.cross_entropy import (ForwardConfig, cross_entropy_backward_rows, cross_entropy_forward_rows,
                                              default_forward_config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x128256,16384x32000,16384x256")
    args = parser.parse_args()
    device = torch.device("cuda")
    print("| shape | lanes | block | warps | stages | ms | GB/s | max lse error |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        rows, classes = map(int, shape.split("x"))
        logits = torch.randn(rows, classes, device=device, dtype=torch.bfloat16) * 4
        target = torch.randint(0, classes, (rows,), device=device)
        expected = torch.logsumexp(logits.float(), dim=1)
        default = default_forward_config(classes)
        configs = [default] + [ForwardConfig(b, w, lanes, s) for lanes, b, w, s in itertools.product(
            (False,), (1024, 2048, 4096, 8192), (2, 4, 8), (1,)) if b <= max(1024, 2 * classes)]
        for cfg in configs:
            try:
                _, lse = cross_entropy_forward_rows(logits, target, -100, 0.0, cfg)
                err = (lse - expected).abs().max().item()
                t = time_function(lambda: cross_entropy_forward_rows(logits, target, -100, 0.0, cfg), device,
                                  warmup=5, repeat=30)
            except Exception as e:  # a config the compiler refuses: say so, go on
                print(f"| {shape} | {cfg.lanes} | {cfg.block} | {cfg.num_warps} | {cfg.stages} | failed: "
                      f"{type(e).__name__} | | |")
                continue
            gbps = logits.numel() * logits.element_size() / (t.median_ms * 1e-3) / 1e9
            mark = " (default)" if cfg == default else ""
            print(f"| {shape} | {cfg.lanes} | {cfg.block} | {cfg.num_warps} | {cfg.stages}{mark} | {t.median_ms:.4f} "
                  f"| {gbps:.0f} | {err:.1e} |", flush=True)
        # the backward: reads the logits, writes their gradient (2 * rows * classes * elt bytes)
        loss, lse = cross_entropy_forward_rows(logits, target, -100, 0.0)
        grad_loss = torch.full((rows,), 1.0 / rows, device=device)
        expected = cross_entropy_backward_rows(grad_loss, logits, target, lse, -100, 0.0, (1024, 4)).float()
        for block, warps in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16, 32)):
            if block > max(1024, 2 * classes):
                continue
            got = cross_entropy_backward_rows(grad_loss, logits, target, lse, -100, 0.0, (block, warps))
            t = time_function(lambda: cross_entropy_backward_rows(grad_loss, logits, target, lse, -100, 0.0,
                                                                  (block, warps)), device, warmup=5, repeat=30)
            gbps = 2 * logits.numel() * logits.element_size() / (t.median_ms * 1e-3) / 1e9
            print(f"| {shape} backward | | {block} | {warps} | | {t.median_ms:.4f} | {gbps:.0f} | "
                  f"{(got.float() - expected).abs().max().item():.1e} |", flush=True)


if __name__ == "__main__":
    main()
