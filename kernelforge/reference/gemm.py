"""GEMM with a fused epilogue in plain PyTorch: the spec, the CPU path and the test oracle.

    out = act(a @ b + bias) + residual

a (batch, M, K) and b (batch, K, N) as the op layer hands them over (kernelforge/ops/gemm.py
broadcasts and flattens the batch dims; a batch stride may be 0), bias (N,), residual
(batch, M, N) (any strides, 0 where broadcast).

What each compute mode means, on every backend:
- "fp32": operands as float32, products and sums in float32 (IEEE, no tf32);
- "tf32": operands rounded to tf32 (10 mantissa bits, nearest) as the tensor cores read
  them, products and sums in float32;
- "fp16" / "bf16": operands rounded to that dtype, products (exact in float32) summed in
  float32;
- "fp64": float64 throughout (CPU inputs of float64 only);
- "fp8": operands in float8 e4m3 (the op layer quantizes them: `quantize_fp8`) with float32
  scales, a's per row or per tensor and b's per column or per tensor; products of e4m3
  values summed in float32, then multiplied by scale_a[m] * scale_b[n] before the epilogue.
The epilogue runs in float32 (float64 for "fp64") on the unrounded accumulator: bias,
activation, residual, then one rounding to out_dtype. (Eager linear + gelu rounds the
linear's output to the storage dtype before the activation; this does not.)

preact, when asked for, is a @ b before the bias, rounded to out_dtype: what the backward
needs for act'(a @ b + bias) (kernelforge::bias_activation_backward takes x and the bias
apart and adds them in float32).
"""
from __future__ import annotations

from typing import Optional

import torch

from kernelforge.reference.activations import activation_value

_unsafe_view = torch.ops.aten._unsafe_view.default

COMPUTE_MODES = ("fp32", "tf32", "fp16", "bf16", "fp64", "fp8")
_OPERAND_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                   "fp64": torch.float64, "fp8": torch.float8_e4m3fn}
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
FP8_SCALINGS = ("row", "tensor")


def fp8_scale(x: torch.Tensor, scaling: str, reduce_dim: int) -> torch.Tensor:
    """float32 scales that map x's largest magnitude onto e4m3's largest value: per tensor
    (shape (1,) * x.dim()), or "row" reducing only `reduce_dim` (the K dim: one scale per row
    of a, per column of b). An all-zero or empty slice gets scale 1."""
    if x.numel() == 0:
        shape = [1] * x.dim() if scaling == "tensor" else [1 if d == reduce_dim % x.dim() else n
                                                           for d, n in enumerate(x.shape)]
        return torch.ones(shape, device=x.device)
    mag = x.detach().abs().float()
    amax = mag.amax() if scaling == "tensor" else mag.amax(dim=reduce_dim, keepdim=True)
    amax = amax.reshape((1,) * x.dim()) if scaling == "tensor" else amax
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to the nearest e4m3 value, saturating at +-448 (an e4m3 x passes)."""
    if x.dtype == FP8:
        return x
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def round_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest value with a 10-bit mantissa (ties away from zero, as
    cvt.rna.tf32.f32), kept in float32. Inf and NaN pass through."""
    bits = t.contiguous().view(torch.int32)
    rounded = (bits + 0x1000) & ~0x1FFF  # add half of the 13 dropped bits, then drop them
    finite = torch.isfinite(t)
    return torch.where(finite, rounded.view(torch.float32), t)


def operands(a: torch.Tensor, b: torch.Tensor, compute: str) -> tuple[torch.Tensor, torch.Tensor]:
    """a and b as the multiply sees them, in the accumulation dtype (exact for fp16 / bf16 /
    tf32 values: their products fit float32's mantissa)."""
    dtype = _OPERAND_DTYPES[compute]
    acc = torch.float64 if compute == "fp64" else torch.float32
    a, b = a.to(dtype), b.to(dtype)
    if compute == "tf32":
        a, b = round_to_tf32(a), round_to_tf32(b)
    return a.to(acc), b.to(acc)


def epilogue(acc: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str],
             residual: Optional[torch.Tensor]) -> torch.Tensor:
    """act(acc + bias) + residual in acc's dtype."""
    z = acc if bias is None else acc + bias.to(acc.dtype)
    y = z if activation is None else activation_value(z, activation)
    return y if residual is None else y + residual.to(acc.dtype)


# ----------------------------------------------------------------------------- launcher
# The interface every backend of the gemm op implements.
def gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
         activation: Optional[str], compute: str, out_dtype: torch.dtype, save_preact: bool,
         scale_a: Optional[torch.Tensor] = None, scale_b: Optional[torch.Tensor] = None, fast_accum: bool = False,
         out_shape: Optional[tuple] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(out, preact or None): out (batch, M, N) dense in out_dtype, or dense in out_shape (the
    same elements in the same order: the op's (*batch, M, N)), a tensor that is no view. For
    compute "fp8" only: a and b are e4m3, scale_a (batch, M) and scale_b (batch, N) float32
    (strides may be 0); fast_accum allows a less precise accumulation (here: none is less
    precise than float32)."""
    x, w = operands(a, b, compute)
    acc = torch.matmul(x, w)
    if compute == "fp8":
        acc = acc * scale_a[:, :, None] * scale_b[:, None, :]
    out = epilogue(acc, bias, activation, residual).to(out_dtype).contiguous()
    preact = acc.to(out_dtype).contiguous() if save_preact else None
    if out_shape is None:
        return out, preact
    # _unsafe_view: the result is no view (autograd lets in-place ops on it through), and nobody else's
    return _unsafe_view(out, out_shape), None if preact is None else _unsafe_view(preact, out_shape)
