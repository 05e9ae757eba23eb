"""Flash attention forward through the CUDA extension "attention" (csrc/attention_forward.cu,
csrc/attention_kernel.cuh, csrc/attention_binding.cpp): a FlashAttention-2 style kernel on
mma.sync tensor cores, float16 / bfloat16, head dims 32, 64, 96, 128 and 256.

`attention_forward` is the launcher the ops layer calls (after asking `why_not`);
`flash_attention` is the raw API (CUDA tensors in, no autograd). Both run on the current CUDA stream of
q's device. Visibility (FlashAttention-2's convention): with off = Sk - Sq, key j is visible
to query i iff (not causal or j <= i + off) and (window_left < 0 or j >= i + off -
window_left) and (window_right < 0 or j <= i + off + window_right); a row with no visible
key gets out = 0 and lse = -inf.
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from kernelforge.cuda.compiler import device_limits, get_cuda_compiler

HEAD_DIMS = (32, 64, 96, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)
MAX_SEQ_LEN = 1 << 29  # kernelforge::cuda_attention::kMaxSeqLen
MAX_GRID_DIM = 65535   # batch and heads are grid dimensions
# Dynamic shared memory per block by head dim (attention_kernel.cuh's TileFor: (BM + 2 BN)
# rows of head_dim + 8 two-byte elements); the binding checks the same against the device.
SMEM_BYTES = {32: 30720, 64: 36864, 96: 53248, 128: 69632, 256: 135168}


def _extension() -> ModuleType:
    return get_cuda_compiler().load("attention")


def why_not(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """None when the CUDA flash attention takes these inputs, else why not (plain Python: it
    is on the per-call path). Does not check that the extension builds: ask
    kernelforge.cuda.why_unavailable("attention") for that."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            return (f"the CUDA flash attention takes 4-D (batch, heads, seq, head_dim) tensors, "
                    f"got {name} of shape {tuple(t.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in DTYPES:
            return f"the CUDA flash attention takes float16 or bfloat16, got {name} of {t.dtype}"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"the CUDA flash attention takes q, k and v of one dtype, got {q.dtype}, {k.dtype} and {v.dtype}"
    d = q.shape[3]
    if d not in HEAD_DIMS:
        return f"the CUDA flash attention takes head dims {', '.join(map(str, HEAD_DIMS))}, got {d}"
    if k.shape[0] != q.shape[0] or k.shape[3] != d or v.shape != k.shape:
        return (f"the CUDA flash attention takes k and v of shape (batch, kv_heads, kv_len, head_dim) with q's "
                f"batch and head_dim, got q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads == 0 or heads % kv_heads:
        return f"the CUDA flash attention needs q heads ({heads}) to be a multiple of kv heads ({kv_heads})"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(3) != 1:
            return f"the CUDA flash attention needs unit stride in the last dim, got {name} with strides {t.stride()}"
    if q.shape[2] > MAX_SEQ_LEN or k.shape[2] > MAX_SEQ_LEN:
        return f"the CUDA flash attention takes sequences of at most {MAX_SEQ_LEN}, got {q.shape[2]} and {k.shape[2]}"
    if q.shape[0] > MAX_GRID_DIM or heads > MAX_GRID_DIM:
        return f"the CUDA flash attention takes batch and heads of at most {MAX_GRID_DIM}, got q {tuple(q.shape)}"
    if q.device.type != "cuda":
        return f"the CUDA extension runs on CUDA tensors, got q on {q.device}"
    if k.device != q.device or v.device != q.device:
        return f"the CUDA flash attention takes q, k and v on one device, got {q.device}, {k.device} and {v.device}"
    capability, smem_optin = device_limits(q.device)
    if capability < (8, 0):
        return (f"the CUDA flash attention needs compute capability 8.0 or newer (mma.sync), got "
                f"{capability[0]}.{capability[1]}")
    if smem_optin and SMEM_BYTES[d] > smem_optin:
        return (f"the CUDA flash attention at head dim {d} needs {SMEM_BYTES[d]} bytes of shared memory per block, "
                f"the device allows {smem_optin}")
    return None


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                      window_left: int, window_right: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Sq, D) contiguous in q's dtype, lse (B, H, Sq) float32, natural log).

    q (B, H, Sq, D); k, v (B, Hkv, Sk, D) with H % Hkv == 0 (q head h reads kv head
    h // (H // Hkv)); any batch / head / seq strides, unit stride in the last dim. The
    binding checks again and raises with the op, the argument and what came."""
    return _extension().forward(q, k, v, float(scale), bool(causal), int(window_left), int(window_right))


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float = 0.125,
                    causal: bool = False) -> torch.Tensor:
    """softmax(scale * q k^T) v on the CUDA kernel (the raw kernel: no autograd; use the
    kernelforge ops for that). Raises ValueError for inputs the kernel does not take."""
    reason = why_not(q, k, v)
    if reason is not None:
        raise ValueError(f"kernelforge.cuda.flash_attention: {reason}")
    return attention_forward(q, k, v, scale, causal, -1, -1)[0]


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, vis) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention backend interface (kernelforge/ops/attention.py): `vis` is a
    kernelforge.reference.attention.Visibility whose band (causal folded into its right
    reach) maps onto the kernel's window; the ops layer sends no attn_mask / block_mask here."""
    left = -1 if vis.left is None else vis.left
    right = -1 if vis.right is None else vis.right
    return attention_forward(q, k, v, scale, False, left, right)
