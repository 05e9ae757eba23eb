"""Host time per call of every public kernelforge op at small shapes against its torch eager
equivalent, and where kernelforge's microseconds go (issue 28's target: host time per call of
every op at small shapes, forward and forward+backward, within 1.5x of torch eager).

    PYTHONPATH=. python benchmarks/tools/host_overhead.py [--ops a,b] [--iters N] [--out DIR] [--tiny]

Timing (kernelforge.bench.timing.wall_us_per_call): N calls back to back after warm-up, the
device synchronized before and after only. At these shapes the GPU outruns the host, so wall
time per call is the host's (the breakdown's "gpu wait" row says where it does not).
Forward+backward is `y = f(x); y.backward(g)` a call, the leaves' .grad set to None first (as
zero_grad(set_to_none=True); torch pays it too). Columns: kernelforge as it chooses ("ran on": the
backends it ran on), each backend forced (kf.use_backend; "n/a": it cannot take the inputs),
torch, kf/torch, "!" past 1.5x. --tiny: CPU, tiny shapes, a few calls (the CPU test runs it).

Breakdown (kernelforge.bench.host_breakdown): one more loop of kernelforge's own choice with its
functions wrapped in perf_counter_ns pairs, found by name at run time; a table per op of where a
call's microseconds go: dispatch (the eager path's glue), an eager plan's key and its replay (a
replayed call runs none of the rest of kernelforge's Python), op code, checks, backend choice,
allocation, launch, autograd, the wrappers' own cost, the rest, and the wait for the GPU.

On a GPU run the `build` stage of benchmarks/run_gpu.sh first (`bash benchmarks/run_gpu.sh build
host`): forcing the CUDA backend would otherwise build every extension inside the timed rows' warm-up.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

import kernelforge as kf
from kernelforge import backends
from kernelforge.bench.host_breakdown import CATEGORIES, breakdown, wrapper_overhead_ns
from kernelforge.bench.timing import wall_us_per_call

TARGET = 1.5


# ----------------------------------------------------------------------------- cases
def _cases(device: torch.device, dtype: torch.dtype, tiny: bool) -> dict:
    """name -> builder of (kernelforge fn, torch fn or None, inputs, indices of differentiable inputs)."""
    R, C = (4, 64) if tiny else (16, 4096)
    B, H, S, D = (1, 2, 16, 16) if tiny else (1, 8, 128, 64)
    M, N, K = (4, 64, 64) if tiny else (16, 4096, 4096)
    V = 100 if tiny else 32000
    nodes, edges, feats = (10, 30, 8) if tiny else (400, 3200, 128)  # one graph of the demo GNN
    t = functools.partial(torch.randn, device=device, dtype=dtype)

    def rows(n):
        return tuple(t(R, C) for _ in range(n))

    def add_norm(norm):
        def run(x, r, *params):
            s = x + r
            return norm(s, *params), s
        return run

    def gather_scatter_torch(x, src, dst):
        return torch.zeros(nodes, x.shape[1], device=x.device, dtype=x.dtype).index_add_(0, dst, x.index_select(0, src))

    def convrnn():
        from kernelforge.bench.recurrent_suites import recurrent_suites

        suite = recurrent_suites()["convrnn"]
        shape = (1, 4, 8, 3) if tiny else min(suite.shapes, key=math.prod)
        return kf.convrnn, suite.baselines().get("torch eager"), suite.make_inputs(shape, dtype, device), (0, 1, 2)

    def ids(n):
        return torch.randint(0, nodes, (n,), device=device)

    return {
        "softmax": lambda: (kf.softmax, lambda x: torch.softmax(x, -1), rows(1), (0,)),
        "log_softmax": lambda: (kf.log_softmax, lambda x: torch.log_softmax(x, -1), rows(1), (0,)),
        "layer_norm": lambda: (kf.layer_norm, lambda x, w, b: F.layer_norm(x, (C,), w, b), (*rows(1), t(C), t(C)),
                               (0, 1, 2)),
        "rms_norm": lambda: (lambda x, w: kf.rms_norm(x, w, 1e-6), lambda x, w: F.rms_norm(x, (C,), w, 1e-6),
                             (*rows(1), t(C)), (0, 1)),
        "add_rms_norm": lambda: (lambda x, r, w: kf.add_rms_norm(x, r, w, 1e-6),
                                 add_norm(lambda s, w: F.rms_norm(s, (C,), w, 1e-6)), (*rows(2), t(C)), (0, 1, 2)),
        "add_layer_norm": lambda: (kf.add_layer_norm, add_norm(lambda s, w, b: F.layer_norm(s, (C,), w, b)),
                                   (*rows(2), t(C), t(C)), (0, 1, 2, 3)),
        "gelu": lambda: (kf.gelu, F.gelu, rows(1), (0,)),
        "silu": lambda: (kf.silu, F.silu, rows(1), (0,)),
        "relu": lambda: (kf.relu, F.relu, rows(1), (0,)),
        "bias_gelu": lambda: (kf.bias_gelu, lambda x, b: F.gelu(x + b), (*rows(1), t(C)), (0, 1)),
        "bias_silu": lambda: (kf.bias_silu, lambda x, b: F.silu(x + b), (*rows(1), t(C)), (0, 1)),
        "swiglu": lambda: (kf.swiglu, lambda g, u: F.silu(g) * u, rows(2), (0, 1)),
        "geglu": lambda: (kf.geglu, lambda g, u: F.gelu(g) * u, rows(2), (0, 1)),
        "gemm": lambda: (lambda a, w: kf.gemm(a, w.t()), F.linear, (t(M, K), t(N, K)), (0, 1)),
        "gemm_bias_gelu": lambda: (lambda a, w, b: kf.gemm(a, w.t(), bias=b, activation="gelu"),
                                   lambda a, w, b: F.gelu(F.linear(a, w, b)), (t(M, K), t(N, K), t(N)), (0, 1, 2)),
        "flash_attention": lambda: (lambda q, k, v: kf.flash_attention(q, k, v, causal=True),
                                    lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                    tuple(t(B, H, S, D) for _ in range(3)), (0, 1, 2)),
        "cross_entropy": lambda: (kf.cross_entropy, F.cross_entropy,
                                  (t(R, V), torch.randint(0, V, (R,), device=device)), (0,)),
        "gather_scatter": lambda: (lambda x, src, dst: kf.gather_scatter(x, src, dst, nodes), gather_scatter_torch,
                                   (t(nodes, feats), ids(edges), ids(edges)), (0,)),
        "convrnn": convrnn,
    }


def _step(fn, inputs: tuple, grad_idx: tuple, backward: bool):
    """A call of fn: forward on inputs that need no gradient, or forward+backward (fresh .grad)."""
    if not backward:
        inputs = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in inputs)
        return lambda: fn(*inputs)
    inputs = tuple(x.detach().requires_grad_(i in grad_idx) if isinstance(x, torch.Tensor) else x
                   for i, x in enumerate(inputs))
    leaves = [inputs[i] for i in grad_idx]
    outs = fn(*inputs)
    outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
    grads = [torch.randn_like(o) for o in outs]
    single = len(outs) == 1

    def step():
        for leaf in leaves:
            leaf.grad = None
        y = fn(*inputs)
        if single:
            y.backward(grads[0])
        else:
            torch.autograd.backward(list(y), grads)
    return step


# ----------------------------------------------------------------------------- the run
def _error(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:160]


def _time(step, iters: int, warmup: int, device, force=None):
    """(us per call, None) or (None, why not)."""
    try:
        with kf.use_backend(force):
            return wall_us_per_call(step, calls=iters, warmup=warmup, device=device), None
    except backends.BackendUnsupportedError as err:
        return None, "n/a: " + _error(err)
    except Exception as err:  # a failing op is a row too
        return None, _error(err)


def run_op(name: str, build, args, device, forced, overhead_ns: float, sync) -> list[dict]:
    rows = []
    try:
        kf_fn, torch_fn, inputs, grad_idx = build()
    except Exception as err:
        rows = [{"op": name, "mode": mode, "us": {}, "errors": {"kf": "building the case: " + _error(err)},
                 "backends": "", "ratio": None, "over": False} for mode in ("fwd", "fwd+bwd")]
        print("\n".join(_format_row(row, forced) for row in rows), flush=True)
        return rows
    for mode in ("fwd", "fwd+bwd"):
        row = {"op": name, "mode": mode, "us": {}, "errors": {}, "backends": ""}
        variants = [("kf", kf_fn, None)] + [(b, kf_fn, b) for b in forced] + [("torch", torch_fn, None)]
        for label, fn, force in variants:
            if fn is None:
                row["errors"][label] = "n/a: no torch equivalent here"
                continue
            try:
                with kf.use_backend(force):
                    step = _step(fn, inputs, grad_idx, mode == "fwd+bwd")
            except backends.BackendUnsupportedError as err:
                us, why = None, "n/a: " + _error(err)
            except Exception as err:
                us, why = None, _error(err)
            else:
                us, why = _time(step, args.iters, args.warmup, device, force)
            if us is None:
                row["errors"][label] = why
                continue
            row["us"][label] = us
            if label == "kf":
                try:
                    with backends.recording() as used:
                        step()
                    row["backends"] = "+".join(sorted({b for (_, b) in used}))
                    row["breakdown"] = breakdown(step, max(1, min(args.iters, 300)), overhead_ns, sync)
                except Exception as err:
                    row["errors"]["breakdown"] = _error(err)
        kf_us, torch_us = row["us"].get("kf"), row["us"].get("torch")
        row["ratio"] = kf_us / torch_us if kf_us and torch_us else None
        row["over"] = row["ratio"] is not None and row["ratio"] > TARGET
        if "breakdown" in row:
            row["breakdown"]["plain_us"] = kf_us
        rows.append(row)
        print(_format_row(row, forced), flush=True)
    return rows


def _cell(row, label):
    us = row["us"].get(label)
    if us is not None:
        return f"{us:9.1f}"
    return f"{'err' if not row['errors'].get(label, 'n/a').startswith('n/a') else 'n/a':>9}"


def _header(forced) -> str:
    return (f"{'op':16s} {'mode':8s} {'kf':>9s} {'ran on':14s}" + "".join(f" {b:>9s}" for b in forced)
            + f" {'torch':>9s} {'kf/torch':>8s}")


def _format_row(row, forced) -> str:
    ratio = f"{row['ratio']:7.2f}x" if row.get("ratio") else f"{'-':>8s}"
    line = (f"{row['op']:16s} {row['mode']:8s} {_cell(row, 'kf')} {row.get('backends', '')[:14]:14s}"
            + "".join(f" {_cell(row, b)}" for b in forced) + f" {_cell(row, 'torch')} {ratio}"
            + (f"  ! over {TARGET}x" if row.get("over") else ""))
    errors = [f"{k}: {v}" for k, v in row["errors"].items() if not v.startswith("n/a")]
    return line + ("".join(f"\n    {e}" for e in errors) if errors else "")


def _print_breakdowns(rows):
    by_op = defaultdict(dict)
    for row in rows:
        if "breakdown" in row:
            by_op[row["op"]][row["mode"]] = row["breakdown"]
    for op, modes in by_op.items():
        print(f"\n== {op}: one call's host time, us (exclusive; with the wrappers in place)")
        print(f"   {'':16s}" + "".join(f" {m:>9s}" for m in modes))
        for category in CATEGORIES:
            print(f"   {category:16s}" + "".join(f" {b['us'][category]:9.2f}" for b in modes.values()))
        print(f"   {'total, wrapped':16s}" + "".join(f" {b['wrapped_total_us']:9.2f}" for b in modes.values()))
        print(f"   {'total, plain':16s}" + "".join(f" {b['plain_us']:9.2f}" for b in modes.values()))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    parser.add_argument("--iters", type=int, default=None, help="calls timed per row (default 1000; --tiny 3)")
    parser.add_argument("--out", default=None, help="directory for host_overhead.json")
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny shapes, a few calls: checks the script runs")
    args = parser.parse_args(argv)
    args.iters = args.iters or (3 if args.tiny else 1000)
    args.warmup = 1 if args.tiny else 20
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    forced = tuple(backends.BACKENDS) if cuda else ("reference",)
    torch.manual_seed(0)
    cases = _cases(device, dtype, args.tiny)
    names = [n.strip() for n in args.ops.split(",") if n.strip()] or list(cases)
    unknown = [n for n in names if n not in cases]
    if unknown:
        parser.error(f"unknown ops {unknown}; known: {', '.join(cases)}")
    overhead_ns = wrapper_overhead_ns(2000 if args.tiny else 20000)
    print(f"host time per call, us ({args.iters} calls back to back, {device} {str(dtype).removeprefix('torch.')}"
          f"{', ' + torch.cuda.get_device_name() if cuda else ''}); a wrapper adds {overhead_ns:.0f} ns")
    print(_header(forced))
    rows = []
    for name in names:
        rows += run_op(name, cases[name], args, device, forced, overhead_ns, sync)
    _print_breakdowns(rows)
    over = [f"{r['op']} {r['mode']}" for r in rows if r.get("over")]
    print(f"\nover {TARGET}x of torch eager: {', '.join(over) if over else 'none'}")
    result = {"device": str(device), "device_name": torch.cuda.get_device_name() if cuda else "cpu",
              "dtype": str(dtype), "iters": args.iters, "tiny": args.tiny, "target_ratio": TARGET,
              "torch": torch.__version__, "wrapper_overhead_ns": overhead_ns, "forced_backends": list(forced),
              "rows": rows}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "host_overhead.json").write_text(json.dumps(result, indent=1))
        print(f"wrote {out / 'host_overhead.json'}")
    return result


if __name__ == "__main__":
    main()
