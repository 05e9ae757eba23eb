"""Time kernelforge.gather_scatter (the Triton kernel, forced) against torch's index_select +
index_add_ (kernelforge's reference: what the GNN's native level runs) and torch.compile of that
reference, at the demo GNN's sizes (kernelforge/demo.py: 256 graphs of 400 nodes, N = 102400, 8
random in-graph edges a node, E = 819200), F in (128, 256), bf16 and fp32, sum and mean; forward
and forward+backward (the gradient of x). Prints a Markdown table.

    PYTHONPATH=. python benchmarks/gather_scatter_bench.py [--quick] [--sweep] [--out DIR]

--quick: F=128 bf16 only. --sweep: also time Triton block shapes for each forward case (the
defaults in kernelforge/triton/gather_scatter.py were not tuned on a GPU). --out: write the rows
as JSON and the table as Markdown there. --tiny: a few small graphs, on the CPU where there is no
GPU (Triton through TRITON_INTERPRET=1): checks that the script runs, times nothing of interest.

Every implementation's output (and gradient) is checked against the eager reference before it
is timed; a wrong one gets a row saying so and no time. Timing: kernelforge.bench.timing's
time_function (CUDA events, L2 flushed before each run, median).

Bytes counted (the floor a fused kernel could reach): forward E*F*elt (each message gathered
once) + N*F*elt (each output row written once); forward+backward twice that (the backward
gathers grad_out's rows at dst and writes grad_x's N rows). Not counted: the ids (16 bytes an
edge), the float32 accumulator's zero fill and atomics and the finishing pass of the Triton
kernel, index_select's (E, F) intermediate written and read back by index_add_ (eager). So GB/s
is the rate of useful bytes, not of traffic. "peak MB": memory allocated above the inputs during
one call (eager's (E, F) messages show up there).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
from pathlib import Path

import torch

import kernelforge as kf
from kernelforge.bench.timing import time_function
from kernelforge.demo import _random_graphs
from kernelforge.reference.gather_scatter import gather_scatter as reference_gather_scatter

GRAPH = (256, 400, 8)  # graphs, nodes a graph, edges a node: the demo's realistic GNN input
TINY_GRAPH = (4, 50, 4)
FEATURES = (128, 256)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
REDUCES = ("sum", "mean")
# A guard against gross errors, of max |reference| (the tests hold the real accuracy bounds): bf16 takes
# 3e-2 because the eager reference's own backward (index_select's) adds the E gathered gradients
# with bf16 atomics, several roundings an element in a run-dependent order: two eager runs differed by
# 1.2e-2 on the H200. float32: summation order only.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 2e-5}


def forced_triton(x, src, dst, num_nodes, reduce):
    with kf.use_backend("triton"):
        return kf.gather_scatter(x, src, dst, num_nodes, reduce)


def implementations() -> dict:
    """name -> fn(x, src, dst, num_nodes, reduce). A fresh torch.compile per case (the caller
    resets dynamo): it keeps 8 graphs a function and then runs eagerly, silently."""
    return {
        "kernelforge (triton)": forced_triton,
        "torch eager (index_select + index_add_)": reference_gather_scatter,
        "torch.compile (reference)": torch.compile(reference_gather_scatter, dynamic=False),
    }


def make_call(fn, x, src, dst, reduce, direction, grad):
    """A no-argument callable: one forward, or one forward + backward (the gradient of x), the
    backward inside the forced backend too (autograd runs it when torch.autograd.grad does)."""
    num_nodes = x.shape[0]
    if direction == "fwd":
        return lambda: fn(x, src, dst, num_nodes, reduce)
    leaf = x.detach().requires_grad_()
    if fn is forced_triton:
        def run():
            with kf.use_backend("triton"):
                return torch.autograd.grad(kf.gather_scatter(leaf, src, dst, num_nodes, reduce), leaf, grad)
        return run
    return lambda: torch.autograd.grad(fn(leaf, src, dst, num_nodes, reduce), leaf, grad)


def max_rel_diff(got, want) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-30)).item()


def peak_extra_mb(call, device) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def copy_gbps(device) -> float:
    """Measured device-to-device copy rate of 1 GiB of bf16 (read + write counted): the ceiling."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(2**29, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    t = time_function(lambda: b.copy_(a), device, warmup=5, repeat=30)
    return 2 * a.numel() * a.element_size() / (t.median_ms * 1e-3) / 1e9


def sweep(x, src, dst, reduce, device, repeat) -> list[dict]:
    """Forward times of the Triton kernel over block shapes (the default's rank among them)."""
    from kernelforge.triton import gather_scatter as tgs

    n_cols = x.shape[1]
    default = tgs.default_config(n_cols)
    want = reference_gather_scatter(x, src, dst, x.shape[0], reduce)
    configs = [default] + [
        tgs.Config(block_e, block_f, warps)
        for block_e, block_f, warps in itertools.product((16, 32, 64, 128), (32, 64, 128, 256), (2, 4, 8))
        if block_f <= max(32, n_cols) and 4 <= block_e * block_f / (warps * 32) <= 64]
    results = []
    for cfg in dict.fromkeys(configs):  # the default first, once
        call = functools.partial(tgs.gather_scatter_rows, x, src, dst, x.shape[0], reduce == "mean", config=cfg)
        if max_rel_diff(call(), want) > TOLERANCE[x.dtype]:
            results.append({"config": repr(cfg), "ms": None, "note": "WRONG"})
            continue
        t = time_function(call, device, warmup=3, repeat=repeat)
        results.append({"config": repr(cfg), "ms": t.median_ms, "default": cfg == default})
    results.sort(key=lambda r: float("inf") if r["ms"] is None else r["ms"])
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        parser.error("needs a CUDA GPU (--tiny runs a small case on the CPU, for checking the script)")
    graph = TINY_GRAPH if args.tiny else GRAPH
    features = (16,) if args.tiny else FEATURES[:1] if args.quick else FEATURES
    dtypes = {"fp32": torch.float32} if args.tiny else {"bf16": torch.bfloat16} if args.quick else DTYPES
    repeat = 3 if args.tiny else args.repeat

    ceiling = copy_gbps(device)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
          f"copy ceiling {ceiling:.0f} GB/s (1 GiB bf16, read + write)", flush=True)
    rows, sweeps = [], []
    for n_cols, (dname, dtype), reduce in itertools.product(features, dtypes.items(), REDUCES):
        torch._dynamo.reset()
        x, edge_index, _ = _random_graphs(*graph, n_cols, device, dtype)
        src, dst = edge_index[0], edge_index[1]
        n_nodes, n_edges = x.shape[0], src.shape[0]
        grad = torch.randn_like(x)
        leaf = x.detach().requires_grad_()
        want = reference_gather_scatter(leaf, src, dst, n_nodes, reduce)
        (want_grad,) = torch.autograd.grad(want, leaf, grad)
        elt = x.element_size()
        useful = n_edges * n_cols * elt + n_nodes * n_cols * elt
        case_rows = []
        for name, fn in implementations().items():
            for direction in ("fwd", "fwd+bwd"):
                row = {"F": n_cols, "dtype": dname, "reduce": reduce, "direction": direction, "impl": name,
                       "N": n_nodes, "E": n_edges}
                call = make_call(fn, x, src, dst, reduce, direction, grad)
                got = call()
                diff = max_rel_diff(got if direction == "fwd" else got[0], want if direction == "fwd" else want_grad)
                row["max_rel_diff"] = diff
                case_rows.append(row)
                if not diff <= TOLERANCE[dtype]:
                    row["error"] = f"WRONG: max |diff| / max |reference| = {diff:.2e}"
                    print(json.dumps(row), flush=True)
                    continue
                t = time_function(call, device, warmup=3 if args.tiny else 10, repeat=repeat)
                nbytes = useful * (1 if direction == "fwd" else 2)
                row.update(ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms,
                           gbps=nbytes / (t.median_ms * 1e-3) / 1e9, peak_mb=peak_extra_mb(call, device))
                row["pct_copy"] = float("nan") if math.isnan(ceiling) else 100 * row["gbps"] / ceiling
                print(json.dumps(row), flush=True)
        eager_ms = {r["direction"]: r.get("ms", math.nan) for r in case_rows if r["impl"].startswith("torch eager")}
        for r in case_rows:
            r["speedup_vs_eager"] = eager_ms[r["direction"]] / r["ms"] if "ms" in r else math.nan
        rows += case_rows
        if args.sweep:
            entry = {"F": n_cols, "dtype": dname, "reduce": reduce,
                     "configs": sweep(x.contiguous(), src, dst, reduce, device, repeat)}
            sweeps.append(entry)
            best = entry["configs"][:3]
            rank = next((i for i, r in enumerate(entry["configs"]) if r.get("default")), None)
            print(f"sweep F={n_cols} {dname} {reduce}: best {best}; default ranks {rank}", flush=True)
        del x, edge_index, src, dst, grad, leaf, want, want_grad
        if device.type == "cuda":
            torch.cuda.empty_cache()

    table = markdown(rows, ceiling)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gather_scatter_bench.json").write_text(json.dumps({"copy_gbps": ceiling, "rows": rows,
                                                                   "sweeps": sweeps}, indent=1))
        (out / "gather_scatter_bench.md").write_text(table)
    return 0


def markdown(rows, ceiling) -> str:
    lines = [f"Copy ceiling {ceiling:.0f} GB/s. GB/s counts E*F*elt gathered + N*F*elt written (x2 for "
             "forward+backward), not the ids, the accumulator's traffic or eager's intermediate.", "",
             "| F | dtype | reduce | direction | impl | ms | GB/s | % copy | peak MB | x eager |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['F']} | {r['dtype']} | {r['reduce']} | {r['direction']} | {r['impl']} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} | | | | |")
        else:
            lines.append(f"{head} {r['ms']:.3f} | {r['gbps']:.0f} | {r['pct_copy']:.0f} | {r['peak_mb']:.0f} | "
                         f"{r['speedup_vs_eager']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
