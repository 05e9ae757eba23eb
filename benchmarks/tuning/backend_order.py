"""Device time of each GPU backend of the ops that have two (softmax, the norms, the activations), at
the sizes their ordering rules cover: the measurement behind `_preference` in kernelforge/ops/.

    PYTHONPATH=. python benchmarks/tuning/backend_order.py [--ops softmax,rms_norm] [--out DIR]

Timing: kernelforge.bench.timing.time_function (CUDA events, an L2 flush before every run, the
GPU held back until the call is queued: device time, no host time). Forward, and forward+backward
(`f(x).backward(g)`), bf16, rows x columns from a decode step's 16 x 4096 to a training step's
16384 x 4096. Columns: each backend's median in us and Triton / CUDA (< 1: Triton faster). Host
time per call is benchmarks/tools/host_overhead.py's.

--tiny: softmax and rms_norm (unless --ops says otherwise) at one small float32 shape on the CPU (the
CUDA column n/a; Triton through TRITON_INTERPRET=1): checks the script runs.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import kernelforge as kf
from kernelforge.bench.timing import time_function

SHAPES = [(16, 4096), (64, 1024), (256, 4096), (1024, 2048), (512, 8192), (2048, 4096), (8192, 768),
          (4096, 4096), (16384, 4096)]
TINY_SHAPES = [(4, 64)]
BACKENDS = ("cuda", "triton")


def _ops(params: dict) -> dict:
    """name -> f(x) on a (rows, cols) input, with weights of the input's width."""
    def weight(x):
        return params.setdefault(("w", x.shape[-1]), torch.randn(x.shape[-1], device=x.device, dtype=x.dtype,
                                                                  requires_grad=True))

    def bias(x):
        return params.setdefault(("b", x.shape[-1]), torch.randn(x.shape[-1], device=x.device, dtype=x.dtype,
                                                                 requires_grad=True))

    return {
        "softmax": kf.softmax,
        "log_softmax": kf.log_softmax,
        "layer_norm": lambda x: kf.layer_norm(x, weight(x), bias(x)),
        "rms_norm": lambda x: kf.rms_norm(x, weight(x)),
        "gelu": kf.gelu,
        "bias_gelu": lambda x: kf.bias_gelu(x, bias(x)),
    }


def measure(name: str, fn, rows: int, cols: int, dtype: torch.dtype, device: str = "cuda") -> list[dict]:
    x = torch.randn(rows, cols, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn_like(x)
    results = []
    for mode in ("fwd", "fwd+bwd"):
        row = {"op": name, "shape": [rows, cols], "mode": mode}
        for backend in BACKENDS:
            def step(backend=backend):
                with kf.use_backend(backend):
                    if mode == "fwd":
                        with torch.no_grad():
                            fn(x)
                    else:
                        x.grad = None
                        fn(x).backward(g)
            try:
                runs = dict(warmup=1, repeat=2) if device == "cpu" else {}  # --tiny: a check, not a measurement
                row[backend] = time_function(step, device, **runs).median_ms * 1e3
            except Exception as err:  # a backend that cannot take these inputs
                row[backend] = None
                row[f"{backend}_error"] = f"{type(err).__name__}: {err}"[:200]
        results.append(row)
    return results


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=None, help="comma-separated subset of the ops")
    parser.add_argument("--out", default=None, help="directory for backend_order.json")
    parser.add_argument("--tiny", action="store_true", help="a small shape on the CPU: checks the script runs")
    args = parser.parse_args(argv)
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    ops = _ops({})
    names = args.ops.split(",") if args.ops else ["softmax", "rms_norm"] if args.tiny else list(ops)
    where = "cpu" if args.tiny else torch.cuda.get_device_name()
    print(f"device time per call, us (median; {where}, {str(dtype).removeprefix('torch.')})")
    print(f"{'op':12s} {'shape':>11s} {'mode':8s} {'cuda':>8s} {'triton':>8s} {'triton/cuda':>11s}")
    rows = []
    for rows_, cols in TINY_SHAPES if args.tiny else SHAPES:
        for name in names:
            for row in measure(name, ops[name], rows_, cols, dtype, device):
                rows.append(row)
                cuda, triton = row["cuda"], row["triton"]
                ratio = f"{triton / cuda:11.2f}" if cuda and triton else f"{'n/a':>11s}"
                cell = lambda v: f"{v:8.1f}" if v is not None else f"{'n/a':>8s}"  # noqa: E731
                print(f"{name:12s} {f'{rows_}x{cols}':>11s} {row['mode']:8s} {cell(cuda)} {cell(triton)} {ratio}",
                      flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "backend_order.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
