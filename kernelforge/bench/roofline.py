"""The two floors of every benchmark: memory bandwidth and matrix throughput, measured.

`get_ceilings(device)` measures, once per device name, the device-to-device copy
bandwidth (bytes read + written) and the matmul rate of each precision the device has
(bf16, tf32, fp8 through torch._scaled_mm on GPUs; fp32 on the CPU), and caches them in
~/.cache/kernelforge/ceilings.json (KERNELFORGE_CACHE_DIR moves it). `roofline(cost, ms,
ceilings)` turns a time into GB/s or TFLOP/s and the percentage of the matching ceiling.
"""
from __future__ import annotations

import datetime
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch

from kernelforge.bench.timing import time_function


@dataclass(frozen=True)
class Cost:
    """What one call must move and compute at the least: each input read once, each output
    written once; `flops` counts a multiply-add as 2. `precision` names the matmul ceiling
    that compute-bound costs are held against (e.g. "bf16")."""

    bytes: int
    flops: int = 0
    precision: Optional[str] = None

    @property
    def compute_bound(self) -> bool:
        return self.precision is not None


@dataclass
class Ceilings:
    device_name: str
    copy_gbps: float
    matmul_tflops: dict = field(default_factory=dict)
    measured_at: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({os.cpu_count()} cores)"


def _cache_path() -> Path:
    root = os.environ.get("KERNELFORGE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kernelforge")
    return Path(root) / "ceilings.json"


def _matmul_tflops(device: torch.device, precision: str, n: int) -> Optional[float]:
    if precision == "fp8":
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            return None
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        dtype = {"bf16": torch.bfloat16, "tf32": torch.float32, "fp32": torch.float32}[precision]
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        fn = lambda: a @ b  # noqa: E731
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        t = time_function(fn, device, warmup=3, repeat=10 if device.type == "cuda" else 3)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return 2 * n**3 / (t.median_ms * 1e-3) / 1e12


def measure_ceilings(device: torch.device | str) -> Ceilings:
    """Measure now: a large copy (1 GiB on a GPU, 256 MiB on the CPU) and square matmuls."""
    device = torch.device(device)
    if device.type == "cuda":
        elements, n, precisions = 2**29, 8192, ("bf16", "tf32", "fp8")
    else:
        elements, n, precisions = 2**26, 1024, ("fp32",)
    x = torch.randn(elements // 2, device=device, dtype=torch.float32).view(torch.bfloat16)
    y = torch.empty_like(x)
    copy = time_function(lambda: y.copy_(x), device, warmup=3, repeat=20)
    gbps = 2 * x.numel() * x.element_size() / (copy.median_ms * 1e-3) / 1e9
    del x, y
    rates = {p: r for p in precisions if (r := _matmul_tflops(device, p, n)) is not None}
    return Ceilings(device_name(device), gbps, rates,
                    datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def get_ceilings(device: torch.device | str, refresh: bool = False) -> Ceilings:
    """The cached ceilings of this device name, measured on first use (or when refresh)."""
    device = torch.device(device)
    path = _cache_path()
    cache = json.loads(path.read_text()) if path.is_file() else {}
    name = device_name(device)
    if not refresh and name in cache:
        return Ceilings(**cache[name])
    ceilings = measure_ceilings(device)
    cache[name] = ceilings.as_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cache, indent=1))
    return ceilings


def roofline(cost: Cost, ms: float, ceilings: Ceilings) -> dict:
    """Achieved rate and its percentage of the matching ceiling."""
    seconds = ms * 1e-3
    row = {"gbps": cost.bytes / seconds / 1e9}
    if cost.compute_bound:
        row["tflops"] = cost.flops / seconds / 1e12
        ceiling = ceilings.matmul_tflops.get(cost.precision)
        row["pct_of_ceiling"] = 100 * row["tflops"] / ceiling if ceiling else None
        row["ceiling"] = f"{cost.precision} matmul"
    else:
        row["pct_of_ceiling"] = 100 * row["gbps"] / ceilings.copy_gbps
        row["ceiling"] = "copy bandwidth"
    return row
