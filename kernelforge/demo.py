"""`kernelforge demo` (what `make demo` runs): the progressive-optimization demo.

Each example model (kernelforge.models) runs at every level this machine can run (native
PyTorch, TorchScript, torch.compile, Triton kernels, CUDA kernels) on the same weights and
inputs. Every level's output is checked against a higher-precision run of the native level
(float64 for float32 models, float32 for bf16 ones) by the test suite's rule: its error at most
twice the native level's own error in the same dtype, plus a small floor. Then each level is
timed (median of repeated calls, synchronized) with its peak GPU memory, and the results are
written as a table (stdout, demo.md), JSON (demo.json) and a plot (demo.png).

The decode workload generates greedily with LanguageModel.generate (a static KV cache, the step
in a CUDA graph on a GPU): its rate counts the decode steps only (the prefill's time is its own
column), and its roofline is the fraction of the memory-bandwidth limit, the bytes a step must
read (every parameter, the filled KV cache) over the measured copy bandwidth
(kernelforge.bench.roofline), divided by the measured time per token. Its check: the logits of the
prompt's last token and of the first decode step (the same next token at every level) against the
native level in higher precision, by the same rule (greedy tokens may legitimately diverge in bf16).

Sizes: on a GPU, realistic ones (the LM at dim 1024, 8 layers, seq 2048, bf16; ViT-B/16 at
batch 64; decoding an LM of dim 2048, 16 layers, batch 1, a 512-token prompt, 128 new tokens);
on a CPU, small ones.
"""
from __future__ import annotations

import copy
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, TextIO

import torch

from kernelforge import backends
from kernelforge.bench.roofline import get_ceilings
from kernelforge.bench.timing import time_function
from kernelforge.models import (EXTRA_LEVELS, FASTEST, LEVELS, GraphNeuralNetwork, LanguageModel, VisionTransformer,
                                why_level_unavailable)
from kernelforge.models.decoding import sample

DEMO_LEVELS = LEVELS + (FASTEST,)


@dataclass
class Workload:
    """One thing to run at every level: a model, its inputs, and what one call does."""
    name: str
    model: torch.nn.Module
    inputs: tuple
    units: float  # items one call processes (tokens, images, graphs) for the rate column
    unit_name: str
    training: bool = False  # one call = forward, loss, backward and an optimizer step
    decode_tokens: int = 0  # > 0: a decode workload, inputs = (prompt,), one call generates this many tokens


@dataclass
class Row:
    workload: str
    level: str
    status: str  # "ok", "FAIL", or why the level did not run
    max_error: float = math.nan
    error_bound: float = math.nan
    first_call_s: float = math.nan  # includes tracing / compiling
    median_ms: float = math.nan
    rate: float = math.nan
    unit_name: str = ""
    peak_mem_mb: float = math.nan
    backends: dict = field(default_factory=dict)
    prefill_ms: float = math.nan  # decode: the prompt's prefill (and its token); median_ms is per token
    bandwidth_pct: float = math.nan  # decode: % of the memory-bandwidth limit per token


def random_graphs(graphs: int, nodes_per_graph: int, edges_per_node: int, features: int, device, dtype):
    """`graphs` random graphs batched into one: x (N, F), edge_index (2, E), batch (N,)."""
    n = graphs * nodes_per_graph
    src = torch.randint(0, nodes_per_graph, (n * edges_per_node,), device=device)
    dst = torch.randint(0, nodes_per_graph, (n * edges_per_node,), device=device)
    offset = torch.arange(graphs, device=device).repeat_interleave(nodes_per_graph * edges_per_node) * nodes_per_graph
    edge_index = torch.stack([src + offset, dst + offset])
    batch = torch.arange(graphs, device=device).repeat_interleave(nodes_per_graph)
    return torch.randn(n, features, device=device, dtype=dtype), edge_index, batch


def workloads(device: torch.device, dtype: torch.dtype, realistic: bool) -> list[Workload]:
    if realistic:
        lm_cfg, batch, seq = dict(vocab_size=32000, dim=1024, n_layers=8, n_heads=16, max_seq_len=2048), 8, 2048
        vit_cfg, images = dict(image_size=224, patch_size=16, num_classes=1000), 64
        gnn_cfg, graph = dict(node_features=128, hidden=256, num_classes=10, layers=3), (256, 400, 8)
        decode_cfg, decode = dict(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, max_seq_len=2048), (1, 512, 128)
    else:
        lm_cfg, batch, seq = dict(vocab_size=256, dim=128, n_layers=2, n_heads=4, max_seq_len=128), 4, 128
        vit_cfg, images = dict(image_size=32, patch_size=8, num_classes=10, dim=128, depth=2, heads=4), 8
        gnn_cfg, graph = dict(node_features=32, hidden=64, num_classes=10, layers=3), (8, 50, 4)
        decode_cfg, decode = dict(vocab_size=256, dim=128, n_layers=2, n_heads=4, max_seq_len=128), (1, 32, 16)
    lm = LanguageModel(**lm_cfg).to(device, dtype)
    ids = torch.randint(0, lm_cfg["vocab_size"], (batch, seq), device=device)
    vit = VisionTransformer(**vit_cfg).to(device, dtype)
    gnn = GraphNeuralNetwork(**gnn_cfg).to(device, dtype)
    x, edge_index, graph_of_node = random_graphs(*graph, gnn_cfg["node_features"], device, dtype)
    return [
        Workload("LM forward", lm.eval(), (ids,), batch * seq, "tok/s"),
        Workload("LM train step", copy.deepcopy(lm).train(), (ids,), batch * seq, "tok/s", training=True),
        Workload("ViT forward", vit.eval(), (torch.randn(images, 3, vit_cfg["image_size"], vit_cfg["image_size"],
                                                         device=device, dtype=dtype),), images, "img/s"),
        Workload("GNN forward", gnn.eval(), (x, edge_index, graph_of_node, graph[0]), graph[0], "graphs/s"),
        # its own model (1.8 GB in bf16 on a GPU), shared by its levels: no copy per level
        Workload("LM decode", LanguageModel(**decode_cfg).to(device, dtype).eval(),
                 (torch.randint(0, decode_cfg["vocab_size"], decode[:2], device=device),), decode[0], "tok/s",
                 decode_tokens=decode[2]),
    ]


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable:
    """Next-token loss, backward and an AdamW step (inside the level's kernel scope, so the
    backward ops run on the level's backend too). Returns (loss, gradient norm): the check
    compares both, so a wrong backward cannot pass on a right loss."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step(ids):
        with model.kernel_scope():
            loss = model.loss(ids)
            loss.backward()
        grad_norm = torch.stack([n.float() for n in torch._foreach_norm([p.grad for p in params])]).norm()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return torch.stack([loss.detach(), grad_norm])

    return step


def _runner(work: Workload, model: torch.nn.Module) -> Callable:
    if work.training:
        step = _train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        return lambda: step(*work.inputs)

    def infer():
        with torch.no_grad():
            return model(*work.inputs)

    return infer


def _oracle_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float32 else torch.float32


def _reference_outputs(work: Workload, dtype: torch.dtype):
    """(oracle output, native output in the tested dtype) for the accuracy check. A training
    step is checked by its first loss and gradient norm, from the same weights."""
    def first(model, inputs):
        model = copy.deepcopy(model).set_level("native")
        return _runner(Workload(work.name, model, inputs, 0, "", work.training), model)().double()

    cast = tuple(t.to(_oracle_dtype(dtype)) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                 for t in work.inputs)
    return first(work.model.to(_oracle_dtype(dtype)), cast), first(work.model.to(dtype), work.inputs)


def _first_call(call: Callable, device: torch.device):
    """(call's output, its seconds, the backends it ran on): the first call at a level, tracing,
    compiling and capturing included; the device's peak memory counts from here."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    with backends.recording() as ran:
        out = call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start, ran


def run_workload(work: Workload, levels, device: torch.device, dtype: torch.dtype, repeat: int) -> list[Row]:
    if work.decode_tokens:
        return run_decode_workload(work, levels, device, dtype, repeat)
    expected, native = _reference_outputs(work, dtype)
    native_err = (native - expected).abs().max().item()
    bound = 2 * native_err + 1e-5 * expected.abs().max().item()
    rows = []
    for level in levels:
        why = why_level_unavailable(level, device)
        if why is not None:
            rows.append(Row(work.name, level, f"not run: {why}"))
            continue
        model = copy.deepcopy(work.model).set_level(level)
        call = _runner(work, model)
        out, first_s, ran = _first_call(call, device)
        err = (out.double() - expected).abs().max().item()
        timing = time_function(call, device, warmup=2, repeat=repeat, back_to_back=True, calls_per_sample=1)
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else math.nan
        rows.append(Row(work.name, level, "ok" if err <= bound else "FAIL", err, bound, first_s, timing.median_ms,
                        work.units / (timing.median_ms * 1e-3), work.unit_name, peak,
                        {f"{op}:{backend}": calls for (op, backend), calls in sorted(ran.items())}))
        del model, call
    return rows


def _decode_logits(model: LanguageModel, prompt: torch.Tensor, total: int, next_token=None):
    """(the logits of the prompt's last token and of the first decode step, float64; the step's token):
    through the decoder generate uses (the same cache and graphs), the step fed next_token (default
    the prefill's most likely token)."""
    decoder = model.decoder(prompt.shape[0], total, prompt.dtype, prompt.device)
    first = decoder.prefill(prompt).double()  # a copy: a graph's output is overwritten by the next step
    if next_token is None:
        next_token = first.argmax(-1, keepdim=True)
    return torch.stack([first, decoder.step(next_token).double()]), next_token


def _decode_bytes_per_token(model: LanguageModel, batch: int, prompt: int, new: int) -> float:
    """The least a decode step reads, averaged over generate's steps: every parameter once (the tied
    embedding in full, by the head; one row of the position table) and every layer's filled keys and
    values (the steps feed positions prompt .. prompt + new - 2 and read one row past each)."""
    cfg = model.config
    params = sum(p.numel() for p in model.parameters()) - model.pos_emb.weight.numel() + cfg.dim
    kv = 2 * cfg.n_layers * batch * cfg.dim * (prompt + new / 2)
    return (params + kv) * model.tok_emb.weight.element_size()


def run_decode_workload(work: Workload, levels, device: torch.device, dtype: torch.dtype, repeat: int) -> list[Row]:
    """Greedy generate at each level on one model (set_level switches it: same parameters, no copy);
    per-token time = (generate's time - the prefill's) / the steps."""
    model, (prompt,), new = work.model, work.inputs, work.decode_tokens
    batch, total = prompt.shape[0], prompt.shape[1] + new
    model.to(_oracle_dtype(dtype)).set_level("native")  # in place and back: both conversions are exact
    expected, next_token = _decode_logits(model, prompt, total)
    native, _ = _decode_logits(model.to(dtype).set_level("native"), prompt, total, next_token)
    native_err = (native - expected).abs().max().item()
    bound = 2 * native_err + 1e-5 * expected.abs().max().item()
    limit_s = _decode_bytes_per_token(model, batch, prompt.shape[1], new) / (get_ceilings(device).copy_gbps * 1e9)
    repeat = min(repeat, 5)  # a call is a whole generation
    rows = []
    for level in levels:
        why = why_level_unavailable(level, device)
        if why is not None:
            rows.append(Row(work.name, level, f"not run: {why}"))
            continue
        model.set_level(level)
        generate = lambda: model.generate(prompt, new, temperature=0)  # noqa: E731
        _, first_s, ran = _first_call(generate, device)  # compiles, captures
        decoder = model.decoder(batch, total, prompt.dtype, device)
        times = [time_function(fn, device, warmup=1, repeat=repeat, back_to_back=True, calls_per_sample=1).median_ms
                 for fn in (generate, lambda: sample(decoder.prefill(prompt), 0, None, None))]
        per_token_ms = (times[0] - times[1]) / max(1, new - 1)
        out, _ = _decode_logits(model, prompt, total, next_token)  # after the timing: the graphs replay
        err = (out - expected).abs().max().item()
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else math.nan
        rows.append(Row(work.name, level, "ok" if err <= bound else "FAIL", err, bound, first_s, per_token_ms,
                        batch / (per_token_ms * 1e-3), work.unit_name, peak,
                        {f"{op}:{backend}": calls for (op, backend), calls in sorted(ran.items())},
                        times[1], 100 * limit_s / (per_token_ms * 1e-3)))
    model.set_level("native")  # lets the last level's graphs go
    return rows


def format_table(rows: list[Row]) -> str:
    header = (f"| {'workload':<14} | {'level':<11} | {'check':<5} | {'max err':>8} | {'first call s':>12} "
              f"| {'median ms':>10} | {'rate':>16} | {'vs native':>9} | {'peak MiB':>8} | {'prefill ms':>10} "
              f"| {'% BW limit':>10} |")
    lines = [header, "|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|"]
    native = {r.workload: r.median_ms for r in rows if r.level == "native" and r.status in ("ok", "FAIL")}
    for r in rows:
        if r.status not in ("ok", "FAIL"):
            lines.append(f"| {r.workload:<14} | {r.level:<11} | {'-':<5} | {r.status}")
            continue
        speedup = native.get(r.workload, math.nan) / r.median_ms
        mem = "-" if math.isnan(r.peak_mem_mb) else f"{r.peak_mem_mb:8.0f}"
        prefill = "-" if math.isnan(r.prefill_ms) else f"{r.prefill_ms:10.3f}"
        bandwidth = "-" if math.isnan(r.bandwidth_pct) else f"{r.bandwidth_pct:9.1f}%"
        lines.append(f"| {r.workload:<14} | {r.level:<11} | {r.status:<5} | {r.max_error:8.1e} | "
                     f"{r.first_call_s:12.2f} | {r.median_ms:10.3f} | {r.rate:>10.4g} {r.unit_name:<5} | "
                     f"{speedup:8.2f}x | {mem:>8} | {prefill:>10} | {bandwidth:>10} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path, title: str) -> Path:
    from kernelforge.bench.report import pyplot

    plt = pyplot()
    names = list(dict.fromkeys(r.workload for r in rows))
    levels = [lv for lv in LEVELS + EXTRA_LEVELS if any(r.level == lv and r.status in ("ok", "FAIL") for r in rows)]
    native = {r.workload: r.median_ms for r in rows if r.level == "native"}
    fig, ax = plt.subplots(figsize=(1.9 * len(names) + 2, 4.2))
    width = 0.8 / max(1, len(levels))
    for i, level in enumerate(levels):
        speed = [next((native[n] / r.median_ms for r in rows if r.workload == n and r.level == level
                       and r.status in ("ok", "FAIL")), 0.0) for n in names]
        ax.bar([j + (i - (len(levels) - 1) / 2) * width for j in range(len(names))], speed, width, label=level)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("speed relative to native (higher is faster)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class UnknownWorkloadError(ValueError):
    """run_demo(only=...) names a workload the demo does not have."""


def _workload_key(name: str) -> str:
    return name.lower().replace("-", " ").replace("_", " ")


def run_demo(out: TextIO, device: Optional[str] = None, out_dir: str = "demo-results", levels=DEMO_LEVELS,
             realistic: Optional[bool] = None, repeat: Optional[int] = None,
             only: Optional[Sequence[str]] = None) -> int:
    """Prints the table, writes demo.md / demo.json / demo.png under out_dir; returns 0 when every
    level that ran matched the reference, else 1. `only`: the workloads to run, by name (case and
    "-" / "_" for spaces do not matter: "lm-decode" is "LM decode"); default all."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    realistic = dev.type == "cuda" if realistic is None else realistic
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    repeat = repeat or (10 if dev.type == "cuda" else 3)
    where = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
             else "CPU (no GPU: the triton and cuda levels need one)")
    title = f"kernelforge progressive-optimization demo: {str(dtype)[6:]}, {'realistic' if realistic else 'small'} " \
            f"sizes, on {where}"
    out.write(title + "\n\n")
    torch.manual_seed(0)
    notes = ("check: error against the native level run in higher precision <= 2x the native level's own error "
             "+ 1e-5 of the largest value (a train step: its first loss and gradient norm). first call: includes "
             "tracing / compiling. median ms: one call (a train step is forward, loss, backward, AdamW), back to "
             "back, synchronized. LM decode: greedy generation, median ms and rate per decode step (generate's "
             "time less the prefill's, over the steps; first call: a whole generation), checked on the logits of "
             "the prompt's last token and of the first step; % BW limit: the bytes a step must read (parameters, "
             "filled KV cache) at the measured copy bandwidth, over the time per step.")
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    chosen = workloads(dev, dtype, realistic)
    if only is not None:
        wanted = {_workload_key(n) for n in only}
        unknown = wanted - {_workload_key(w.name) for w in chosen}
        if unknown:
            raise UnknownWorkloadError(f"kernelforge demo: unknown workload(s) {sorted(unknown)}; expected some of "
                             f"{[w.name for w in chosen]}")
        chosen = [w for w in chosen if _workload_key(w.name) in wanted]
    for work in chosen:
        rows += run_workload(work, levels, dev, dtype, repeat)
        out.write(f"{work.name}: done\n")
        out.flush()
        # written after every workload, so a run stopped part way keeps what it measured
        table = format_table(rows)
        (path / "demo.md").write_text(f"# {title}\n\n{table}\n\n{notes}\n")
        (path / "demo.json").write_text(json.dumps({"title": title, "rows": [asdict(r) for r in rows]}, indent=1))
    out.write("\n" + table + "\n\n" + notes + "\n")
    png = plot([r for r in rows if r.status in ("ok", "FAIL")], path / "demo.png", title)
    out.write(f"wrote {path / 'demo.md'}, {path / 'demo.json'}, {png}\n")
    failed = [r for r in rows if r.status == "FAIL"]
    out.write("every level that ran matches the reference\n" if not failed else
              f"{len(failed)} level(s) FAILED the check: " + ", ".join(f"{r.workload}/{r.level}" for r in failed)
              + "\n")
    return 1 if failed else 0


def run_progressive_optimization_demo(device=None, out_dir: str = "demo-results") -> int:
    """`kernelforge demo` (every model at every level here) under the name kernelforge.models
    gave it (the package's aliases' entry point)."""
    return run_demo(sys.stdout, device=device, out_dir=out_dir)


__all__ = ["DEMO_LEVELS", "UnknownWorkloadError", "random_graphs", "run_demo", "run_progressive_optimization_demo",
           "workloads"]
