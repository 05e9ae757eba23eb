"""Sweep the Triton softmax launch configuration per shape, to choose the defaults in
kernelforge/triton/softmax.py. Prints the best few configs per (shape, dtype, direction).

    PYTHONPATH=. python benchmarks/tuning/softmax_sweep.py --out DIR

--tiny: one small shape in float32 on the CPU, two configs a direction (Triton through
TRITON_INTERPRET=1): checks the script runs; writes only where --out says.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch

from kernelforge.bench.timing import time_function
from kernelforge.triton import softmax as ts

SHAPES = [(16384, 4096), (8192, 16384), (4096, 65536), (1024, 262144), (4096, 1024)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TINY_SHAPES, TINY_DTYPES, TINY_CONFIGS = [(4, 512)], {"fp32": torch.float32}, 2


def candidates(n_rows, n_cols, backward):
    cap = ts.FUSED_MAX_COLS_BACKWARD if backward else ts.FUSED_MAX_COLS
    if n_cols <= cap:
        bn = 1 << (n_cols - 1).bit_length()
        for bm, warps in itertools.product((1, 2, 4), (4, 8, 16, 32)):
            per_thread = bm * bn / (warps * 32)
            if bm * bn > 32768 or not 4 <= per_thread <= 64:
                continue
            yield ts.RowConfig(True, bm, bn, warps)
        return
    for bn, warps in itertools.product((2048, 4096, 8192, 16384), (4, 8, 16, 32)):
        if 4 <= bn / (warps * 32) <= 64:
            yield ts.RowConfig(False, 1, bn, warps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="directory for softmax_sweep.json (required but with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="a small shape on the CPU: checks the script runs")
    args = ap.parse_args()
    if not (args.out or args.tiny):
        ap.error("--out is required")
    device = "cpu" if args.tiny else "cuda"
    shapes, dtypes = (TINY_SHAPES, TINY_DTYPES) if args.tiny else (SHAPES, DTYPES)
    results = []
    for (m, n), (dname, dtype), backward in itertools.product(shapes, dtypes.items(), (False, True)):
        x = torch.randn(m, n, device=device, dtype=dtype)
        y = torch.softmax(x, -1)
        g = torch.randn_like(x)
        timings = []
        configs = list(candidates(m, n, backward))
        for cfg in configs[:TINY_CONFIGS] if args.tiny else configs:
            if backward:
                fn = functools.partial(ts.softmax_backward_rows, g, y, False, config=cfg)
            else:
                fn = functools.partial(ts.softmax_forward_rows, x, False, config=cfg)
            try:
                out = fn()
                expected = y if not backward else y * (g - (g * y).sum(-1, keepdim=True))
                atol = 2e-2 if dtype != torch.float32 else 1e-5
                if not torch.allclose(out.float(), expected.float(), atol=atol, rtol=1e-2):
                    timings.append((float("inf"), cfg, "WRONG"))
                    continue
                t = time_function(fn, device, repeat=2 if args.tiny else 30, warmup=1 if args.tiny else 3)
                timings.append((t.median_ms, cfg, ""))
            except Exception as e:  # a config that fails to compile (registers, shared memory) is skipped
                timings.append((float("inf"), cfg, f"{type(e).__name__}"))
        timings.sort(key=lambda t: t[0])
        default = ts.default_config(m, n, backward)
        default_ms = next((t for t, c, _ in timings if c == default), None)
        nbytes = (3 if backward else 2) * x.numel() * x.element_size()
        entry = {"shape": f"{m}x{n}", "dtype": dname, "backward": backward, "default": repr(default),
                 "default_ms": default_ms,
                 "best": [{"ms": t, "gbps": nbytes / (t * 1e-3) / 1e9, "config": repr(c), "note": note}
                          for t, c, note in timings[:5]],
                 "failures": [f"{repr(c)}: {note}" for t, c, note in timings if note]}
        results.append(entry)
        print(json.dumps(entry), flush=True)
        del x, y, g
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "softmax_sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
