"""Input checks and layout helpers shared by the op modules.

Each check holds for real tensors, in fake implementations and under torch.compile
alike, and its message says which argument, what was expected, and what was given.
"""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Callable, Optional, Sequence

import torch

GPU_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT_DTYPES = GPU_FLOAT_DTYPES + (torch.float64,)


# dtype and rank are concrete even on fake tensors and under torch.compile, so these two
# checks are plain Python (a third of the cost of torch._check* on the per-call path).
def check_floating(op: str, name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype] = FLOAT_DTYPES) -> None:
    if t.dtype not in dtypes:
        raise TypeError(
            f"kernelforge.{op}: {name} must have dtype in "
            f"({', '.join(str(d).removeprefix('torch.') for d in dtypes)}), got {t.dtype}"
        )


def normalize_dim(op: str, name: str, dim: int, ndim: int) -> int:
    """dim in [-ndim, ndim) -> [0, ndim); a 0-dim tensor accepts dim 0 and -1, as torch does."""
    rank = ndim if ndim > 0 else 1
    if not -rank <= dim < rank:
        raise IndexError(
            f"kernelforge.{op}: {name} out of range: expected in [{-rank}, {rank - 1}] "
            f"for a tensor of rank {ndim}, got {dim}"
        )
    return dim % rank


def require(condition, message: Callable[[], str]) -> None:
    """torch._check(condition, message) without its cost when the condition is a plain True
    (every eager call): a symbolic condition under tracing still goes to torch._check,
    which records it instead of guarding on it. Both raise RuntimeError. Under Dynamo a
    symbolic condition is checked without the message: Dynamo cannot turn a message closure
    that formats sizes into a graph constant (the fake and eager calls keep it)."""
    if condition is True:
        return
    if condition is False:
        raise RuntimeError(message())
    if torch.compiler.is_compiling():
        torch._check(condition)
    else:
        torch._check(condition, message)


def as_float(op: str, name: str, value) -> float:
    """A real-number argument (a float, an int, a NumPy scalar, a one-element tensor) as a Python
    float, else a TypeError naming it (float() itself says only "could not convert string to
    float", and takes "1e-5" as a number)."""
    if type(value) is float:  # every call with a default: no more cost than this
        return value
    if not isinstance(value, (str, bytes)):
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):
            pass
    raise TypeError(f"kernelforge.{op}: {name} must be a real number, got {type(value).__name__} {value!r}")


def check_same(op: str, what: str, names: Sequence[str], values: Sequence[object]) -> None:
    """All of `values` (devices, dtypes, shapes) equal, else a message naming each argument."""
    first = values[0]
    for v in values[1:]:
        if not v == first:
            raise RuntimeError(f"kernelforge.{op}: expected {', '.join(names)} to have the same {what}, got "
                               + ", ".join(f"{n}: {v}" for n, v in zip(names, values)))


# ----------------------------------------------------------------------------- backend support
def triton_floats(t: torch.Tensor, *args, **options):
    """The support predicate of a Triton backend whose kernels take the first input in float32,
    float16 or bfloat16 on any device Triton runs on (None: supported, else why not)."""
    from kernelforge.triton import why_unavailable

    if t.dtype not in GPU_FLOAT_DTYPES:
        return f"Triton kernels take float32/float16/bfloat16, got {t.dtype}"
    return why_unavailable(t.device)


def is_dtensor(t) -> bool:
    """Whether t is a torch.distributed DTensor, without importing torch.distributed (a DTensor
    exists only once someone imported it)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def autocast_matmul_dtype(device_type: str):
    """The dtype torch.autocast runs matrix products in on this device type, None where it is off.
    An op whose kernels multiply matrices follows it as F.linear does (the products in that dtype,
    the weights cast for each call); its backward then sees gradients of that dtype."""
    # CPU and CUDA always have autocast: asking would be a graph break under torch 2.11's Dynamo
    # (torch._C._is_autocast_available is untraceable there), in every compiled model with these ops
    if device_type not in ("cpu", "cuda") and not torch.amp.is_autocast_available(device_type):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_cast(dtype, *tensors):
    """tensors in `dtype` (autocast's), as autocast casts a matmul's inputs: float32 / float16 /
    bfloat16 ones (not float64, not None); differentiable casts."""
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in GPU_FLOAT_DTYPES else t for t in tensors)


def follows_autocast(*cast: str, when: Optional[Callable[[inspect.BoundArguments], bool]] = None):
    """Decorates an op's public function whose kernels multiply matrices so that under torch.autocast
    it runs as torch's matmul ops do there: the float arguments named in `cast` (the first argument's
    device type decides) in autocast's dtype, where `when(bound arguments)` allows it (always if no
    `when`), and the call itself with autocast off, so that no torch op inside a backend recasts what
    the op computes (its backward then sees gradients in the dtype its forward ran in). Outside
    autocast the function runs as it is, after one autocast query (0.3 us)."""
    def decorate(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            first = args[0] if args else None
            dtype = autocast_matmul_dtype(first.device.type) if isinstance(first, torch.Tensor) else None
            if dtype is None:
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            if when is None or when(bound):
                for name in cast:
                    if name in bound.arguments:
                        bound.arguments[name] = autocast_cast(dtype, bound.arguments[name])[0]
            with torch.autocast(first.device.type, enabled=False):
                return fn(*bound.args, **bound.kwargs)
        return call
    return decorate


def any_inputs(*args, **options):
    """The support predicate of a reference backend: every input (None: supported)."""
    return None
