"""Re-time forward+backward rows that vary from run to run: three harness timings (p20/median/p80
ms) each with Python's garbage collector on and off, and the wall time per call when calls are
queued back to back (the host's cost per call when it exceeds the GPU's). A row whose host cost
exceeds its device time is host-bound, and its harness median moves with the host's load.

    PYTHONPATH=. python benchmarks/repeat_timing.py   (a CUDA GPU; prints one line per row)
"""
import gc
import time

import torch

from kernelforge.bench.runner import prepare_call
from kernelforge.bench.suites import SUITES
from kernelforge.bench.timing import time_function

cases = [("layer_norm", (8192, 16384)), ("layer_norm", (16384, 4096)), ("rms_norm", (16384, 4096)),
         ("swiglu", (16384, 4096)), ("bias_gelu", (16384, 4096)), ("gelu", (16384, 4096))]
for op, shape in cases:
    suite = SUITES[op]
    inputs = suite.make_inputs(shape, torch.bfloat16, torch.device("cuda"))
    impls = {"kernelforge": suite.kernelforge, "torch eager": suite.baselines()["torch eager"]}
    for name, fn in impls.items():
        call = prepare_call(fn, inputs, "fwd+bwd")
        res = []
        for gc_on in (True, False):
            (gc.enable if gc_on else gc.disable)()
            for _ in range(3):
                t = time_function(call, "cuda", warmup=10, repeat=100)
                res.append(f"{'gc' if gc_on else 'nogc'}:{t.p20_ms:.3f}/{t.median_ms:.3f}/{t.p80_ms:.3f}")
        gc.enable()
        torch.cuda.synchronize()
        for _ in range(20):  # 20 calls to settle, then 20 queued calls timed on the host
            call()
        start = time.perf_counter()
        for _ in range(20):
            call()
        host_nosync = (time.perf_counter() - start) / 20 * 1e3
        torch.cuda.synchronize()
        print(f"{op} {shape} {name}: {' '.join(res)} | wall per call (queued) {host_nosync:.3f} ms", flush=True)
