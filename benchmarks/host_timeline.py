"""Where a small call's host time goes, function by function and thread by thread.

cProfile doubles the cost of every Python call and does not see autograd's device thread.
Here chosen functions are wrapped with perf_counter_ns pairs (~0.3 us each), and each wrapper
adds its inclusive time to a table keyed by (thread, function). Per scenario:
  - the wall time per call, back to back, without the wrappers;
  - the same with them, and each wrapped function's inclusive microseconds per call on the
    main thread and on other threads (autograd runs CUDA backwards on its device thread);
  - the launch floor: Triton's CompiledKernel.run called directly with the arguments
    JITFunction.run would pass (what a launch costs without the binder and cache lookup).

    PYTHONPATH=. python benchmarks/host_timeline.py   (a CUDA GPU)
"""
from __future__ import annotations

import collections
import functools
import os
import sys
import threading
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import kernelforge as kf
from kernelforge.bench.timing import CallInBackward, wall_us_per_call

_TABLE: dict = collections.defaultdict(lambda: [0, 0])  # (thread kind, name) -> [calls, ns]
_MAIN = threading.main_thread().ident


def _wrap(name, fn):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            cell = _TABLE[("main" if threading.get_ident() == _MAIN else "other", name)]
            cell[0] += 1
            cell[1] += time.perf_counter_ns() - start
    timed.__wrapped_original__ = fn
    return timed


def _targets():
    """(owner, attribute, label): module functions, launchers, Triton's entry points."""
    import triton.runtime.autotuner as autotuner
    import triton.runtime.jit as jit

    from kernelforge import backends
    from kernelforge.ops import _common, attention as attention_ops, gemm as gemm_ops
    from kernelforge.reference import attention as reference_attention
    from kernelforge.triton import attention as triton_attention, attention_decode, gemm as triton_gemm

    out = [(jit.JITFunction, "run", "triton JITFunction.run"),
           (autotuner.Autotuner, "run", "triton Autotuner.run"),
           (autotuner.Heuristics, "run", "triton Heuristics.run"),
           (backends, "select", "backends.select"),
           (_common, "plain_eager_call", "plain_eager_call"),
           (reference_attention.Visibility, "of", "Visibility.of")]
    for module, names in (
        (gemm_ops, ("gemm", "_gemm", "_check", "_batched", "_gemm_backward", "_matmul", "_weight_grad")),
        (triton_gemm, ("gemm", "_launch", "_launch_tma", "_tma_operands")),
        (attention_ops, ("flash_attention", "_check_qkv", "_check_mask", "_check_block_mask", "_forward")),
        (triton_attention, ("flash_forward", "_mask_args", "_band")),
        (attention_decode, ("decode_forward",)),
    ):
        out += [(module, n, f"{module.__name__.removeprefix('kernelforge.')}.{n}") for n in names]
    out.append((torch, "empty", "torch.empty"))
    return out


def _install():
    """Wrap every target, in its owner and in every kernelforge module that imported it by name."""
    undo = []
    for owner, attr, label in _targets():
        if isinstance(owner, type):  # a method: the class's own entry (staticmethod objects included)
            original = owner.__dict__[attr]
            function = original.__func__ if isinstance(original, staticmethod) else original
            wrapped = _wrap(label, function)
            wrapped = staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped
            setattr(owner, attr, wrapped)
            undo.append((owner, attr, original))
            continue
        original = getattr(owner, attr)
        wrapped = _wrap(label, original)
        holders = [owner] + [m for name, m in list(sys.modules.items())
                             if name.startswith("kernelforge") and m is not owner and getattr(m, attr, None) is original]
        for holder in holders:
            setattr(holder, attr, wrapped)
            undo.append((holder, attr, original))
    return undo


def _uninstall(undo):
    for holder, attr, original in reversed(undo):
        setattr(holder, attr, original)


def timeline(name, fn, calls=300):
    plain = wall_us_per_call(fn, calls=calls, warmup=30)
    undo = _install()
    try:
        fn()
        torch.cuda.synchronize()
        _TABLE.clear()
        wrapped = wall_us_per_call(fn, calls=calls, warmup=0)
        rows = sorted(_TABLE.items(), key=lambda kv: -kv[1][1])
    finally:
        _uninstall(undo)
    print(f"== {name}: {plain:.1f} us a call back to back ({wrapped:.1f} with the wrappers)")
    for (thread, label), (count, ns) in rows:
        print(f"   {thread:5s} {label:40s} {count / calls:5.1f} x  {ns / calls / 1e3:8.1f} us a call")
    sys.stdout.flush()


@triton.jit
def _touch(X):
    tl.store(X + tl.program_id(0), 1.0)


@triton.jit
def _touch_many(X, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9,
                c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, C0: tl.constexpr, C1: tl.constexpr):
    tl.store(X + tl.program_id(0), (a0 + b0 + c0 + C0 + C1).to(tl.float32))


def _direct_launch(kernel, grid, *args, **kwargs):
    """A function that launches `kernel` the way JITFunction.run ends, skipping everything
    before: the compiled kernel and the argument list captured from one ordinary launch."""
    compiled = kernel[grid](*args, **kwargs)
    bound = list(args) + [kwargs[p.name] for p in kernel.params[len(args):] if p.name in kwargs]
    grid = tuple(grid) + (1,) * (3 - len(grid))
    device = torch.cuda.current_device()

    def launch():
        stream = torch.cuda.current_stream(device).cuda_stream
        compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *bound)
    return launch


def launch_costs():
    buf = torch.zeros(8, device="cuda")
    ints = list(range(3, 33))
    print(f"== Triton launch, 1 argument: {wall_us_per_call(lambda: _touch[(1,)](buf), calls=1000):.1f} us; "
          f"direct CompiledKernel.run: {wall_us_per_call(_direct_launch(_touch, (1,), buf), calls=1000):.1f} us")
    many = lambda: _touch_many[(1,)](buf, *ints, C0=1, C1=2)  # noqa: E731
    print(f"== Triton launch, 31 arguments + 2 constexprs: {wall_us_per_call(many, calls=1000):.1f} us; direct: "
          f"{wall_us_per_call(_direct_launch(_touch_many, (1,), buf, *ints, C0=1, C1=2), calls=1000):.1f} us")
    print(f"== torch.empty(4096): {wall_us_per_call(lambda: torch.empty(4096, device='cuda'), calls=1000):.1f} us; "
          f"empty cuda kernel (x.zero_() of 8 floats): {wall_us_per_call(lambda: buf.zero_(), calls=1000):.1f} us")


def graph_us(fn, calls=200):
    """Device-bound cost: fn captured in a CUDA graph, replays back to back."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return wall_us_per_call(graph.replay, calls=calls, warmup=10)


def decode():
    B, H, Hkv, Sq, Sk, D = 1, 32, 8, 1, 4096, 128
    q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16)
    ours = lambda: kf.flash_attention(q, k, v)  # noqa: E731
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    timeline(f"decode {B}x{H}x{Hkv}x{Sq}x{Sk}x{D} kf.flash_attention", ours)
    print(f"   SDPA: {wall_us_per_call(sdpa, calls=300):.1f} us a call back to back")
    print(f"   in a CUDA graph: kf.flash_attention {graph_us(ours):.1f} us, SDPA {graph_us(sdpa):.1f} us a replay")


def _pin(main_cpus, device_cpus):
    x = torch.zeros(4, device="cuda", requires_grad=True)
    # pid 0 in sched_setaffinity: the calling thread only, here autograd's device thread
    torch.autograd.grad(CallInBackward.apply(x, lambda: os.sched_setaffinity(0, device_cpus)), x,
                        torch.ones_like(x))
    os.sched_setaffinity(0, main_cpus)


def pinned_steps(step):
    """The step with the calling thread and autograd's device thread pinned to one core, then to
    two cores: if the cost is the objects both threads touch moving between cores' caches, one
    core removes it and two do not."""
    everything = os.sched_getaffinity(0)
    if len(everything) < 2:
        return
    first, second = sorted(everything)[:2]
    try:
        for name, main_cpus, device_cpus in (("one core", {first}, {first}), ("two cores", {first}, {second})):
            _pin(main_cpus, device_cpus)
            print(f"   pinned, both threads on {name}: {wall_us_per_call(step, calls=300, warmup=30):.1f} us a step")
    finally:
        _pin(everything, everything)


def gemm():
    M, N, K = 16, 4096, 4096
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    timeline(f"gemm fwd {M}x{N}x{K}", lambda: kf.gemm(a.detach(), w.detach().t()))
    step = lambda: torch.autograd.grad(kf.gemm(a, w.t()), (a, w), g)  # noqa: E731
    timeline(f"gemm fwd+bwd {M}x{N}x{K}", step)
    with torch.autograd.set_multithreading_enabled(False):
        timeline(f"gemm fwd+bwd {M}x{N}x{K}, backward on the calling thread", step)
    pinned_steps(step)
    native = lambda: torch.autograd.grad(torch.matmul(a, w.t()), (a, w), g)  # noqa: E731
    print(f"   torch.matmul fwd+bwd: {wall_us_per_call(native, calls=300):.1f} us a step")
    with kf.use_backend("cuda"):
        timeline(f"gemm fwd+bwd {M}x{N}x{K}, CUDA backend", step)


if __name__ == "__main__":
    torch.manual_seed(0)
    launch_costs()
    decode()
    gemm()
