"""Benchmark results on disk: JSON (everything), CSV (one row per measurement, metadata on
every row), Markdown (a table per op), PNG (a chart per op); and comparisons of two runs."""
from __future__ import annotations

import csv
import json
from pathlib import Path

META_COLUMNS = ("device", "torch", "cuda", "triton", "python", "commit", "timestamp")
ROW_COLUMNS = ("op", "shape", "dtype", "direction", "impl", "timing", "ms", "p20_ms", "p80_ms", "gbps", "tflops",
               "pct_of_ceiling", "ceiling", "peak_mib", "error")
# The rows a "speedup" is measured against (the best of those present): PyTorch, and for
# attention SDPA's backends (FlashAttention-2, cuDNN, its own choice) and FlexAttention.
BASELINES = ("torch eager", "torch.compile", "sdpa flash", "sdpa cudnn", "sdpa", "flex attention")
# A row run another way (replayed from a CUDA graph) is measured against the baselines run
# the same way, named with the same suffix.
WAYS = (" (CUDA graph)",)


def write_results(result: dict, out_dir: Path | str, stem: str = "bench") -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.csv", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(result, indent=1))
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=ROW_COLUMNS + META_COLUMNS)
        writer.writeheader()
        for row in result["rows"]:
            writer.writerow({**{k: row.get(k) for k in ROW_COLUMNS}, **{k: result["meta"].get(k) for k in META_COLUMNS}})
    paths[2].write_text(markdown(result))
    for op in dict.fromkeys(r["op"] for r in result["rows"]):
        paths.append(plot_op(result, op, out / f"{stem}-{op}.png"))
    return paths


def best_baseline_ms(rows: list[dict], row: dict):
    way = next((w for w in WAYS if row["impl"].endswith(w)), "")
    names = {b + way for b in BASELINES}
    peers = [r["ms"] for r in rows if r["impl"] in names and "ms" in r
             and all(r[k] == row[k] for k in ("op", "shape", "dtype", "direction"))]
    return min(peers) if peers else None


def markdown(result: dict) -> str:
    meta, ceilings, rows = result["meta"], result["ceilings"], result["rows"]
    rates = ", ".join(f"{k} {v:.0f} TFLOP/s" for k, v in ceilings.get("matmul_tflops", {}).items())
    lines = [
        f"# kernelforge bench on {meta['device']}",
        "",
        f"torch {meta['torch']} (CUDA {meta['cuda']}), Triton {meta['triton']}, Python {meta['python']}, "
        f"commit {meta['commit']}, {meta['timestamp']}.",
        f"Ceilings (measured {ceilings.get('measured_at', '')}): copy {ceilings['copy_gbps']:.0f} GB/s (read + write)"
        + (f"; matmul {rates}" if rates else "") + ".",
        "Median of many runs; cases whose largest input is under 1M elements back to back (per-call overhead "
        "counts), larger ones with an L2 flush before each run. Speedup is against the best of eager and "
        "torch.compile (attention: of the SDPA backends, FlexAttention and eager); a row replayed from a CUDA "
        "graph against the baselines replayed the same way. Peak MiB (GPU): memory one call allocates beyond its "
        "inputs at its peak (for fwd+bwd, the forward's saved tensors and the gradients).",
    ]
    missing = {op: m for op, m in meta.get("missing_peers", {}).items() if m}
    if missing:
        lines.append("Peers not installed here: " + "; ".join(f"{op}: {', '.join(m)}" for op, m in missing.items()) + ".")
    for op in dict.fromkeys(r["op"] for r in rows):
        lines += ["", f"## {op}"]
        notes = meta.get("left_out", {}).get(op, {})
        if notes:
            lines += ["", "Left out: " + "; ".join(f"{note} ({n} case{'s' if n > 1 else ''})"
                                                   for note, n in notes.items()) + "."]
        lines += ["", "| shape | dtype | direction | implementation | ms | GB/s | TFLOP/s | % of ceiling | speedup "
                  "| peak MiB |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["op"] == op):
            head = f"| {r['shape']} | {r['dtype']} | {r['direction']} | {r['impl']} |"
            if "error" in r:
                lines.append(f"{head} FAILED: {r['error']} | | | | | |")
                continue
            best = best_baseline_ms(rows, r)
            tflops = f"{r['tflops']:.1f}" if r.get("tflops") is not None else ""
            pct = f"{r['pct_of_ceiling']:.1f}" if r.get("pct_of_ceiling") is not None else ""
            speed = f"{best / r['ms']:.2f}x" if best else ""
            peak = f"{r['peak_mib']:.0f}" if r.get("peak_mib") is not None else ""
            lines.append(f"{head} {r['ms']:.4f} | {r['gbps']:.0f} | {tflops} | {pct} | {speed} | {peak} |")
    return "\n".join(lines) + "\n"


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or a clear error naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("kernelforge's benchmark plots need matplotlib: pip install 'kernelforge[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_op(result: dict, op: str, path: Path) -> Path:
    """Grouped bars: % of the ceiling per case (shape, dtype, direction), one bar per implementation."""
    plt = pyplot()

    rows = [r for r in result["rows"] if r["op"] == op and r.get("pct_of_ceiling") is not None]
    cases = list(dict.fromkeys((r["shape"], r["dtype"], r["direction"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    width = 0.8 / max(len(impls), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cases) + 2), 4.5))
    for j, impl in enumerate(impls):
        values = [next((r["pct_of_ceiling"] for r in rows if (r["shape"], r["dtype"], r["direction"]) == c
                        and r["impl"] == impl), 0.0) for c in cases]
        ax.bar([i + j * width for i in range(len(cases))], values, width, label=impl)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels([f"{s}\n{d} {direction}" for s, d, direction in cases], fontsize=7)
    ax.set_ylabel("% of measured ceiling")
    ax.set_title(f"{op} on {result['meta']['device']}")
    if impls:  # (none with a % of ceiling: bf16 on the CPU, whose ceiling is fp32's)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compare(old: dict, new: dict, tolerance: float = 0.03) -> tuple[str, list[dict]]:
    """Speedup of `new` over `old` for every measurement both have. A regression is a row
    slower by more than `tolerance` whose new 20% quantile is above the old 80% one (so
    the two runs' spreads do not overlap): beyond noise. Returns (report text, regressions)."""
    def key(r):
        return r["op"], r["shape"], r["dtype"], r["direction"], r["impl"]

    before = {key(r): r for r in old["rows"] if "ms" in r}
    lines = [f"old: {old['meta']['device']} commit {old['meta']['commit']} ({old['meta']['timestamp']})",
             f"new: {new['meta']['device']} commit {new['meta']['commit']} ({new['meta']['timestamp']})", ""]
    regressions = []
    for r in new["rows"]:
        o = before.get(key(r))
        if o is None or "ms" not in r:
            continue
        speedup = o["ms"] / r["ms"]
        regressed = r["ms"] > o["ms"] * (1 + tolerance) and r.get("p20_ms", r["ms"]) > o.get("p80_ms", o["ms"])
        if regressed:
            regressions.append({**r, "old_ms": o["ms"], "speedup": speedup})
        lines.append(f"{'REGRESSION ' if regressed else ''}{' '.join(key(r))}: {o['ms']:.4f} -> {r['ms']:.4f} ms "
                     f"({speedup:.2f}x)")
    lines.append("")
    lines.append(f"{len(regressions)} regression(s) beyond noise" if regressions else "no regressions beyond noise")
    return "\n".join(lines) + "\n", regressions
