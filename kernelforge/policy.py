"""kernelforge.gpu_kernel: run a function under a precision policy and, if asked, on its own
CUDA stream (@gpu_kernel(precision="fp16"),
@gpu_kernel(use_tensor_cores=True), @gpu_kernel(streams=True)).

precision sets what kernelforge.gemm(..., precision="auto") computes in during the call
(see kernelforge.precision); explicit precision arguments inside still win.
use_tensor_cores: True lets float32 GEMMs use tf32 tensor cores ("tf32"), False keeps them
on IEEE float32 ("fp32"); ignored when precision is given; 16-bit inputs always use them.
streams=True runs the call on a side stream of the current CUDA device (one per device,
made on first use): the side stream first waits for the caller's, and the caller's waits
for the side stream's work before the call returns, so results are ordered as if the call
ran inline, while work on other streams may overlap it. Tensors the call returns are
recorded on the caller's stream, so the allocator does not hand their memory to the side
stream while the caller still reads them. With no CUDA device streams=True changes nothing
(the CPU has no streams to order).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from kernelforge.ops.gemm import PRECISIONS, precision as precision_scope

_side_streams: dict[int, "torch.cuda.Stream"] = {}


def _side_stream(device: int) -> "torch.cuda.Stream":
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device=device)
    return stream


def _record(result, stream) -> None:
    if isinstance(result, torch.Tensor):
        if result.is_cuda:
            result.record_stream(stream)
    elif isinstance(result, (tuple, list)):
        for item in result:
            _record(item, stream)
    elif isinstance(result, dict):
        for item in result.values():
            _record(item, stream)


def _on_side_stream(fn: Callable, args, kwargs):
    device = torch.cuda.current_device()
    caller = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(caller)
    with torch.cuda.stream(side):
        result = fn(*args, **kwargs)
    caller.wait_stream(side)
    _record(result, caller)
    return result


def _mode(precision: Optional[str], use_tensor_cores: Optional[bool]) -> tuple[Optional[str], bool]:
    """(mode, float32_only) for kernelforge.precision."""
    if precision is not None:
        if precision not in PRECISIONS[1:]:
            raise ValueError(f"kernelforge.gpu_kernel: precision must be None or one of {PRECISIONS[1:]}, "
                             f"got {precision!r}")
        return precision, False
    if use_tensor_cores is None:
        return None, False
    return ("tf32" if use_tensor_cores else "fp32"), True


def gpu_kernel(fn: Optional[Callable] = None, *, precision: Optional[str] = None,
               use_tensor_cores: Optional[bool] = None, streams: bool = False):
    """Decorator (bare or with arguments); see the module docstring."""
    mode, float32_only = _mode(precision, use_tensor_cores)

    def wrap(f: Callable) -> Callable:
        @functools.wraps(f)
        def run(*args, **kwargs):
            with precision_scope(mode, float32_only=float32_only):
                if streams and torch.cuda.is_available():
                    return _on_side_stream(f, args, kwargs)
                return f(*args, **kwargs)

        run.precision, run.streams = mode, streams
        return run

    return wrap(fn) if fn is not None else wrap


__all__ = ["gpu_kernel"]
