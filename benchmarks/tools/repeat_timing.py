"""Re-time forward+backward rows that vary from run to run: three harness timings (p20/median/p80
ms) each with Python's garbage collector on and off, and the wall time per call when calls are
queued back to back (the host's cost per call when it exceeds the GPU's). A row whose host cost
exceeds its device time is host-bound, and its harness median moves with the host's load.

    PYTHONPATH=. python benchmarks/tools/repeat_timing.py   (a CUDA GPU; prints one line per row)

--tiny: the layer norm at a small float32 shape on the CPU, a few calls each: checks the script runs.
"""
import argparse
import gc
import time

import torch

from kernelforge.bench.runner import prepare_call
from kernelforge.bench.suites import SUITES
from kernelforge.bench.timing import time_function

CASES = [("layer_norm", (8192, 16384)), ("layer_norm", (16384, 4096)), ("rms_norm", (16384, 4096)),
         ("swiglu", (16384, 4096)), ("bias_gelu", (16384, 4096)), ("gelu", (16384, 4096))]
TINY_CASES = [("layer_norm", (4, 64))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU: checks the script runs")
    args = parser.parse_args(argv)
    device, dtype = (torch.device("cpu"), torch.float32) if args.tiny else (torch.device("cuda"), torch.bfloat16)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    warmup, repeat, queued = (1, 3, 3) if args.tiny else (10, 100, 20)
    for op, shape in TINY_CASES if args.tiny else CASES:
        suite = SUITES[op]
        inputs = suite.make_inputs(shape, dtype, device)
        impls = {"kernelforge": suite.kernelforge, "torch eager": suite.baselines()["torch eager"]}
        for name, fn in impls.items():
            call = prepare_call(fn, inputs, "fwd+bwd")
            res = []
            for gc_on in (True, False):
                (gc.enable if gc_on else gc.disable)()
                for _ in range(3):
                    t = time_function(call, device, warmup=warmup, repeat=repeat)
                    res.append(f"{'gc' if gc_on else 'nogc'}:{t.p20_ms:.3f}/{t.median_ms:.3f}/{t.p80_ms:.3f}")
            gc.enable()
            sync()
            for _ in range(queued):  # calls to settle, then as many queued calls timed on the host
                call()
            start = time.perf_counter()
            for _ in range(queued):
                call()
            host_nosync = (time.perf_counter() - start) / queued * 1e3
            sync()
            print(f"{op} {shape} {name}: {' '.join(res)} | wall per call (queued) {host_nosync:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
