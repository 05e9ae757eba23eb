"""GEMM with a fused epilogue through the CUDA extension "gemm" (csrc/gemm_cuda.cu,
csrc/gemm_kernel.cuh, csrc/gemm_binding.cpp): mma.sync tensor cores, float16 / bfloat16
operands, float32 accumulation, a 128 x 128 x 32 tile staged through shared memory by a
4-stage cp.async pipeline, and out = act(a @ b + bias) + residual computed in float32 on the
unrounded accumulator with one rounding.

`gemm` is the launcher the ops layer calls (the interface of kernelforge/reference/gemm.py,
after asking `why_not`); `matmul` is the raw API (no autograd), which is also what
`kernelforge.cuda.gemm(a, b, block_size=256, shared_mem=True)` calls. Both run on the current
CUDA stream of a's device.

Layouts: each operand is read in place when one of its two matrix dims has unit stride (for
a, K or M; for b, N or K: a Linear weight's b = W.t() is read as it is), its pointer is
16-byte aligned and its other strides are multiples of 8 elements. Anything else (no unit
stride, a misaligned view, rows of a length that is not a multiple of 8) is copied once by
the binding into an aligned buffer first: correct for every layout, one extra pass over that
operand.

The module is named matmul, not gemm, so that importing it (the backend registry does)
leaves the package's `kernelforge.cuda.gemm` function alone.
"""
from __future__ import annotations

import math
import types
from typing import Optional

import torch

from kernelforge.cuda.compiler import device_limits, get_cuda_compiler

COMPUTE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Codes of the binding (csrc/gemm_cuda.h's Activation; 3 = float64 out, computed as float32).
ACTIVATION_CODES = {None: 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "relu": 4}
OUT_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
BLOCK_SIZES = {256: 8, 128: 4}  # threads per block -> warps (csrc/gemm_kernel.cuh's TileFor)
# Dynamic shared memory per block, the largest of the layouts (k-major a and b: 4 stages of
# (128 + 128) rows of 32 + 8 elements); the binding checks the exact figure against the device.
SMEM_BYTES = 81920


def _extension() -> types.ModuleType:
    return get_cuda_compiler().load("gemm")


def why_not(a: torch.Tensor, b: torch.Tensor, compute: str = "fp32") -> Optional[str]:
    """None when the CUDA GEMM takes these operands in this compute mode, else why not (plain
    Python: it is on the per-call path). Shapes and layouts are never a reason: the launcher
    takes them all. Does not check that the extension builds: ask
    kernelforge.cuda.why_unavailable("gemm") for that."""
    dtype = COMPUTE_DTYPES.get(compute)
    if dtype is None:
        return (f"the CUDA GEMM computes in fp16 or bf16 (tensor cores, float32 accumulation), not {compute} "
                f"(the other compute modes run on the other backends)")
    for name, t in (("a", a), ("b", b)):
        if t.dtype != dtype:
            return f"the CUDA GEMM in {compute} takes {dtype} operands (it converts nothing), got {name} of {t.dtype}"
    if a.device.type != "cuda":
        return f"the CUDA extension runs on CUDA tensors, got a on {a.device}"
    if b.device != a.device:
        return f"the CUDA GEMM takes a and b on one device, got {a.device} and {b.device}"
    capability, smem_optin = device_limits(a.device)
    if capability < (8, 0):
        return (f"the CUDA GEMM needs compute capability 8.0 or newer (mma.sync, ldmatrix, cp.async), got "
                f"{capability[0]}.{capability[1]}")
    if smem_optin and SMEM_BYTES > smem_optin:
        return f"the CUDA GEMM needs {SMEM_BYTES} bytes of shared memory per block, the device allows {smem_optin}"
    return None


# ----------------------------------------------------------------------------- launcher
# The interface every backend of the gemm op implements (kernelforge/reference/gemm.py).
def gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
         activation: Optional[str], compute: str, out_dtype: torch.dtype, save_preact: bool,
         scale_a: Optional[torch.Tensor] = None, scale_b: Optional[torch.Tensor] = None,
         out_shape: Optional[tuple] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(out, preact or None): out (batch, M, N) dense in out_dtype, or in out_shape (the same
    elements in the same order), no view. a (batch, M, K) and b (batch, K, N) of compute's
    dtype with any strides (batch stride 0 for a shared operand), bias (N,) and residual
    (batch, M, N) of any float dtype and strides. The binding checks shapes and devices again
    and raises with the argument and what came. scale_a / scale_b belong to compute "fp8",
    which this kernel does not run (why_not says so)."""
    act = ACTIVATION_CODES.get(activation)
    out_code = OUT_DTYPE_CODES.get(out_dtype)
    if COMPUTE_DTYPES.get(compute) != a.dtype or act is None or out_code is None or scale_a is not None \
            or scale_b is not None:
        reason = why_not(a, b, compute) if COMPUTE_DTYPES.get(compute) != a.dtype else None
        raise ValueError(f"kernelforge.cuda.gemm: cannot run compute={compute!r} on a of {a.dtype}, "
                         f"activation={activation!r}, out_dtype={out_dtype}" + (f": {reason}" if reason else ""))
    out, preact = _extension().forward(a, b, bias, residual, act, out_code, bool(save_preact), 8)
    if out_shape is None:
        return out, preact
    reshaped = torch.ops.aten._unsafe_view.default  # no view: the binding's tensors are nobody else's
    return reshaped(out, out_shape), None if preact is None else reshaped(preact, out_shape)


# ----------------------------------------------------------------------------- raw API
def matmul(a: torch.Tensor, b: torch.Tensor, block_size: int = 256, shared_mem: bool = True) -> torch.Tensor:
    """a @ b on the CUDA tensor-core kernel, in a's dtype (the raw kernel: no autograd and no
    epilogue; kernelforge.gemm has both). a (..., M, K) and b (..., K, N) of float16 or
    bfloat16 (the same), batch dims broadcast as in torch.matmul (b of shape (K, N) is shared
    by the whole batch). block_size: threads per block, 256 (8 warps) or 128 (4 warps), both
    on a 128 x 128 tile. shared_mem=False is refused: this kernel always stages the operands
    through shared memory (ldmatrix reads fragments only from there, and a variant loading
    them straight from global memory would read each operand element from L2 once per warp
    instead of once per CTA: 4x and 2x the traffic, a teaching kernel rather than a backend).
    Raises TypeError / ValueError naming the argument, what was expected and what came."""
    name = "kernelforge.cuda.gemm"
    for arg, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(block_size, bool) or block_size not in BLOCK_SIZES:
        raise ValueError(f"{name}: block_size must be 256 or 128 (threads per block: 8 or 4 warps), got {block_size!r}")
    if not shared_mem:
        raise ValueError(f"{name}: shared_mem=False is not supported: the kernel always tiles a and b through shared "
                         f"memory (ldmatrix fragments, cp.async pipeline); pass shared_mem=True")
    for arg, t in (("a", a), ("b", b)):
        if t.dim() < 2:
            raise ValueError(f"{name}: {arg} must have at least 2 dims (..., rows, cols), got shape {tuple(t.shape)}")
        if t.dtype not in COMPUTE_DTYPES.values():
            raise ValueError(f"{name}: {arg} must be float16 or bfloat16, got {t.dtype}")
    if b.dtype != a.dtype:
        raise ValueError(f"{name}: a and b must have one dtype, got a of {a.dtype} and b of {b.dtype}")
    reason = why_not(a, b, "fp16" if a.dtype == torch.float16 else "bf16")
    if reason is not None:
        raise ValueError(f"{name}: {reason}")
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    if b.shape[-2] != K:
        raise ValueError(f"{name}: a's last dim ({K}) must equal b's second-to-last, got a of shape "
                         f"{tuple(a.shape)} and b of shape {tuple(b.shape)}")
    try:
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except RuntimeError:
        raise ValueError(f"{name}: the batch dims of a {tuple(a.shape[:-2])} and b {tuple(b.shape[:-2])} do not "
                         "broadcast") from None
    warps, out_code = BLOCK_SIZES[block_size], OUT_DTYPE_CODES[a.dtype]
    forward = _extension().forward
    if b.dim() == 2 and a.dim() > 2:  # one GEMM over all of a's rows when they fold without a copy
        try:
            rows = a.view(1, -1, K)
        except RuntimeError:
            rows = None
        if rows is not None:
            return forward(rows, b.unsqueeze(0), None, None, 0, out_code, False, warps)[0].view(*batch, M, N)
    count = math.prod(batch)
    a3 = a.expand(*batch, M, K).reshape(count, M, K)
    b3 = b.expand(*batch, K, N).reshape(count, K, N)
    return forward(a3, b3, None, None, 0, out_code, False, warps)[0].view(*batch, M, N)
