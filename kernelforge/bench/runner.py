"""Run benchmark suites: every (shape, dtype, direction) of each op, every implementation,
one row each, with the roofline figures and the metadata that makes a row comparable."""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Optional, TextIO

import torch

import kernelforge as kf
from kernelforge.bench.roofline import get_ceilings, roofline
from kernelforge.bench.suite_types import Suite, Unavailable
from kernelforge.bench.suites import SUITES, kernelforge_implementations, missing_peers
from kernelforge.bench.timing import time_function

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SUITE_DTYPES = {**DTYPES, "fp8": torch.float8_e4m3fn}  # what a suite may name as its own (Suite.dtypes)
# Cases whose largest input has fewer elements than this are timed as back-to-back calls
# (per-call host overhead counts, as it does in a model); larger ones with an L2 flush
# before each run.
BACK_TO_BACK_BELOW = 1 << 20


def metadata(device: torch.device) -> dict:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    commit = os.environ.get("KERNELFORGE_COMMIT")
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or "unknown"
        except OSError:
            commit = "unknown"
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)",
        "device_type": device.type,
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": version("triton"),
        "python": platform.python_version(), "commit": commit,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def progress_bar(done: int, total: int, width: int = 20) -> str:
    filled = width * done // max(total, 1)
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def prepare_call(fn, inputs: tuple, direction: str):
    """A no-argument callable running one forward or forward+backward of fn on inputs (which
    may hold non-tensors, e.g. attention's causal flag, passed along as they are)."""
    if direction == "fwd":
        return lambda: fn(*inputs)
    leaves = tuple(t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                   for t in inputs)
    differentiable = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    out = fn(*leaves)  # a tensor, or a tuple of them (add_*_norm: y and the new residual)
    grad_out = tuple(torch.randn_like(o) for o in out) if isinstance(out, tuple) else torch.randn_like(out)
    backend = getattr(fn, "forced_backend", None)
    if backend is None:
        return lambda: torch.autograd.grad(fn(*leaves), differentiable, grad_out)

    def forced():  # the backward ops pick their backend when autograd runs them: force it there too
        with kf.use_backend(backend):
            return torch.autograd.grad(fn(*leaves), differentiable, grad_out)

    return forced


def peak_extra_mib(call, device: torch.device) -> float:
    """Memory one call allocates beyond what is allocated before it, at its peak (MiB): a forward's
    temporaries, or a forward+backward's saved tensors and gradients. One extra, untimed call."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    call()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def _do_bench_row(fn, inputs: tuple, base: dict) -> dict:
    """The same forward timed independently by triton.testing.do_bench (median)."""
    import triton.testing

    ms = triton.testing.do_bench(lambda: fn(*inputs), return_mode="median")
    keep = ("op", "shape", "dtype", "direction")
    return {**{k: base[k] for k in keep}, "impl": f"{base['impl']} (triton.testing.do_bench)", "timing": "do_bench",
            "ms": ms}


def run_suite(suite: Suite, dtypes: list[str], device: torch.device, quick: bool, backends_only: Optional[list[str]],
              repeat: int, ceilings, progress: Optional[TextIO] = None, crosscheck: bool = False,
              left_out: Optional[dict] = None) -> list[dict]:
    """The rows of one suite. An implementation raising Unavailable has no row; its reason
    is counted in `left_out` ({"impl: reason": cases})."""
    shapes = suite.quick_shapes if quick or device.type == "cpu" else suite.shapes
    cases = [(s, d, direction) for d in suite.dtypes or dtypes for s in shapes for direction in suite.directions]
    baselines = suite.baselines() if backends_only is None else {}
    variants = suite.variants() if backends_only is None else {}
    kernel_only = suite.kernel_only() if device.type == "cuda" and backends_only is None else {}
    left_out = {} if left_out is None else left_out
    warmup = 5 if quick else 10
    if suite.max_repeat:
        repeat, warmup = min(repeat, suite.max_repeat), min(warmup, 3)
    rows = []
    for i, (shape, dtype_name, direction) in enumerate(cases, 1):
        # torch.compile keeps 8 graphs per function (recompile_limit) and then runs it eager,
        # silently: start each case afresh so every case's compiled baselines are compiled.
        torch._dynamo.reset()
        dtype = SUITE_DTYPES[dtype_name]
        inputs = suite.make_inputs(shape, dtype, device)
        impls = {**kernelforge_implementations(suite, inputs, backends_only, direction), **variants, **baselines}
        if direction == "fwd":
            impls.update(kernel_only)
        cost = suite.cost(shape, dtype, direction)
        small = max(t.numel() for t in inputs if isinstance(t, torch.Tensor)) < BACK_TO_BACK_BELOW
        for name, fn in impls.items():
            row = {"op": suite.op, "shape": suite.label(shape), "dtype": dtype_name, "direction": direction,
                   "impl": name, "timing": "back-to-back" if small else "L2 flushed"}
            try:
                call = prepare_call(fn, inputs, direction)
                t = time_function(call, device, warmup=warmup, repeat=repeat, back_to_back=small)
                row.update(ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms, **roofline(cost, t.median_ms, ceilings))
                if device.type == "cuda":
                    row["peak_mib"] = peak_extra_mib(call, device)
            except Unavailable as why:  # cannot take this case here: no row, a note
                note = f"{name}: {why}"
                left_out[note] = left_out.get(note, 0) + 1
                row = None
            except Exception as err:  # a failing implementation is reported, not dropped
                row["error"] = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"
            if row is not None:
                rows.append(row)
            if crosscheck and row is not None and "ms" in row and name == "kernelforge" and direction == "fwd" \
                    and not small and device.type == "cuda":
                check = _do_bench_row(fn, inputs, row)
                rows.append({**check, **roofline(cost, check["ms"], ceilings)})
            if progress is not None:
                result = "left out" if row is None else f"{row['ms']:.4f} ms" if "ms" in row else "FAILED"
                progress.write(f"{progress_bar(i, len(cases))} {suite.op} {suite.label(shape)} {dtype_name} "
                               f"{direction} {name}: {result}\n")
                progress.flush()
        del inputs
    return rows


def run_bench(ops: list[str], dtypes: list[str], device: torch.device | str, quick: bool = False,
              backends_only: Optional[list[str]] = None, repeat: Optional[int] = None,
              progress: Optional[TextIO] = None, crosscheck: bool = False,
              suites: Optional[dict[str, Suite]] = None) -> dict:
    """Benchmark `ops` (names in SUITES or in `suites`, or ["all"]); returns {"meta", "ceilings",
    "rows"}. `progress`, a text stream, gets one line per measurement as it completes.
    `crosscheck` (GPU) re-times kernelforge's forward with triton.testing.do_bench in an extra
    row. `suites`: more suites by name, e.g. a new op's own script (benchmarks/bench_<op>.py)."""
    device = torch.device(device)
    known = {**SUITES, **(suites or {})}
    names = list(known) if ops == ["all"] else ops
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"no benchmark suite for {unknown}; known: {sorted(known)} or 'all'")
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise ValueError(f"unknown dtype(s) {bad}; expected some of {sorted(DTYPES)}")
    ceilings = get_ceilings(device)
    repeat = repeat or (10 if quick or device.type == "cpu" else 100)
    rows = []
    meta = metadata(device)
    meta["missing_peers"], meta["left_out"] = {}, {}
    for name in names:
        meta["left_out"][name] = {}
        rows += run_suite(known[name], dtypes, device, quick, backends_only, repeat, ceilings, progress, crosscheck,
                          meta["left_out"][name])
        meta["missing_peers"][name] = missing_peers(known[name])
    return {"meta": meta, "ceilings": ceilings.as_dict(), "rows": rows}
