"""Message passing's aggregation in plain PyTorch: the definition every backend must match.

    out[i] = sum over the edges e with dst[e] == i of x[src[e]]            (reduce="sum")
    out[i] = that sum / max(1, in-degree of i)                             (reduce="mean")

x is (N, ...) (rows are nodes, any trailing shape), src and dst are (E,) int32 or int64 node ids;
the result is (num_nodes, ...) in x's dtype, 0 where no edge arrives (the mean too: the in-degree
is clamped to 1, so such a node gets 0, not 0 / 0). index_select gathers the messages and
index_add_ sums them, in float32 for float16 / bfloat16 (float64 for float64), rounded once to
x's dtype at the end, so a low-precision result carries one rounding error, as the fused kernel's
does. Out-of-range indices raise from index_select / index_add_. Under
torch.use_deterministic_algorithms(True) torch runs index_add_ deterministically on CUDA too.

The backward is the same aggregation with the roles of src and dst swapped:
    grad_x[j] = sum over the edges e with src[e] == j of grad_out[dst[e]] (/ max(1, deg(dst[e])))

This is also the CPU implementation, the float64 test oracle, and what the example models'
native / torchscript / compile levels run (kernelforge.models.levels.TorchKernels): it is torch
ops only, so torch.jit.trace and torch.compile see through it.
"""
from __future__ import annotations

import torch

from kernelforge.reference._accumulation import accumulation_dtype

REDUCTIONS = ("sum", "mean")


def _check_reduce(reduce: str) -> None:
    if reduce not in REDUCTIONS:
        raise ValueError(f"gather_scatter: reduce must be 'sum' or 'mean', got {reduce!r}")


def in_degree(dst: torch.Tensor, num_nodes: int, dtype: torch.dtype) -> torch.Tensor:
    """(num_nodes,) count of the edges arriving at each node, in `dtype` (index_add_ of ones: a
    float count, as the division needs it, deterministic where index_add_ is)."""
    return torch.zeros(num_nodes, dtype=dtype, device=dst.device).index_add_(
        0, dst, torch.ones(dst.shape[0], dtype=dtype, device=dst.device))


def _per_row(values: torch.Tensor, rows: int, trailing_dims: int) -> torch.Tensor:
    """(rows,) viewed to broadcast over a (rows, ...) tensor with `trailing_dims` more dims."""
    return values.view((rows,) + (1,) * trailing_dims)


def gather_scatter(x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, num_nodes: int,
                   reduce: str = "sum") -> torch.Tensor:
    """out (num_nodes, *x.shape[1:]): the sum (or mean) of x[src[e]] over the edges e with dst[e] == i.
    Unfused, index_select writes the (E, ...) messages and index_add_ reads them back: E rows
    written and read again on top of the E rows gathered, the round trip the Triton kernel saves."""
    _check_reduce(reduce)
    acc = accumulation_dtype(x.dtype)
    out = x.new_zeros((num_nodes,) + tuple(x.shape[1:]), dtype=acc)
    out.index_add_(0, dst, x.index_select(0, src).to(acc))
    if reduce == "mean":  # in-degree clamped to 1: a node no edge reaches gets 0, not 0 / 0
        out = out / _per_row(in_degree(dst, num_nodes, acc).clamp(min=1), num_nodes, x.dim() - 1)
    return out.to(x.dtype)


def gather_scatter_backward(grad_output: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, num_rows: int,
                            reduce: str = "sum") -> torch.Tensor:
    """Gradient of gather_scatter with respect to x ((num_rows, *grad_output.shape[1:])): the same
    aggregation with src and dst swapped, each gathered row grad_output[dst[e]] divided by its
    node's in-degree first for the mean."""
    _check_reduce(reduce)
    acc = accumulation_dtype(grad_output.dtype)
    g = grad_output.to(acc)
    if reduce == "mean":
        num_nodes = grad_output.shape[0]
        g = g / _per_row(in_degree(dst, num_nodes, acc).clamp(min=1), num_nodes, grad_output.dim() - 1)
    out = g.new_zeros((num_rows,) + tuple(grad_output.shape[1:]))
    out.index_add_(0, src, g.index_select(0, dst))
    return out.to(grad_output.dtype)


# Row launchers: the interface every backend of the gather_scatter op implements. x2d / grad2d
# are (rows, features) with unit feature stride; the result is a new dense tensor in their dtype.
def gather_scatter_rows(x2d: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, num_nodes: int,
                        mean: bool) -> torch.Tensor:
    return gather_scatter(x2d, src, dst, num_nodes, "mean" if mean else "sum").contiguous()


def gather_scatter_backward_rows(grad2d: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, num_rows: int,
                                 mean: bool) -> torch.Tensor:
    return gather_scatter_backward(grad2d, src, dst, num_rows, "mean" if mean else "sum").contiguous()
