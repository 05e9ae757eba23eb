"""Launch helpers shared by the Triton op modules: warps per program, the device guard,
the SM count that sizes persistent grids, and the device's compute capability."""
from __future__ import annotations

import functools

import torch


def warps_for(elements: int) -> int:
    """Warps for a program that holds `elements` values: about 32 a thread. The H200
    softmax sweep's best (or within noise of it) at 1024, 4096 and 16384 columns;
    32768 elements take 32 warps, the most a program may have."""
    for warps in (4, 8, 16):
        if elements <= warps * 32 * 32:
            return warps
    return 32


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def device_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device, cached: torch.cuda.get_device_capability costs ~9 us
    of host time a call, a tenth of a small GEMM's."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; on the CPU (Triton's interpreter runs one
    program at a time) a small stand-in, so persistent grids still cover several programs."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


class on_device:
    """Make x's device current for the launch when it is not (Triton launches on the
    current device); costs nothing in the common case."""

    def __init__(self, x: torch.Tensor):
        self.guard = None
        if x.device.type == "cuda" and x.device.index != torch.cuda.current_device():
            self.guard = torch.cuda.device(x.device)

    def __enter__(self):
        if self.guard is not None:
            self.guard.__enter__()

    def __exit__(self, *exc):
        if self.guard is not None:
            self.guard.__exit__(*exc)
