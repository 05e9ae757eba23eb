"""Which implementations exist for each op, which one runs, and why.

Each op registers its implementations here (from its module in `kernelforge.ops`).
An implementation is a backend name, a loader for its launcher (imported lazily, so
`import kernelforge` pulls in neither Triton nor a compiler), and a predicate that says
why it cannot take some inputs (None when it can).

Policy, in order:
1. A forced backend (`use_backend(...)` context, else the `KERNELFORGE_BACKEND`
   environment variable) runs, or the call raises `BackendUnsupportedError` saying
   why; it never falls back silently.
2. A preferred backend (`prefer_backend(...)` context) runs where the op has it and it
   takes the inputs; elsewhere step 3 decides (the example models' "cuda" level: CUDA C++
   kernels where kernelforge has them, the measured order for the rest).
3. Otherwise the op's preference rules pick the first backend, in the rule's
   order, that supports the inputs. The rules are the fastest-first orders measured
   on our GPUs (see `kernelforge/ops/<op>.py`); CPU inputs go to the reference.
   While torch.compile traces an op (`tracing()`), traceable backends (Triton JIT kernels,
   which Inductor launches from its own code) come before opaque ones (CUDA C++): the eager
   rules put CUDA first only where its cheaper host launch wins, and a compiled graph pays
   no kernelforge host time for either.
   Where an op opts in to measurement (`set_tuning`, kernelforge.tuning) and nothing is forced
   or preferred, a CUDA call's choice is the backend measured fastest for inputs like these (a
   size bucket) on this GPU, timed on first use and kept in a cache file; the rules decide
   until a measurement exists.

`recording()` collects which backend each op call ran on, to show what a model used.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator, Optional, Sequence

BACKENDS = ("triton", "cuda", "cublas", "reference")
ENV_VAR = "KERNELFORGE_BACKEND"

# Returns None when the implementation can take the inputs, else a reason in words.
SupportPredicate = Callable[..., Optional[str]]
# Returns the backend names to try, fastest first, and a reason for that order.
PreferenceRule = Callable[..., "tuple[Sequence[str], str]"]
# Returns a hashable summary of the inputs that fixes the choice (device type, dtype, size
# bucket...): selection runs on every call, so choices are cached under it.
ChoiceKey = Callable[..., Hashable]


class BackendUnsupportedError(RuntimeError):
    """A forced backend cannot take the given inputs (or is not available here)."""


@dataclass
class Implementation:
    op: str
    backend: str
    module: str  # dotted path of the module that holds the launchers
    supports: SupportPredicate
    # Whether torch.compile can trace this implementation's launches (kernelforge.ops._opdef): a
    # bool, or a function of no arguments for what is known only at run time (the interpreter).
    traceable_when: "bool | Callable[[], bool]" = False
    _loaded: object = field(default=None, repr=False)

    @property
    def traceable(self) -> bool:
        when = self.traceable_when
        return when() if callable(when) else when

    def launchers(self):
        """The launcher module, imported on first use."""
        if self._loaded is None:
            self._loaded = importlib.import_module(self.module)
        return self._loaded


@dataclass(frozen=True)
class Choice:
    implementation: Implementation
    reason: str
    # ((backend, microseconds), ...) fastest first when a measurement made the choice (kernelforge.tuning)
    measured: tuple = ()
    unmeasured: str = ""  # else, when the op opts in to measurement: why these inputs were not measured

    @property
    def backend(self) -> str:
        return self.implementation.backend

    @property
    def traceable(self) -> bool:
        return self.implementation.traceable


_registry: dict[str, dict[str, Implementation]] = {}
_preferences: dict[str, PreferenceRule] = {}
_choice_keys: dict[str, ChoiceKey] = {}
_buckets: dict[str, Callable[..., Hashable]] = {}  # op -> its tuner's bucket, part of its choice key
_choices: dict[tuple, Choice] = {}
_aliases: dict[str, tuple[str, dict]] = {}  # public function name -> (registry op, its options)
_tuners: dict[str, object] = {}  # op -> its kernelforge.tuning.Tuner (set_tuning)
_generation = [0]  # forget_choices() calls (plan_key)
# The backend forced by use_backend(). Process-wide on purpose (like torch.backends flags):
# autograd runs backward ops on its own threads, and a forced backend must govern them
# too; a thread- or context-local setting would silently not.
_forced: list[Optional[str]] = [None]
# The backend preferred by prefer_backend(), process-wide for the same reason.
_preferred: list[Optional[str]] = [None]
# Counters of (op, backend) per selection, while recording() blocks are open.
_recorders: list[collections.Counter] = []
# Set on the thread that traces an op for torch.compile (tracing()).
_trace_state = threading.local()


def _triton_traceable() -> bool:
    # Triton's interpreter (CPU tests) runs kernels eagerly: torch cannot put them into a graph
    from kernelforge.triton import interpreter_enabled

    return not interpreter_enabled()


# What each backend's launches are, by default, to a tracer: the reference and cuBLAS (through
# torch's matmul and its fused-epilogue variants) are torch ops; Triton kernels go through
# torch.library.wrap_triton; CUDA C++ extensions are opaque.
_DEFAULT_TRACEABLE = {"reference": True, "triton": _triton_traceable, "cuda": False, "cublas": True}


def register(op: str, backend: str, module: str, supports: SupportPredicate,
             traceable: "Optional[bool | Callable[[], bool]]" = None) -> None:
    """`traceable` overrides the backend's default (an op whose Triton launcher also runs Gluon or
    host-descriptor kernels registers it False: those stay inside one opaque custom op)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    when = _DEFAULT_TRACEABLE[backend] if traceable is None else traceable
    _registry.setdefault(op, {})[backend] = Implementation(op, backend, module, supports, when)
    forget_choices()


def set_preference(op: str, rule: PreferenceRule, choice_key: Optional[ChoiceKey] = None) -> None:
    """`rule` orders the backends for given inputs; `choice_key`, if given, summarizes
    everything about the inputs that the rule and the support predicates look at, so the
    choice can be cached under it."""
    _preferences[op] = rule
    if choice_key is not None:
        _choice_keys[op] = choice_key
    forget_choices()


def set_tuning(op: str, tuner) -> None:
    """Let measurement choose `op`'s backend (kernelforge.tuning.Tuner: `bucket(*inputs, **options)`
    summarizes the inputs' sizes, `choose(op, rules_choice, inputs, options)` returns the choice and
    whether it may be cached). The op's choice key then includes the bucket: a measured choice is
    cached per bucket, and a call pays the bucket function on top of the key it paid before."""
    if op not in _choice_keys:
        raise ValueError(f"set_tuning({op!r}): set the op's preference with a choice_key first")
    _tuners[op], _buckets[op] = tuner, tuner.bucket
    forget_choices()


def tuned(op: str) -> bool:
    """Whether `op` opts in to measurement (set_tuning)."""
    return op in _tuners


def preference(op: str, *inputs, **options) -> "tuple[Sequence[str], str]":
    """The op's rule for these inputs: (backends fastest first, why)."""
    return _preferences[op](*inputs, **options)


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Selections inside the block are not counted by open recording() blocks (a measurement's runs)."""
    saved = _recorders[:]
    _recorders.clear()
    try:
        yield
    finally:
        _recorders[:] = saved


def forget_choices() -> None:
    """Drop cached choices: called when what a predicate sees changes (a registration, an
    extension that failed to build). The ops' eager plans (kernelforge._eager_plans), which hold
    the choices their recordings made, are dropped with them: plan_key() changes."""
    _choices.clear()
    _generation[0] += 1


def plan_key() -> tuple:
    """What of the selection an op's eager plan depends on: the forced backend (use_backend, then
    KERNELFORGE_BACKEND), the preferred one, and how often choices were forgotten."""
    return _forced[0], _environment_value(), _preferred[0], _generation[0]


def _environment_reader() -> Callable[[], Optional[str]]:
    """KERNELFORGE_BACKEND's current value, read on every call. os.environ.get costs ~0.7 us (a
    Mapping method, the key encoded, the value decoded), a tenth of a replayed call; CPython's
    os.environ keeps its encoded items in a dict that assignments and putenv through os.environ
    update, and a lookup there costs ~0.05 us (raw: a value or None is all plan_key needs)."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if not isinstance(data, dict) or encode is None:
        return lambda: os.environ.get(ENV_VAR)
    return functools.partial(data.get, encode(ENV_VAR))


_environment_value = _environment_reader()


def counting() -> bool:
    """Whether a recording() block is open: its calls must select (and be counted), not replay."""
    return bool(_recorders)


def implementations(op: str) -> dict[str, Implementation]:
    try:
        return _registry[op]
    except KeyError:
        raise KeyError(f"no op named {op!r} is registered; known ops: {sorted(_registry)}") from None


def _validate(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}: unknown backend {name!r}; expected one of {BACKENDS}")
    return name


@contextlib.contextmanager
def use_backend(name: Optional[str]) -> Iterator[None]:
    """Force every op inside the block onto one backend (None lifts the force).

    A forced backend that cannot take an input raises instead of falling back. The setting
    is process-wide (it also holds for the backward pass, which autograd runs on other
    threads), so do not race two threads that force different backends.
    """
    with _setting(_forced, name, "use_backend"):
        yield


@contextlib.contextmanager
def prefer_backend(name: Optional[str]) -> Iterator[None]:
    """Inside the block, every op runs on `name` where it has that backend and the backend
    takes the inputs, and on its usual choice otherwise (no error). Process-wide, as
    use_backend; a forced backend still wins."""
    with _setting(_preferred, name, "prefer_backend"):
        yield


@contextlib.contextmanager
def _setting(slot: list, name: Optional[str], source: str) -> Iterator[None]:
    """slot[0] = name (validated) for the block, then back to what it was."""
    previous = slot[0]
    slot[0] = None if name is None else _validate(name, source)
    try:
        yield
    finally:
        slot[0] = previous


@contextlib.contextmanager
def recording() -> Iterator[collections.Counter]:
    """Counts the backend chosen for each op call inside the block: {(op, backend): calls}.
    The backward ops count too when autograd runs them inside the block."""
    counter: collections.Counter = collections.Counter()
    _recorders.append(counter)
    try:
        yield counter
    finally:
        # by identity: Counters with equal counts compare equal, and list.remove would take the first
        del _recorders[next(i for i, c in enumerate(_recorders) if c is counter)]


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Choices made inside the block are for a graph torch.compile traces: traceable backends first."""
    previous = getattr(_trace_state, "on", False)
    _trace_state.on = True
    try:
        yield
    finally:
        _trace_state.on = previous


def selection_state() -> str:
    """"forced,preferred" as use_backend / prefer_backend set them. The ops read it under Dynamo,
    which then guards a compiled graph on the setting its backend choices saw (a string, so that
    Dynamo reads both values, and guards on both, rather than only the lists' lengths)."""
    return f"{_forced[0]},{_preferred[0]}"


def forced_backend() -> Optional[str]:
    """The backend forced by `use_backend`, else by KERNELFORGE_BACKEND, else None."""
    name = _forced[0]
    if name is not None:
        return name
    env = os.environ.get(ENV_VAR)
    return _validate(env, ENV_VAR) if env else None


def select(op: str, *inputs, **options) -> Choice:
    """The implementation that runs `op` on these inputs, and why."""
    forced, preferred = forced_backend(), _preferred[0]
    traced = getattr(_trace_state, "on", False)
    key_fn = _choice_keys.get(op)
    if key_fn is None or traced:
        # not cached while tracing: under dynamic shapes a key holds symbolic sizes, whose
        # comparisons would add guards (the rules' own comparisons guard only what they decide)
        choice = _select(op, forced, preferred, inputs, options, traced)
    else:
        bucket = _buckets.get(op)
        key = (op, forced, preferred, traced, key_fn(*inputs, **options),
               None if bucket is None else bucket(*inputs, **options))
        choice = _choices.get(key)
        if choice is None:
            choice = _select(op, forced, preferred, inputs, options, traced)
            tuner = _tuners.get(op) if forced is None and preferred is None else None
            cacheable = True
            if tuner is not None:  # measured, or the rules with why not (not cached while that may pass)
                choice, cacheable = tuner.choose(op, choice, inputs, options)
            if cacheable:
                _choices[key] = choice
    for counter in _recorders:
        counter[(op, choice.backend)] += 1
    return choice


def _select(op: str, forced: Optional[str], preferred: Optional[str], inputs: tuple, options: dict,
            traced: bool = False) -> Choice:
    impls = implementations(op)
    if forced is None and preferred is not None:
        impl = impls.get(preferred)
        why_not = f"{op} has no {preferred} implementation" if impl is None else impl.supports(*inputs, **options)
        if why_not is None:
            return Choice(impl, f"{preferred} was preferred")
        choice = _select(op, None, None, inputs, options, traced)
        return Choice(choice.implementation, f"{choice.reason} ({preferred} was preferred but: {why_not})")
    if forced is not None:
        impl = impls.get(forced)
        if impl is None:
            raise BackendUnsupportedError(
                f"kernelforge.{op}: backend {forced!r} is forced but {op} has no {forced} "
                f"implementation (it has: {', '.join(impls)})"
            )
        why_not = impl.supports(*inputs, **options)
        if why_not is not None:
            raise BackendUnsupportedError(
                f"kernelforge.{op}: backend {forced!r} is forced but cannot run these inputs: {why_not}"
            )
        return Choice(impl, f"{forced} was forced")

    order, why_order = _preferences[op](*inputs, **options)
    if traced:
        order, why_order = _traceable_first(impls, order, why_order)
    rejected = []
    for backend in order:
        impl = impls.get(backend)
        if impl is None:
            continue
        why_not = impl.supports(*inputs, **options)
        if why_not is None:
            skipped = "" if not rejected else " (skipped: " + "; ".join(rejected) + ")"
            return Choice(impl, f"{why_order}{skipped}")
        rejected.append(f"{backend}: {why_not}")
    raise BackendUnsupportedError(
        f"kernelforge.{op}: no implementation can run these inputs: " + "; ".join(rejected)
    )


def _traceable_first(impls: dict, order: Sequence[str], why: str) -> "tuple[Sequence[str], str]":
    """The order with the traceable GPU kernels moved ahead of opaque ones; the reference keeps
    its place (a fallback, not a kernel)."""
    def opaque(backend: str) -> bool:
        impl = impls.get(backend)
        return impl is not None and backend != "reference" and not impl.traceable

    kernels = [b for b in order if b != "reference"]
    ranked = sorted(kernels, key=opaque)
    if ranked == kernels:
        return order, why
    rest = iter(ranked)
    new_order = tuple(next(rest) if b != "reference" else b for b in order)
    return new_order, (f"under torch.compile traceable kernels come first (Inductor launches them as cheaply as "
                       f"an extension's); eager order: {why}")


def register_alias(name: str, op: str, **options) -> None:
    """Let explain() take a public function's name (kf.explain("rms_norm", x)) for the registry's
    op family it runs through, with the options that function passes (silu: kind="silu")."""
    _aliases[name] = (op, options)


def explain(op: str, *inputs, **options) -> str:
    """One paragraph: which implementation would run `op` (a registry name, or a public
    function's name: "rms_norm", "flash_attention") on these inputs and why, and for every other
    backend whether it could."""
    lines = []
    if op not in _registry and op in _aliases:
        family, defaults = _aliases[op]
        lines.append(f"({op} runs through the {family!r} family of the registry)")
        op, options = family, {**defaults, **options}
    try:
        choice = select(op, *inputs, **options)
        lines.append(f"{op}: runs on {choice.backend} because {choice.reason}.")
        chosen = choice.backend
        if choice.measured:
            lines.append("  measured: " + ", ".join(f"{b} {us:.1f} us" for b, us in choice.measured))
        else:
            lines.append(f"  rules (no measurement: {choice.unmeasured or _unmeasured(op)})")
    except BackendUnsupportedError as err:
        lines.append(f"{op}: would raise: {err}")
        chosen = None
    for backend, impl in implementations(op).items():
        if backend == chosen:
            continue
        why_not = impl.supports(*inputs, **options)
        lines.append(f"  {backend}: " + ("could run these inputs" if why_not is None else f"cannot: {why_not}"))
    return "\n".join(lines)


def _unmeasured(op: str) -> str:
    """Why a choice made without the op's tuner came from the rules."""
    if op not in _tuners:
        return f"{op} does not opt in to measurement"
    if forced_backend() is not None:
        return f"{forced_backend()} is forced"
    return f"{_preferred[0]} is preferred" if _preferred[0] is not None else "while torch.compile traces"
