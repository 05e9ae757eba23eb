"""Row views: any tensor as a (rows, n) matrix along one dim, and back.

Row kernels (softmax, norms, losses) all take a (rows, n) view with unit column stride
and return a dense (rows, n) result; these helpers turn any rank, dim and layout into
such a view (copying only when the layout needs it) and the result back into x's shape.
"""
from __future__ import annotations

from typing import Callable

import torch


def rows_view(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x as a (rows, n) matrix whose rows are the slices along `dim`, columns unit-stride.

    A view when x's layout allows it (any dense or row-sliced layout with `dim` innermost),
    otherwise one copy. `dim` must be normalized and x non-empty.
    """
    if x.dim() == 0:
        moved = x.reshape(1)
    else:  # movedim is a no-op for the last dim, but not free: skip it on the hot path
        moved = x if dim == x.dim() - 1 else x.movedim(dim, -1)
    x2d = moved.reshape(-1, moved.shape[-1])
    if x2d.stride(1) != 1 and x2d.shape[1] > 1:
        x2d = x2d.contiguous()
    return x2d


def rows_layout_shape(x: torch.Tensor, dim: int) -> list[int]:
    """Shape of x with `dim` moved innermost: the dense layout a row kernel writes."""
    if x.dim() == 0:
        return []
    shape = list(x.shape)
    shape.append(shape.pop(dim))
    return shape


def empty_rows_output(x: torch.Tensor, dim: int) -> torch.Tensor:
    """An uninitialized result with x's shape, laid out as the row kernels write it:
    dense with `dim` innermost. Fake and real implementations both use this, so their
    strides agree."""
    out = x.new_empty(rows_layout_shape(x, dim))
    return out.movedim(-1, dim) if x.dim() > 0 else out


def from_rows(out2d: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of rows_view for a dense (rows, n) result: x's shape, layout of empty_rows_output."""
    if x.dim() == 0 or dim == x.dim() - 1:
        return out2d.view_as(x)  # view(torch.Size) parses its argument 5x slower
    return out2d.view(rows_layout_shape(x, dim)).movedim(-1, dim)


def run_rows(x: torch.Tensor, dim: int, kernel: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Apply a row kernel (rows, n) -> dense (rows, n) along `dim` of x, any rank and layout."""
    if x.numel() == 0:
        return empty_rows_output(x, dim)
    return from_rows(kernel(rows_view(x, dim)), x, dim)
