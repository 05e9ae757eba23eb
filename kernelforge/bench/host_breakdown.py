"""Where a step's host time goes: chosen functions, found by name at run time, wrapped in
perf_counter_ns pairs; each call's time goes to its category less the wrapped calls nested in it
(exclusive time), on every thread. A function that does not exist (internals move) is skipped.

    from kernelforge.bench.host_breakdown import breakdown, wrapper_overhead_ns
    parts = breakdown(step, calls=300, overhead_ns=wrapper_overhead_ns(), sync=torch.cuda.synchronize)
    parts["us"]  # {category: microseconds per step}, CATEGORIES, adding up to the step's host time

Categories:
  dispatch  the eager path's glue: _opdef.Op.__call__ (with Op._eager's plan lookup) and _no_views
  plan key  an eager plan's signature: _eager_plans.signature and .state, backends.plan_key
  replay    a replayed eager plan (_eager_plans.Plan.run): its allocations, fills and launches
            through the compiled kernels' C launchers, and its own Python
  op code   the impl of each defined op (_opdef.DEFINITIONS), its own lines: views, arithmetic, and
            the torch ops of the reference backend
  checks    the ops' check_* / _check* / _validate* / normalize_dim / require functions
  choice    backends.select, Implementation.launchers, the ops' _choose*
  alloc     torch.empty / empty_like / empty_strided / zeros / zeros_like, Tensor.new_empty / new_zeros
  launch    triton._launch.launch, Triton's JITFunction.run, Autotuner.run, Heuristics.run, the
            interpreter's run, CUDACompiler.load and the CUDA extensions' functions (with their
            C++ allocations)
  autograd  autograd.Function.apply (its forward side, setup_context included) and
            torch.autograd.backward / grad less what wrapped functions took inside them on any
            thread (autograd's device thread too): the engine and the Python backward glue
  instrumentation  the wrappers' own cost (wrapper_overhead_ns a wrapped call), out of the others
  rest      everything unwrapped: the caller's code, its loop
  gpu wait  the final synchronize, per step (large: the GPU, not the host, bounds the loop)
"""
from __future__ import annotations

import functools
import re
import sys
import threading
import time
import types
from collections import Counter, defaultdict

from kernelforge.bench.timing import wall_us_per_call

CATEGORIES = ("dispatch", "plan key", "replay", "op code", "checks", "choice", "alloc", "launch", "autograd",
              "instrumentation", "rest", "gpu wait")


class Probe:
    """Exclusive time per category of wrapped functions: each wrapped call charges its own
    duration less its wrapped children's (and `overhead_ns` for each child: the wrapper's cost)."""

    def __init__(self, overhead_ns: float = 0.0):
        self.overhead_ns, self.main = overhead_ns, threading.get_ident()
        self.local = threading.local()
        self.reset()

    def reset(self):
        self.excl = defaultdict(float)  # category -> ns
        self.inclusive = defaultdict(int)  # label -> ns
        self.calls = Counter()  # label -> calls
        self.foreign_ns = self.foreign_calls = 0  # outermost wrapped calls on other threads

    def wrap(self, category: str, label: str, fn):
        probe, clock = self, time.perf_counter_ns

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            stack = getattr(probe.local, "stack", None)
            if stack is None:
                stack = probe.local.stack = []
            frame = [0, 0]  # children's ns, children
            stack.append(frame)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                ns = clock() - start
                stack.pop()
                probe.excl[category] += ns - frame[0] - frame[1] * probe.overhead_ns
                probe.inclusive[label] += ns
                probe.calls[label] += 1
                if stack:
                    stack[-1][0] += ns
                    stack[-1][1] += 1
                elif threading.get_ident() != probe.main:
                    probe.foreign_ns += ns
                    probe.foreign_calls += 1
        timed.__probe_original__ = fn
        return timed


@functools.lru_cache(maxsize=None)
def wrapper_overhead_ns(calls: int = 20000) -> float:
    """Nanoseconds a wrapper adds to a call: the fastest of five loops each way (noise only adds)."""
    def noop():
        return None

    wrapped = Probe().wrap("calibration", "noop", noop)
    plain = min(wall_us_per_call(noop, calls=calls, warmup=10, device="cpu") for _ in range(5))
    return max(min(wall_us_per_call(wrapped, calls=calls, warmup=10, device="cpu") for _ in range(5)) - plain, 0.0) * 1e3


CHECK_NAME = re.compile(r"^_?(check|validate)|^(normalize_dim|require)$")
CHOICE_NAME = re.compile(r"^_?choose")
# (category, "module:Attr.path"): resolved only where the module is already imported
STATIC = [("dispatch", "kernelforge.ops._opdef:Op.__call__"), ("dispatch", "kernelforge.ops._opdef:_no_views"),
          ("plan key", "kernelforge._eager_plans:signature"), ("plan key", "kernelforge._eager_plans:state"),
          ("plan key", "kernelforge.backends:plan_key"), ("replay", "kernelforge._eager_plans:Plan.run"),
          ("choice", "kernelforge.backends:select"), ("choice", "kernelforge.backends:Implementation.launchers"),
          ("launch", "kernelforge.triton._launch:launch"), ("launch", "triton.runtime.jit:JITFunction.run"),
          ("launch", "triton.runtime.autotuner:Autotuner.run"), ("launch", "triton.runtime.autotuner:Heuristics.run"),
          ("launch", "triton.runtime.interpreter:InterpretedFunction.run"),
          ("autograd", "torch.autograd.function:Function.apply"), ("autograd", "torch.autograd:backward"),
          ("autograd", "torch.autograd:grad")]
STATIC += [("alloc", f"torch:{n}") for n in ("empty", "empty_like", "empty_strided", "zeros", "zeros_like")]
STATIC += [("alloc", f"torch:Tensor.{n}") for n in ("new_empty", "new_zeros")]


def _resolve(spec: str):
    """(owner, attribute) for "module:A.b", or None where the module is not loaded or has no such thing."""
    module_name, _, path = spec.partition(":")
    owner = sys.modules.get(module_name)
    *parents, attr = path.split(".")
    for part in parents:
        owner = getattr(owner, part, None)
    return (owner, attr) if owner is not None and hasattr(owner, attr) else None


class Installer:
    """Wraps targets in place and undoes it; a module function is wrapped in every kernelforge
    module that imported it by name too."""

    def __init__(self, probe: Probe):
        self.probe, self.undo, self.done = probe, [], set()

    def patch(self, owner, attr: str, category: str, label: str, replace=None):
        if (id(owner), attr) in self.done:
            return
        if isinstance(owner, type):
            own = attr in owner.__dict__
            original = owner.__dict__[attr] if own else getattr(owner, attr)
            kind = type(original) if isinstance(original, (staticmethod, classmethod)) else None
            function = original.__func__ if kind else original
            wrapped = self.probe.wrap(category, label, replace(function) if replace else function)
            setattr(owner, attr, kind(wrapped) if kind else wrapped)
            self.undo.append((owner, attr, original if own else None))
            self.done.add((id(owner), attr))
            return
        original = getattr(owner, attr)
        if hasattr(original, "__probe_original__"):
            return
        wrapped = self.probe.wrap(category, label, replace(original) if replace else original)
        holders = [owner] if not isinstance(owner, types.ModuleType) else [owner] + [
            m for name, m in list(sys.modules.items())
            if name.startswith("kernelforge") and m is not owner and getattr(m, attr, None) is original]
        for holder in holders:
            setattr(holder, attr, wrapped)
            self.undo.append((holder, attr, original))
            self.done.add((id(holder), attr))

    def install(self):
        for category, spec in STATIC:
            found = _resolve(spec)
            if found is not None:
                self.patch(*found, category, spec.replace(":", ".").removeprefix("kernelforge."))
        compiler = _resolve("kernelforge.cuda.compiler:CUDACompiler.load")
        if compiler is not None:  # the CUDA extensions: their functions are wrapped as load returns them
            self.patch(*compiler, "launch", "CUDACompiler.load", replace=self._instrumenting_load)
        definitions = getattr(sys.modules.get("kernelforge.ops._opdef"), "DEFINITIONS", {})
        for name, op in list(definitions.items()):
            if callable(getattr(op, "impl", None)):
                self.patch(op, "impl", "op code", f"{name} impl")
        for module_name, module in list(sys.modules.items()):
            if not (module_name.startswith("kernelforge.ops.") or module_name == "kernelforge._rows"):
                continue
            for name, obj in list(vars(module).items()):
                if isinstance(obj, types.FunctionType) and obj.__module__ == module_name:
                    category = "checks" if CHECK_NAME.search(name) else "choice" if CHOICE_NAME.search(name) else None
                    if category:
                        self.patch(module, name, category, f"{module_name.removeprefix('kernelforge.')}.{name}")
        return self

    def _instrumenting_load(self, load):
        def instrumenting_load(compiler, extension, *args, **kwargs):
            module = load(compiler, extension, *args, **kwargs)
            if id(module) in self.done:  # load runs on every CUDA launch: look at a module once
                return module
            self.done.add(id(module))
            for name, obj in list(vars(module).items()):
                if type(obj).__name__ == "builtin_function_or_method" and not name.startswith("_"):
                    self.patch(module, name, "launch", f"cuda {extension}.{name}")
            return module
        return instrumenting_load

    def uninstall(self):
        for owner, attr, original in reversed(self.undo):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self.undo.clear()


def breakdown(step, calls: int, overhead_ns: float, sync=lambda: None) -> dict:
    """Microseconds per step by category (CATEGORIES; "us") and per wrapped function ("functions":
    calls and inclusive microseconds per step); "wrapped_total_us": the wall time per step with the
    wrappers in place, which the categories add up to. One step runs first, untimed."""
    probe = Probe(overhead_ns)
    installer = Installer(probe).install()
    try:
        step()  # wraps the CUDA extensions as they are looked up
        sync()
        probe.reset()
        start = time.perf_counter_ns()
        for _ in range(calls):
            step()
        host = time.perf_counter_ns() - start
        sync()
        wall = time.perf_counter_ns() - start
    finally:
        installer.uninstall()
    us = {c: probe.excl.get(c, 0.0) / calls / 1e3 for c in CATEGORIES}
    # work on other threads (autograd's device thread) ran while the main thread waited in backward
    us["autograd"] -= (probe.foreign_ns + probe.foreign_calls * overhead_ns) / calls / 1e3
    wrapped_calls = sum(probe.calls.values())
    us["instrumentation"] = wrapped_calls * overhead_ns / calls / 1e3
    us["rest"] = host / calls / 1e3 - sum(us[c] for c in CATEGORIES[:-2])
    us["gpu wait"] = (wall - host) / calls / 1e3
    functions = {label: {"calls": probe.calls[label] / calls, "inclusive_us": ns / calls / 1e3}
                 for label, ns in sorted(probe.inclusive.items(), key=lambda kv: -kv[1])}
    return {"us": us, "wrapped_total_us": wall / calls / 1e3, "functions": functions}


__all__ = ["CATEGORIES", "Installer", "Probe", "breakdown", "wrapper_overhead_ns"]
