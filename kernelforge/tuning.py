"""Measured backend choice: on a CUDA device, the backends that can run an op's inputs are timed on
first use and the fastest is kept, in memory and in a cache file that later processes reuse.

Which ops: those that register a `Tuner` (kernelforge.backends.set_tuning), near their rules:
gemm, the norms' forward (rms_norm, layer_norm and their add_ forms), softmax / log_softmax, and
flash_attention's forward without attn_mask, block_mask or a KV cache. A tuner has
- `bucket(*inputs, **options)`: a small summary of the inputs that the measurement stands for
  (sizes rounded up to powers of two where a model's sizes vary: rows, tokens, sequence lengths;
  the rest exact), or None for inputs it does not measure (a backward call);
- `run(*inputs, **options)`: a callable of no arguments running the op's own implementation once
  on those inputs, on whatever backend is forced around it (`use_backend`); it writes no input.
The registry's inputs are what the op's rules see, so one measurement serves every public
function of a registry family (rms_norm and layer_norm share the norms' kernels and choice;
softmax's backward follows the forward's choice, as it follows the same rules).

When: the choice for a bucket is made the first time a call needs it (kernelforge.backends.select
misses its cache). Nothing is measured, and the rules decide, where KERNELFORGE_TUNING is 0 (read
when a choice is first made), on a CPU, when a backend is forced (use_backend, KERNELFORGE_BACKEND)
or preferred (prefer_backend), while torch.compile traces, and for fewer than two candidates (the
backends, other than the reference, that the rules list and that support the inputs: the reference
is the fallback for correctness, not a contender, and would hold the score matrix of a long
attention). Not while a CUDA graph is captured, an eager plan is recorded (a dispatch mode) or
Dynamo runs either: that call takes the rules and is not cached, so a later call measures. Not in
a process that is one rank of a distributed job (torch.distributed initialized, world size > 1):
ranks measuring apart could pick different backends for the same op, and a Replicate DTensor's
copies must be computed alike; the cache file's entries (filled before the job, `kernelforge tune`)
are used there, since every rank reads the same file and no rank writes it.

How: `measure` (the seam the tests replace) runs the callable once (it may compile, autotune or
build), estimates its time, then times up to MAX_REPEATS runs within TIME_BUDGET_S shared by the
candidates, each after writing a 256 MB buffer (no run finds its inputs in L2), with CUDA events;
the median counts. The inputs are detached and run under torch.no_grad, inside unrecorded() so
that recording() blocks do not count the runs. use_backend is process-wide: a measurement forces
the backend for other threads' calls too while it runs (kernelforge's ops choose per call, so such
a call runs correctly, on the measured backend).

The cache file: `cache_path()`, tuning.json in kernelforge's cache directory (KERNELFORGE_CACHE_DIR,
else $XDG_CACHE_HOME/kernelforge or ~/.cache/kernelforge, the parent of the CUDA JIT cache):
    {"format": 1, "contexts": {"<GPU> | torch <v> | triton <v> | kernelforge <v>":
        {"gpu": ..., "versions": {...}, "entries": {"<op> <bucket repr>":
            {"backend": "triton", "us": {"triton": 12.1, "cuda": 14.0}}}}}}
Entries of another GPU or other library versions stay in the file, unused. The file is read once,
on the first measured choice of a process; a measurement is written at once: the file is read
again, the new entry merged into what other processes wrote meanwhile, and a temporary file
replaces it (os.replace). A file that cannot be read or parsed is ignored with one warning and
rewritten on the next save; a location that cannot be written keeps measurements in memory only,
with one warning.

Eager plans (kernelforge._eager_plans) hold the choices their recordings made. A bucket's first
choice is measured before any plan can record it, except where a call had to take the rules
uncached (a plan being recorded, a CUDA graph captured): once that happened, a measured choice that
differs from the rules drops the cached choices and with them the plans (backends.forget_choices).
"""
from __future__ import annotations

import functools
import json
import os
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Hashable, Optional

import torch

from kernelforge import backends

ENV_VAR = "KERNELFORGE_TUNING"
FORMAT = 1
TIME_BUDGET_S = 0.2  # timed runs of one measurement, all candidates together (not the first runs)
MAX_REPEATS = 25
ESTIMATE_RUNS = 3
FLUSH_BYTES = 256 << 20

Bucket = Callable[..., Optional[Hashable]]
Runner = Callable[..., Callable[[], object]]

# Whether CPU calls are measured too: for the tests only (with a fake `measure`), a CPU call has the
# reference only. CUDA calls are measured.
_MEASURE_CPU = False
# the file's contexts once read; why saving stopped; whether a call took the rules uncached since the
# choices were last dropped (its eager plan, or a CUDA graph, may hold them)
_state: dict = {"contexts": None, "unwritable": None, "deferred": False}
_warned: set = set()


@dataclass(frozen=True)
class Tuner:
    """An op's opt-in to measurement (module docstring): its bucket and its runner."""
    bucket: Bucket
    run: Runner

    def choose(self, op: str, rules: backends.Choice, inputs: tuple, options: dict) -> tuple[backends.Choice, bool]:
        """(the choice for these inputs, whether backends.select may cache it): the measured
        fastest backend, else the rules' choice with why it was not measured."""
        why, lasting = _why_not_measured(inputs)
        bucket = self.bucket(*inputs, **options) if why is None else None
        if why is None and bucket is None:
            why = f"{op} measures no inputs like these"
        if why is not None:
            _state["deferred"] = _state["deferred"] or not lasting
            return replace(rules, unmeasured=why), lasting
        device = next(t.device for t in _tensors(inputs, options))
        context, key = context_of(device), f"{op} {bucket!r}"
        entry = _entries(context).get(key)
        if entry is None:
            if in_distributed_job():
                return replace(rules, unmeasured=DISTRIBUTED), True
            entry = self._measure(op, rules, inputs, options, device, context, key)
            if isinstance(entry, str):
                return replace(rules, unmeasured=entry), True
        impl = backends.implementations(op).get(entry["backend"])
        why_not = "it is not registered" if impl is None else impl.supports(*inputs, **options)
        if why_not is not None:  # measured by a build of kernelforge that had it, or since unavailable
            return replace(rules, unmeasured=f"the measured fastest, {entry['backend']}, cannot run: {why_not}"), True
        if entry["backend"] != rules.backend and _state["deferred"]:
            # a call that had to wait took the rules uncached, and an eager plan may hold that choice
            _state["deferred"] = False
            backends.forget_choices()
        times = tuple(sorted(entry["us"].items(), key=lambda item: item[1]))
        reason = f"it measured fastest for inputs like these on {context.split(' | ')[0]}"
        return backends.Choice(impl, reason, measured=times), True

    def _measure(self, op, rules, inputs, options, device, context, key):
        """Time the candidates and store the entry; a string says why nothing was measured."""
        order, _ = backends.preference(op, *inputs, **options)
        impls = backends.implementations(op)
        candidates = [b for b in order if b != "reference" and b in impls and impls[b].supports(*inputs, **options) is None]
        unbuilt = "cuda" in candidates and not cuda_ready(op)
        if unbuilt:
            candidates.remove("cuda")
        if len(candidates) < 2:
            alone = candidates[0] if candidates else "the reference"
            return f"only {alone} can run these inputs" + (" (cuda's extension is not built yet)" if unbuilt else "")
        inputs = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in inputs)
        options = {k: t.detach() if isinstance(t, torch.Tensor) else t for k, t in options.items()}
        times, failures = {}, []
        budget = TIME_BUDGET_S / len(candidates)
        with torch.no_grad(), backends.unrecorded():
            for backend in candidates:
                with backends.use_backend(backend):
                    try:
                        times[backend] = float(measure(self.run(*inputs, **options), device, budget))
                    except Exception as err:  # noqa: BLE001 - a backend that fails here is not a candidate
                        failures.append(f"{backend}: {type(err).__name__}: {err}")
        if not times:
            return "every candidate failed when measured (" + "; ".join(failures) + ")"
        entry = {"backend": min(times, key=times.get), "us": {b: round(t, 2) for b, t in times.items()}}
        _entries(context)[key] = entry
        _save(context, key, entry)
        return entry


DISTRIBUTED = ("one rank of a distributed job measures nothing: ranks timing apart could pick different "
               "backends, and a replicated result must be computed alike on every rank (fill the cache before "
               "the job with `kernelforge tune`; its entries are used)")


def in_distributed_job() -> bool:
    """Whether this process is one of several ranks (torch.distributed initialized, world size > 1)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def cuda_ready(extension: str) -> bool:
    """Whether the CUDA extension of that name loads without a build: a first call must not wait
    minutes of nvcc for a candidate the rules do not pick (built once, by its rules or the cuda
    level, it is measured from then on). The ops' registry names are their extensions' names."""
    from kernelforge.cuda.compiler import get_cuda_compiler

    return get_cuda_compiler().ready(extension)


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


def _tensors(inputs: tuple, options: dict):
    return (t for t in (*inputs, *options.values()) if isinstance(t, torch.Tensor))


def _why_not_measured(inputs: tuple) -> tuple[Optional[str], bool]:
    """(why these inputs are not measured, or None; whether that holds for later calls with
    inputs like these, so the rules' choice may be cached)."""
    if not enabled():
        return f"{ENV_VAR} is {os.environ.get(ENV_VAR)!r}", True
    first = next(_tensors(inputs, {}), None)
    if first is None or not (first.is_cuda or _MEASURE_CPU and first.device.type == "cpu"):
        where = "no tensor" if first is None else f"a {first.device.type} tensor"
        return f"only CUDA calls are measured, this one has {where}", True
    if torch.compiler.is_compiling():
        return "torch.compile is tracing", False
    if first.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "a CUDA graph is being captured", False
    if torch._C._len_torch_dispatch_stack():  # an eager plan's recording, a FakeTensorMode...
        return "a dispatch mode is active", False
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in _tensors(inputs, {})):
        return "a tensor subclass", False
    return None, True


# ----------------------------------------------------------------------------- timing
def measure(run: Callable[[], object], device: torch.device, budget_s: float) -> float:
    """The median device time of run() in microseconds (module docstring): replaced by the tests."""
    with torch.cuda.device(device):
        run()  # the first call may compile, autotune or build: not timed
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(ESTIMATE_RUNS):
            run()
        end.record()
        torch.cuda.synchronize()
        estimate_s = start.elapsed_time(end) / 1e3 / ESTIMATE_RUNS
        repeats = max(1, min(MAX_REPEATS, int(budget_s / max(estimate_s, 1e-7))))
        flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for begin, finish in events:
            flush.zero_()
            begin.record()
            run()
            finish.record()
        torch.cuda.synchronize()
        times = sorted(begin.elapsed_time(finish) for begin, finish in events)
        return times[len(times) // 2] * 1e3


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    """The GPU's name (the tests replace it)."""
    return torch.cuda.get_device_name(device)


@functools.lru_cache(maxsize=None)
def versions() -> dict:
    """The library versions a measurement holds for."""
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "none"

    return {"torch": torch.__version__, "triton": version("triton"), "kernelforge": version("kernelforge")}


def context_of(device: torch.device) -> str:
    """The cache's key for a device: its GPU name and the library versions."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return " | ".join([device_name(device)] + [f"{name} {v}" for name, v in versions().items()])


# ----------------------------------------------------------------------------- the cache file
def cache_path() -> Path:
    from kernelforge.cuda.compiler import default_cache_dir

    return default_cache_dir().parent / "tuning.json"


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _read(path: Path, quiet: bool = False) -> dict:
    """The file's contexts; {} when it is missing, or unreadable (one warning)."""
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):  # none yet (or a file where a directory should be)
        return {}
    except OSError as err:
        if not quiet:
            _warn_once("read", f"kernelforge: cannot read the tuning cache {path} ({err}): ignored")
        return {}
    try:
        data = json.loads(text)
        contexts = data["contexts"]
        if data.get("format") != FORMAT or not isinstance(contexts, dict) or not all(
                isinstance(c, dict) and isinstance(c.get("entries"), dict) for c in contexts.values()):
            raise ValueError(f"not a format-{FORMAT} tuning cache")
        return contexts
    except (ValueError, KeyError, TypeError) as err:
        if not quiet:
            _warn_once("read", f"kernelforge: the tuning cache {path} is corrupt ({err}): ignored, and rewritten "
                               "on the next measurement")
        return {}


def _contexts() -> dict:
    if _state["contexts"] is None:
        _state["contexts"] = _read(cache_path())
    return _state["contexts"]


def _entries(context: str) -> dict:
    contexts = _contexts()
    if context not in contexts:
        gpu, *_ = context.split(" | ")
        contexts[context] = {"gpu": gpu, "versions": versions(), "entries": {}}
    return contexts[context]["entries"]


def entries(context: str) -> dict:
    """The measurements this process holds for a context (context_of): read from the file, or made here."""
    return dict(_entries(context))


def _save(context: str, key: str, entry: dict) -> None:
    """Merge one entry into the file (module docstring); entries other processes wrote meanwhile
    come into memory too, where this process has none for their inputs."""
    if _state["unwritable"] is not None:
        return
    path = cache_path()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        on_disk = _read(path, quiet=True)
        mine = _contexts()
        for name, ctx in on_disk.items():
            into = mine.setdefault(name, {**ctx, "entries": {}})["entries"]
            for k, e in ctx["entries"].items():
                into.setdefault(k, e)
        on_disk.setdefault(context, {**mine[context], "entries": {}})["entries"][key] = entry
        tmp.write_text(json.dumps({"format": FORMAT, "contexts": on_disk}, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as err:
        _state["unwritable"] = str(err)
        _warn_once("write", f"kernelforge: cannot write the tuning cache {path} ({err}): measurements are kept "
                            "in memory only")
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)


def reset() -> None:
    """Forget what this process read and measured (the file stays): the next choice reads it again."""
    _state.update(contexts=None, unwritable=None, deferred=False)
    _warned.clear()
    backends.forget_choices()


def clear() -> bool:
    """Delete the cache file (and forget this process's measurements); whether there was one."""
    path = cache_path()
    existed = path.exists()
    path.unlink(missing_ok=True)
    reset()
    return existed


def show(device: Optional[torch.device] = None) -> str:
    """The cache's entries for this GPU and these library versions; other contexts counted."""
    path = cache_path()
    contexts = _read(path)
    here = context_of(device or torch.device("cuda")) if torch.cuda.is_available() else None
    lines = [f"tuning cache: {path}" + ("" if path.exists() else " (none yet)")]
    mine = contexts.get(here, {}).get("entries", {}) if here else {}
    if here:
        lines.append(f"for {here}: {len(mine)} entries")
    else:
        lines.append("no CUDA GPU here: the entries of every GPU are counted below")
    for key in sorted(mine):
        entry = mine[key]
        times = ", ".join(f"{b} {us:.1f} us" for b, us in sorted(entry["us"].items(), key=lambda item: item[1]))
        lines.append(f"  {key}: {entry['backend']} ({times})")
    others = {name: len(ctx["entries"]) for name, ctx in contexts.items() if name != here}
    if others:
        lines.append(f"other GPUs or versions: {sum(others.values())} entries in {len(others)} contexts (unused here)")
        lines += [f"  {name}: {count}" for name, count in sorted(others.items())]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- the ops' tuners
def pow2(n: int) -> int:
    """n rounded up to a power of two (0 and 1 stay)."""
    return n if n <= 1 else 1 << (n - 1).bit_length()


def _dtype(t) -> Optional[torch.dtype]:
    return None if t is None else t.dtype


def _op_impl(name: str) -> Callable:
    from kernelforge.ops._opdef import DEFINITIONS

    return DEFINITIONS[name].impl


# The buckets are None off CUDA (x.is_cuda: the cheapest test): a CPU call's choice stays cached per
# device and dtype, as before measurement existed.
def _softmax_bucket(x, dim=-1, log=False):
    if not (x.is_cuda or _MEASURE_CPU):
        return None
    n = x.shape[dim] if x.dim() else 1
    return pow2(x.numel() // max(n, 1)), n, x.dtype


def _softmax_run(x, dim=-1, log=False):
    return functools.partial(_op_impl("softmax"), x, dim)


def _norms_bucket(x, weight=None, bias=None, n=0, backward=False):
    if backward or not (x.is_cuda or _MEASURE_CPU):  # the backward's rules weigh its own sizes
        return None
    return pow2(x.numel() // max(n, 1)), n, x.dtype, _dtype(weight), _dtype(bias)


def _norms_run(x, weight=None, bias=None, n=0, backward=False):
    # rows of n: the layer norm where a bias comes (it has the more work), else the RMS norm
    flat = lambda t: None if t is None else t.reshape(n)  # noqa: E731
    impl = _op_impl("rms_norm" if bias is None else "layer_norm")
    return functools.partial(impl, x.reshape(-1, n), [n], flat(weight), flat(bias), 1e-5, 0.0)


def _gemm_bucket(a, b, compute="fp32"):
    if not (a.is_cuda or _MEASURE_CPU):
        return None
    K, N = a.shape[-1], b.shape[-1]
    M = a.numel() // K if K else 0
    batch = b.numel() // (K * N) if K * N else 0
    transposed = b.dim() >= 2 and b.stride(-2) == 1 and N > 1  # a weight read as W.t()
    return pow2(M), N, K, batch, transposed, a.dtype, b.dtype, compute


def _gemm_run(a, b, compute="fp32"):
    fp8 = torch.float8_e4m3fn
    out_dtype = torch.bfloat16 if fp8 in (a.dtype, b.dtype) else torch.promote_types(a.dtype, b.dtype)
    return functools.partial(_op_impl("gemm"), a, b, None, None, "none", compute, out_dtype, False)


def _attention_bucket(q, k, v, vis=None, backward=False):
    if backward or vis is None or not (q.is_cuda or _MEASURE_CPU):
        return None
    if vis.attn_mask is not None or vis.block_mask is not None or vis.seqlens is not None or vis.block_table is not None:
        return None  # masks and caches: the rules (their costs depend on the mask's values, not sizes)
    B, H, Sq, D = q.shape
    return pow2(B * H), pow2(Sq), pow2(k.shape[2]), H // max(k.shape[1], 1), D, v.shape[-1], q.dtype, vis.left, vis.right


def _attention_run(q, k, v, vis=None, backward=False):
    band = [-1 if w is None else w for w in (vis.left, vis.right)]
    return functools.partial(_op_impl("flash_attention"), q, k, v, q.shape[-1] ** -0.5, *band, None, [], 0, 0, None)


SOFTMAX = Tuner(_softmax_bucket, _softmax_run)
NORMS = Tuner(_norms_bucket, _norms_run)
GEMM = Tuner(_gemm_bucket, _gemm_run)
ATTENTION = Tuner(_attention_bucket, _attention_run)
