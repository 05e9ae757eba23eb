"""Mask arithmetic shared by the Triton kernels."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_and_scalar(mask, flag):
    """mask & flag for a boolean block `mask` and a boolean scalar `flag`, written as a select:
    Triton 3.9's interpreter stores the & of a block and a scalar as int32 data, which tl.load,
    tl.store and the atomics then refuse as a mask ("mask has unsupported dtype"). Compiled, the
    select is the same predicate; Triton 3.6-3.8 take either form."""
    return tl.where(flag, mask, False)
