"""Softmax benchmark on one GPU: kernelforge (Triton, CUDA) against eager and torch.compile.

    PYTHONPATH=. python benchmarks/softmax.py --out benchmarks/results/<gpu>

Measures the device-to-device copy bandwidth first (the ceiling), then for every shape,
dtype and direction the median time of each implementation, its GB/s (bytes read once
plus written once: 2 tensors forward, 5 forward+backward) and the % of the copy ceiling.
Shapes of >= 1M elements are timed with an L2 flush before every run; smaller ones as
back-to-back calls, so per-call dispatch overhead counts (the latency shapes).
Writes softmax.json (every number) and softmax.md (the table).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

import torch
import triton

import kernelforge as kf
from kernelforge.bench.timing import time_function
from kernelforge.cuda.softmax import softmax_forward_rows as cuda_rows
from kernelforge.triton.softmax import softmax_forward_rows as triton_rows

SHAPES = [(16384, 4096), (8192, 16384), (4096, 65536), (1024, 262144), (4096, 1024), (8, 4096)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def copy_bandwidth_gbps() -> float:
    x = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    t = time_function(lambda: y.copy_(x), repeat=50)
    return 2 * x.numel() * x.element_size() / (t.median_ms * 1e-3) / 1e9


def with_backend(backend):
    def fn(x):
        with kf.use_backend(backend):
            return kf.softmax(x, -1)
    return fn


def forward_impls():
    compiled = torch.compile(lambda x: torch.softmax(x, -1), dynamic=False)
    return {
        "kernelforge (default)": lambda x: kf.softmax(x, -1),
        "kernelforge triton": with_backend("triton"),
        "kernelforge cuda": with_backend("cuda"),
        "triton kernel only": lambda x: triton_rows(x, False),
        "cuda kernel only": lambda x: cuda_rows(x, False),
        "torch eager": lambda x: torch.softmax(x, -1),
        "torch.compile": compiled,
    }


def fwd_bwd(fn):
    def run(x, g):
        y = fn(x)
        return torch.autograd.grad(y, x, g)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeat", type=int, default=100)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    ceiling = copy_bandwidth_gbps()
    meta = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": triton.__version__, "python": platform.python_version(),
        "commit": os.environ.get("KERNELFORGE_COMMIT", "unknown"),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "copy_bandwidth_gbps": round(ceiling, 1),
    }
    print(json.dumps(meta), flush=True)
    rows = []
    for dtype_name, dtype in DTYPES.items():
        impls = forward_impls()
        for (m, n) in SHAPES:
            x = torch.randn(m, n, device="cuda", dtype=dtype) * 3
            g = torch.randn_like(x)
            small = x.numel() < 2**20
            ref = torch.softmax(x.double(), -1)
            for direction in ("fwd", "fwd+bwd"):
                n_tensors = 2 if direction == "fwd" else 5
                nbytes = n_tensors * x.numel() * x.element_size()
                for name, fn in impls.items():
                    if direction == "fwd+bwd" and "only" in name:
                        continue
                    row = {"shape": f"{m}x{n}", "dtype": dtype_name, "direction": direction, "impl": name}
                    try:
                        if direction == "fwd":
                            err = (fn(x).double() - ref).abs().max().item()
                            call = lambda: fn(x)  # noqa: E731
                        else:
                            xg = x.detach().requires_grad_()
                            err = None
                            call = (lambda f: lambda: f(xg, g))(fwd_bwd(fn))
                        t = time_function(call, repeat=args.repeat, back_to_back=small)
                        row.update(ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms, max_abs_err=err,
                                   gbps=nbytes / (t.median_ms * 1e-3) / 1e9, timing="back-to-back" if small else "L2 flushed")
                        row["pct_of_copy"] = 100 * row["gbps"] / ceiling
                    except Exception as e:  # a failing implementation is reported, not dropped
                        row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            if not small:  # independent cross-check of our timing with Triton's own do_bench
                ms = triton.testing.do_bench(lambda: triton_rows(x, False), return_mode="median")
                rows.append({"shape": f"{m}x{n}", "dtype": dtype_name, "direction": "fwd",
                             "impl": "triton kernel only (triton.testing.do_bench)", "ms": ms,
                             "gbps": 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9})
            del x, g, ref
            torch.cuda.empty_cache()

    (out / "softmax.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "softmax.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))


def markdown(meta, rows) -> str:
    lines = [
        f"# softmax on {meta['gpu']}",
        "",
        f"torch {meta['torch']} (CUDA {meta['cuda']}), Triton {meta['triton']}, commit {meta['commit']}, {meta['timestamp']}.",
        f"Measured copy bandwidth (1 GiB device-to-device, read + write): **{meta['copy_bandwidth_gbps']} GB/s**.",
        "GB/s counts bytes read once + written once (fwd: x, y; fwd+bwd: x, y, dy, y, dx).",
        "Shapes under 1M elements are timed back to back (per-call overhead included); larger ones with an L2 flush before each run.",
        "",
        "| shape | dtype | direction | implementation | ms | GB/s | % of copy | best baseline ms | speedup vs best baseline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "timing" not in r and "error" not in r:
            continue
        peers = [p for p in rows if p["shape"] == r["shape"] and p["dtype"] == r["dtype"]
                 and p["direction"] == r["direction"] and p["impl"] in ("torch eager", "torch.compile") and "ms" in p]
        best = min((p["ms"] for p in peers), default=None)
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['dtype']} | {r['direction']} | {r['impl']} | FAILED: {r['error']} | | | | |")
            continue
        speed = f"{best / r['ms']:.2f}x" if best else ""
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['direction']} | {r['impl']} | {r['ms']:.4f} | {r['gbps']:.0f} | "
                     f"{r['pct_of_copy']:.1f} | {best:.4f} | {speed} |")
    checks = [r for r in rows if "do_bench" in r["impl"]]
    if checks:
        lines += ["", "Cross-check, Triton kernel forward timed by `triton.testing.do_bench` (median):", ""]
        lines += [f"- {r['shape']} {r['dtype']}: {r['ms']:.4f} ms ({r['gbps']:.0f} GB/s)" for r in checks]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
