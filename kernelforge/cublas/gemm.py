"""The gemm op's "cublas" backend: torch's matmul family on CUDA tensors (cuBLAS, cuBLASLt),
with the epilogue cuBLASLt can fuse, and the rest in float32 torch ops after the product.

    out = act(a @ b + bias) + residual       (kernelforge/reference/gemm.py: the spec)

Paths, by what the call asks (a, b in the compute dtype; fp16 / bf16 products accumulate in
float32 inside cuBLAS either way):
  1. no epilogue, out in the operands' dtype: one mm / bmm (bytes: M K + K N + M N elements).
  2. a bias only, out in the operands' dtype: one addmm, the bias added by cuBLASLt's epilogue
     before the rounding.
  3. a bias with relu or gelu_tanh, out in the operands' dtype, no preact kept:
     torch._addmm_activation, cuBLASLt's RELU_BIAS / GELU_BIAS epilogues (tanh GELU, as
     kernelforge's gelu_tanh) on the float32 accumulator.
  4. anything else (a residual, silu or erf GELU, another out dtype, the preact kept for the
     backward): the product in float32 (mm with out_dtype=float32 for fp16 / bf16 operands), then
     the reference's epilogue in float32 and one rounding: the spec's numerics, at the price of
     a float32 (M, N) intermediate written and read once more (2 x 4 M N bytes) and one kernel
     per epilogue step.
cuBLAS's own tuning picks the kernel; kernelforge adds no launch of its own. Paths 1-3 round
once, like the spec; path 4 is the spec's order exactly.

What it does not take (the support predicate in kernelforge/ops/gemm.py says so): CPU tensors
(torch's CPU matmul is the reference's), fp8 (the Triton GEMM's; torch._scaled_mm scales
differently), fp64 (the reference: torch's matmul is cuBLAS's dgemm there already), operands
not in the compute dtype (the cast is a copy the reference makes), float32 compute other than
torch's current one (fp32 needs torch.backends.cuda.matmul.allow_tf32 off, tf32 needs it on).
"""
from __future__ import annotations

from typing import Optional

import torch

from kernelforge.reference.gemm import epilogue

_unsafe_view = torch.ops.aten._unsafe_view.default
COMPUTE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "tf32": torch.float32}
# cuBLASLt's fused bias epilogues that torch exposes (torch._addmm_activation: use_gelu picks GELU)
_FUSED_ACTIVATIONS = {"relu": False, "gelu_tanh": True}


def _has_float32_out() -> bool:
    # mm / bmm with out_dtype (fp16 / bf16 in, float32 out) exist in recent torch releases
    return hasattr(torch.ops.aten.mm, "dtype") and hasattr(torch.ops.aten.bmm, "dtype")


HAS_FLOAT32_OUT = _has_float32_out()


def why_not(a: torch.Tensor, b: torch.Tensor, compute: str) -> Optional[str]:
    """None where this backend multiplies a and b in `compute`, else why not."""
    if a.device.type != "cuda":
        return f"cuBLAS runs on CUDA tensors (on a {a.device.type} tensor torch's matmul is the reference's)"
    if compute == "fp8":
        return "the cuBLAS backend has no fp8 path (the Triton GEMM scales and rounds fp8 operands)"
    dtype = COMPUTE_DTYPES.get(compute)
    if dtype is None:
        return f"the cuBLAS backend computes in {', '.join(COMPUTE_DTYPES)}, not {compute}"
    if a.dtype != dtype or b.dtype != dtype:
        return (f"the cuBLAS backend multiplies operands in the compute dtype ({dtype}), got a {a.dtype} and "
                f"b {b.dtype}")
    if compute in ("fp32", "tf32") and (compute == "tf32") != torch.backends.cuda.matmul.allow_tf32:
        return (f"cuBLAS computes float32 as torch.backends.cuda.matmul.allow_tf32 says "
                f"({torch.backends.cuda.matmul.allow_tf32}), not {compute}")
    return None


def _shared_b(a: torch.Tensor, b: torch.Tensor) -> bool:
    # one matrix for the whole batch: the batch folds into the rows of one 2-D product
    return b.shape[0] == 1 or b.stride(0) == 0


def _product(a: torch.Tensor, b: torch.Tensor, float32_out: bool) -> torch.Tensor:
    """a @ b as (batch, M, N), in float32 when asked (else the operands' dtype)."""
    batch, M, K = a.shape
    wide = float32_out and a.dtype != torch.float32
    if _shared_b(a, b):
        a2 = a.reshape(batch * M, K)
        out = torch.mm(a2, b[0], out_dtype=torch.float32) if wide else torch.mm(a2, b[0])
        return _unsafe_view(out, (batch, M, out.shape[1]))  # no view: the op's outputs alias nothing
    return torch.bmm(a, b, out_dtype=torch.float32) if wide else torch.bmm(a, b)


def gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
         activation: Optional[str], compute: str, out_dtype: torch.dtype, save_preact: bool,
         scale_a: Optional[torch.Tensor] = None, scale_b: Optional[torch.Tensor] = None, fast_accum: bool = False,
         out_shape: Optional[tuple] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The launcher interface of kernelforge/reference/gemm.py's `gemm` (see there)."""
    batch, M, _ = a.shape
    N = b.shape[-1]
    same_dtype = out_dtype == a.dtype and residual is None and not save_preact
    foldable = _shared_b(a, b)
    if same_dtype and bias is None and activation is None:
        out = _product(a, b, float32_out=False)
    elif same_dtype and bias is not None and foldable and (activation is None or activation in _FUSED_ACTIVATIONS):
        a2, b2, bias = a.reshape(batch * M, a.shape[-1]), b[0], bias.to(a.dtype)
        if activation is None:
            out = torch.addmm(bias, a2, b2)
        else:
            out = torch._addmm_activation(bias, a2, b2, use_gelu=_FUSED_ACTIVATIONS[activation])
        out = _unsafe_view(out, (batch, M, N))
    else:
        if not HAS_FLOAT32_OUT and a.dtype != torch.float32:
            # older torch: the product rounds to the operands' dtype before the epilogue (twice, not once)
            acc = _product(a, b, float32_out=False).float()
        else:
            acc = _product(a, b, float32_out=True)
        preact = acc.to(out_dtype).contiguous() if save_preact else None
        out = epilogue(acc, bias, activation, residual).to(out_dtype).contiguous()
        if out_shape is None:
            return out, preact
        return _unsafe_view(out, out_shape), None if preact is None else _unsafe_view(preact, out_shape)
    # paths 1-3 keep no preact (same_dtype excludes save_preact)
    return (out, None) if out_shape is None else (_unsafe_view(out, out_shape), None)
