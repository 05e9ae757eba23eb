"""Host-side TMA descriptors (Triton's and Gluon's TensorDescriptor): the layouts TMA can read, and
descriptors made once per call signature.

A descriptor is a base tensor, a shape, strides, a block shape (and, for Gluon, a shared-memory
layout); its constructor checks the base's alignment, the strides and the block shape: 8.4 us a
descriptor against 2.3 us for `rebased` (a 2-core CPU machine; a GEMM call takes three to five).
Every input of those checks is
part of a launcher's call signature (dtype, 16-byte alignment, shape, strides), so a launcher
builds each descriptor once, checked, as a template (`descriptor_template`: without its base, so
that no cached object keeps a tensor's memory alive) and `rebased` gives each later call its own
copy on that call's tensor, unchecked. Each call gets a fresh object: the autotuner's pre-hook
sets block shapes on the descriptors it is given, and autograd's device thread launches
alongside the main thread, so shared descriptors would race. The launcher (the compiled kernel's
C launcher) encodes the CUtensorMap from base.data_ptr(), shape, strides and the kernel's block
shape on every launch either way.
"""
from __future__ import annotations

from typing import Optional

import torch

_new_object = object.__new__


def descriptor_template(descriptor):
    """`descriptor`, which its constructor has checked against its base, without the base: what
    `rebased` copies on later calls at the same signature."""
    descriptor.base = None
    return descriptor


def rebased(template, base: torch.Tensor):
    """A copy of `template` on base's memory, without the constructor's checks (about a third of
    its host time). base: a tensor of the template's signature (dtype, alignment, shape and
    strides), or one that starts at the same element (a batch of one holding the matrix)."""
    descriptor = _new_object(type(template))
    descriptor.__dict__.update(template.__dict__)
    descriptor.base = base
    return descriptor


__all__ = ["descriptor_template", "rebased"]


def tma_layout(t: torch.Tensor, unit_dim: int) -> Optional[tuple]:
    """(shape, strides) of a TMA descriptor of t (2-D) with its unit-stride dim last, or None
    when TMA cannot read it that way (that stride is not 1, rows are not a multiple of 16 bytes
    apart, the start is not 16-byte aligned, an extent is 0)."""
    view = t if unit_dim == 1 else t.t()
    rows, cols = view.shape
    if rows == 0 or cols == 0 or view.data_ptr() % 16:
        return None
    if view.stride(1) != 1 and cols > 1:
        return None
    # A stride over an extent of 1 is never followed: any aligned value describes the view.
    row_stride = view.stride(0) if rows > 1 else -(-cols // 8) * 8
    if row_stride * view.element_size() % 16:
        return None
    return (rows, cols), (row_stride, 1)


def tma_layouts(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, compute: str):
    """(layouts of a, b and out, the operands' memory orders) for kernelforge.triton.gemm's TMA kernel, or None when
    it cannot take them: a batch, operands not in the compute dtype, or a layout TMA cannot
    read."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "tf32": torch.float32}.get(compute)
    if a.shape[0] != 1 or b.shape[0] != 1 or not a.dtype == b.dtype == dtype:
        return None
    found = {}
    for name, t, natural in (("a", a[0], "A_K_CONTIGUOUS"), ("b", b[0], "B_N_CONTIGUOUS")):
        # e4m3 and tf32: K-major only (the GEMM launcher makes them so), the order their
        # tensor-core instruction reads
        unit_dims = ((1,) if name == "a" else (0,)) if compute in ("fp8", "tf32") else (1, 0)
        for unit_dim in unit_dims:
            layout = tma_layout(t, unit_dim)
            if layout is not None:
                found[name], found[natural] = layout, unit_dim == 1
                break
        else:
            return None
    out_layout = tma_layout(out[0], 1)
    if out_layout is None:
        return None
    return (found["a"], found["b"], out_layout), {k: found[k] for k in ("A_K_CONTIGUOUS", "B_N_CONTIGUOUS")}
