"""The second stage of a deterministic column reduction: kernels that leave per-program partials in
a (programs, n) float32 buffer (the norms' weight and bias gradients, the bias gradient of bias +
activation) finish here, in a fixed order and without atomics, one launch for one or two buffers.
A Triton kernel rather than torch's sum(0): faster on these tall, narrow buffers (below), and an op
whose every step is a Triton launch is replayed whole by its eager plan (kernelforge._eager_plans)
and traced whole by torch.compile."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernelforge.triton._launch import cdiv, launch

BLOCK = (32, 64)  # partial rows x columns a program loads at once


@triton.jit
def sum_partials_kernel(
    part_ptr, second_part_ptr, out_ptr, second_out_ptr, n_partials, n_cols,
    TWO: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Column sums of one (TWO: two) (n_partials, n) float32 partial buffers, in a fixed order (so
    deterministic), stored in the outputs' dtypes. A program owns BLOCK_N columns and walks all
    partial rows. Bytes: 4 * n_partials * n read per buffer, n * E written; FLOPs: an add per element
    read. (torch's sum(0) over these narrow, tall buffers ran at ~0.3 TB/s: 32 us a buffer at
    528 x 4096, H100.)"""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    acc = tl.zeros((BLOCK_P, BLOCK_N), tl.float32)
    second_acc = tl.zeros((BLOCK_P, BLOCK_N), tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts < n_partials)[:, None] & col_mask[None, :]
        offsets = parts.to(tl.int64)[:, None] * n_cols + cols[None, :]
        acc += tl.load(part_ptr + offsets, mask=mask, other=0.0)
        if TWO:
            second_acc += tl.load(second_part_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=col_mask)
    if TWO:
        tl.store(second_out_ptr + cols, tl.sum(second_acc, axis=0).to(second_out_ptr.dtype.element_ty),
                 mask=col_mask)


def sum_partials(partial: torch.Tensor, out: torch.Tensor, second_partial: Optional[torch.Tensor] = None,
                 second_out: Optional[torch.Tensor] = None) -> None:
    """out[:] = partial.sum(0) in out's dtype (and second_out from second_partial, of the same shape),
    partials (programs, n) contiguous float32, outputs (n,) contiguous. On the current device (the
    caller's on_device)."""
    programs, n_cols = partial.shape
    two = second_partial is not None
    launch(sum_partials_kernel, (cdiv(n_cols, BLOCK[1]),), partial, second_partial if two else partial,
           out, second_out if two else out, programs, n_cols, TWO=two, BLOCK_P=BLOCK[0], BLOCK_N=BLOCK[1],
           num_warps=4)
