"""Input checks and layout helpers shared by the op modules.

Each check holds for real tensors, in fake implementations and under torch.compile
alike, and its message says which argument, what was expected, and what was given.
"""
from __future__ import annotations

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
    which records it instead of guarding on it. Both raise RuntimeError."""
    if condition is not True:
        torch._check(condition, message)


def check_same(op: str, what: str, names: Sequence[str], values: Sequence[object]) -> None:
    """All of `values` (devices, dtypes, shapes) equal, else a message naming each argument."""
    first = values[0]
    for v in values[1:]:
        if not v == first:
            raise RuntimeError(f"kernelforge.{op}: expected {', '.join(names)} to have the same {what}, got "
                               + ", ".join(f"{n}: {v}" for n, v in zip(names, values)))


def plain_eager_call(x: torch.Tensor, *others: Optional[torch.Tensor]) -> bool:
    """True in plain eager mode: not tracing or compiling, no tensor subclass, mode or
    functorch transform. Then the public functions skip the dispatcher: they call the
    implementation directly, through an autograd.Function when a gradient is needed. A Python
    custom op costs tens of microseconds a call in dispatch and autograd glue (measured
    with benchmarks/softmax_overhead.py), more than the kernel at small shapes. Everything
    else (torch.compile, FakeTensor, vmap, torch.func...) goes through the registered op."""
    # `others` (weights, biases, residuals) may also be nn.Parameter, a subclass that adds no
    # torch_function behavior.
    return (
        not torch.compiler.is_compiling()
        and type(x) is torch.Tensor
        and all(t is None or type(t) in (torch.Tensor, torch.nn.Parameter) for t in others)
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._is_torch_function_mode_enabled()
        and not torch._C._are_functorch_transforms_active()
    )


def not_a_view(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """`t` (a launcher's result, reshaped back to the input's layout) as a tensor that is not a
    view, on the same memory. What an eager autograd.Function returns must not be a view: autograd
    refuses in-place ops on "a view created inside a custom Function" (y = norm(x); y += r),
    which torch's own modules' outputs allow. No copy: the memory is nobody else's."""
    if t is None or not t._is_view():
        return t
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
