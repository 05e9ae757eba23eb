"""Probe: the demo's forward workloads under torch.compile variants, wall clock and device time a call."""
import sys, time, torch
from torch.profiler import profile, ProfilerActivity
from kernelforge.demo import workloads

torch.manual_seed(0)
names = sys.argv[1].split(",")
variants = sys.argv[2].split(",")
import os; DEV = os.environ.get("PROBE_DEVICE", "cuda")
ws = {w.name: w for w in workloads(torch.device(DEV), torch.bfloat16 if DEV == "cuda" else torch.float32, DEV == "cuda")}

def timed(fn, n=30):
    for _ in range(3): fn()
    (torch.cuda.synchronize() if DEV == "cuda" else None); ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); (torch.cuda.synchronize() if DEV == "cuda" else None); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[len(ts) // 2] * 1e3

def device_ms(fn, n=5):
    if DEV != "cuda": return float("nan")
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n): fn()
        (torch.cuda.synchronize() if DEV == "cuda" else None)
    return sum(e.device_time_total for e in p.key_averages() if e.device_type.name == "CUDA") / n / 1e3

for name in names:
    w = ws[name]; model = w.model
    if name.startswith("GNN"):
        prepared = model.prepare(*w.inputs)
    for v in variants:
        torch._dynamo.reset(); model.set_level("native")
        opts = {"base": {}, "ro": {"mode": "reduce-overhead"}, "static": {"fullgraph": True, "dynamic": False},
                "ro-static": {"fullgraph": True, "dynamic": False, "mode": "reduce-overhead"},
                "ma-nocg": {"mode": "max-autotune-no-cudagraphs"}, "ma": {"mode": "max-autotune"}}
        if v == "fastest":
            model.set_level("fastest")
            call = (lambda: model.run("compute", *prepared)) if name.startswith("GNN") else (lambda: model(*w.inputs))
        elif v == "native":
            call = (lambda: model.compute(*prepared)) if name.startswith("GNN") else (lambda: model(*w.inputs))
        else:
            fn = torch.compile(model.compute if name.startswith("GNN") else model, **opts[v])
            cg = "mode" in opts[v] and "no-cudagraphs" not in opts[v]["mode"]
            def call(fn=fn, cg=cg):
                if cg: torch.compiler.cudagraph_mark_step_begin()
                return fn(*prepared) if name.startswith("GNN") else fn(*w.inputs)
        t0 = time.perf_counter()
        with torch.no_grad():
            call(); (torch.cuda.synchronize() if DEV == "cuda" else None); first = time.perf_counter() - t0
            wall = timed(call); dev = device_ms(call)
        print(f"{name:12} {v:10} first {first:6.1f}s wall {wall:7.3f} ms device {dev:7.3f} ms", flush=True)
    if name.startswith("GNN"):
        with torch.no_grad():
            full = timed(lambda: model(*w.inputs)); prep = timed(lambda: model.prepare(*w.inputs))
        print(f"{name:12} (fastest level's forward with prepare {full:.3f} ms; prepare alone {prep:.3f} ms)")
