"""Probe: the demo GNN forward (prepared inputs) at compile, fastest, fastest with kf's sorted gather-scatter, triton."""
import time, torch
from torch.profiler import profile, ProfilerActivity
from kernelforge.demo import workloads
from kernelforge.models import levels

class FastestSorted(levels.FastestKernels):
    graph_edges = levels.KernelforgeKernels.graph_edges
    gather_scatter = levels.KernelforgeKernels.gather_scatter

def timed(fn, n=50):
    for _ in range(5): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[len(ts) // 2] * 1e3

def device_ms(fn, n=5):
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n): fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in p.key_averages() if e.device_type.name == "CUDA") / n / 1e3

torch.manual_seed(0)
w = {w.name: w for w in workloads(torch.device("cuda"), torch.bfloat16, True)}["GNN forward"]
model = w.model
prepared = model.prepare(*w.inputs)
want = model.compute(*prepared).float()
rows = []
with torch.no_grad():
    for name in ("compile", "fastest", "fastest+kf-sorted", "triton"):
        torch._dynamo.reset()
        if name == "fastest+kf-sorted":
            model.set_level("fastest"); levels_ops = FastestSorted()
            saved = levels.FASTEST_KERNELS
            levels.FASTEST_KERNELS = levels_ops
        else:
            model.set_level(name)
        call = lambda: model.run("compute", *prepared)
        t0 = time.perf_counter(); got = call().float(); torch.cuda.synchronize(); first = time.perf_counter() - t0
        err = (got - want).abs().max().item()
        print(f"{name:18} first {first:5.1f}s wall {timed(call):7.3f} ms device {device_ms(call):7.3f} ms max err {err:.2e}", flush=True)
        if name == "fastest+kf-sorted":
            levels.FASTEST_KERNELS = saved
