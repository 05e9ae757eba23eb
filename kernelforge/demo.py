"""`kernelforge demo` (what `make demo` runs): softmax on the best device here.

Each implementation that can run here computes softmax of the same input; each result is
checked against the float64 reference by the test suite's rule (error at most 2x
PyTorch's own at this dtype, plus one ulp), then timed. Prints one table.
"""
from __future__ import annotations

from typing import Callable, Optional, TextIO

import torch

import kernelforge as kf
from kernelforge import backends, reference
from kernelforge.bench.timing import time_function


def _candidates(device: torch.device) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    impls: dict[str, Callable] = {}
    for name, impl in backends.implementations("softmax").items():
        if device.type == "cpu" and name == "triton":
            continue  # the interpreter is for tests, far too slow to time
        sample = torch.empty(1, 8, device=device)
        if impl.supports(sample) is None:
            impls[f"kernelforge[{name}]"] = (lambda b: lambda x: _forced(b, x))(name)
    impls["torch eager"] = lambda x: torch.softmax(x, -1)
    if device.type == "cuda":
        impls["torch.compile"] = torch.compile(lambda x: torch.softmax(x, -1), dynamic=False)
    return impls


def _forced(backend: str, x: torch.Tensor) -> torch.Tensor:
    with kf.use_backend(backend):
        return kf.softmax(x, -1)


def run_demo(out: TextIO, device: Optional[str] = None) -> int:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        shapes, dtype, repeat = [(16384, 4096), (8, 4096)], torch.bfloat16, 50
        where = torch.cuda.get_device_name(dev)
    else:
        shapes, dtype, repeat = [(1024, 4096), (8, 4096)], torch.float32, 20
        where = "CPU (no GPU visible: Triton and CUDA backends need one)"
    out.write(f"kernelforge demo: softmax over the last dim, {str(dtype).removeprefix('torch.')}, on {where}\n")
    default = backends.select("softmax", torch.empty(1, 8, device=dev, dtype=dtype)).backend
    out.write(f"kernelforge.softmax picks the {default} backend here; `kernelforge.explain` says why.\n\n")

    header = f"{'shape':>12}  {'implementation':<22} {'max err':>9}  {'check':<5} {'median ms':>10} {'GB/s':>8}"
    out.write(header + "\n" + "-" * len(header) + "\n")
    failures = 0
    for rows, cols in shapes:
        x = torch.randn(rows, cols, device=dev, dtype=dtype) * 3
        oracle = reference.softmax(x.double(), -1)
        torch_err = (torch.softmax(x, -1).double() - oracle).abs().max().item()
        bound = 2 * torch_err + torch.finfo(dtype).eps
        for name, fn in _candidates(dev).items():
            err = (fn(x).double() - oracle).abs().max().item()
            ok = err <= bound
            failures += not ok
            t = time_function(lambda: fn(x), dev, warmup=3, repeat=repeat, back_to_back=rows * cols < 2**20)
            gbps = 2 * x.numel() * x.element_size() / (t.median_ms * 1e-3) / 1e9
            out.write(f"{f'{rows}x{cols}':>12}  {name:<22} {err:9.2e}  {'ok' if ok else 'FAIL':<5} "
                      f"{t.median_ms:10.4f} {gbps:8.3g}\n")
    out.write("\nGB/s counts the input read once and the output written once.\n")
    out.write("all results match the float64 reference\n" if not failures else f"{failures} result(s) FAILED the check\n")
    return 1 if failures else 0
