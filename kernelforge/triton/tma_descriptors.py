"""Host-side TMA descriptors (Triton's and Gluon's TensorDescriptor) made once per call signature.

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
