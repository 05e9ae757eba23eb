"""Attention written the obvious way, materializing the scores: the float64 oracle of the
attention tests and, in a low-precision dtype, PyTorch's own same-dtype error level
(tests/numerics.py). Independent of kernelforge's chunked reference on purpose."""
from __future__ import annotations

import math
from typing import Optional

import torch


def visible(Sq: int, Sk: int, causal: bool = False, window=None, device="cpu") -> torch.Tensor:
    """(Sq, Sk) bool: which keys each query sees under causal / window (bottom-right aligned)."""
    i = torch.arange(Sq, device=device).view(-1, 1) + (Sk - Sq)
    j = torch.arange(Sk, device=device).view(1, -1)
    seen = torch.ones(Sq, Sk, dtype=torch.bool, device=device)
    if causal:
        seen &= j <= i
    if window is not None:
        left, right = window
        if left is not None and left >= 0:
            seen &= j >= i - left
        if right is not None and right >= 0:
            seen &= j <= i + right
    return seen


def naive_attention(q, k, v, scale: Optional[float] = None, causal: bool = False, window=None,
                    attn_mask: Optional[torch.Tensor] = None, block_mask=None):
    """(out, lse) in q's dtype (lse in q's dtype too); differentiable; rows that see no key
    give zeros and lse -inf."""
    p, lse, v = probabilities(q, k, v, scale, causal, window, attn_mask, block_mask)
    return p @ v, lse


def kv_cache_attention(q, k, v, cache_seqlens, attn_mask=None, **options):
    """naive_attention of each batch entry over its filled cache, k[b, :, :L] and v[b, :, :L] with
    L = cache_seqlens[b] clamped to [0, Sk] (flash_attn_with_kvcache's convention, by its
    definition: causal and window align to L, the rest of the cache is never looked at). A
    broadcastable attn_mask is cut the same way. (out, lse) as naive_attention's."""
    outs, lses = [], []
    Sk = k.shape[2]
    for b, length in enumerate(cache_seqlens.tolist()):
        length = min(max(length, 0), Sk)
        mask = None
        if attn_mask is not None:
            mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
            mask = mask[b:b + 1] if mask.shape[0] > 1 else mask
            mask = mask[..., :length] if mask.shape[-1] > 1 else mask
        out, lse = naive_attention(q[b:b + 1], k[b:b + 1, :, :length], v[b:b + 1, :, :length], attn_mask=mask,
                                   **options)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def probabilities(q, k, v, scale=None, causal=False, window=None, attn_mask=None, block_mask=None):
    """(P (B, H, Sq, Sk), lse, v repeated to H heads)."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    k = k.repeat_interleave(H // Hkv, 1)
    v = v.repeat_interleave(H // Hkv, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    seen = visible(Sq, Sk, causal, window, q.device).expand(B, H, Sq, Sk)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            seen = seen & attn_mask
        else:  # -inf entries hide keys; through masked_fill so an all-hidden row has zero gradient
            hidden = attn_mask == -math.inf
            seen = seen & ~hidden
            s = s + attn_mask.masked_fill(hidden, 0).to(s.dtype)
    if block_mask is not None:
        seen = seen & block_mask.to_dense().to(q.device)
    s = s.masked_fill(~seen, -math.inf)
    lse = torch.logsumexp(s.float() if s.dtype in (torch.float16, torch.bfloat16) else s, -1).to(s.dtype)
    p = torch.softmax(s, -1)
    p = torch.where(torch.isfinite(lse).unsqueeze(-1), p, torch.zeros_like(p))  # all-masked rows: 0, not NaN
    return p, lse, v


def gradient_term_scales(q, k, v, grad_out, **options) -> tuple[float, float, float]:
    """The largest sum of absolute terms that cancels into each of dQ, dK, dV (float64).

    dQ = scale * (P o (dP - delta)) K and dK = scale * (P o (dP - delta))^T Q: dP and delta
    (each ~ |dO| |V|) nearly cancel, so rounding errors scale with the terms, not with the
    small difference; dV = P^T dO sums positive weights of signed terms. These are the
    `terms_scale` of tests/numerics.assert_matches_oracle for the gradients."""
    q, k, v, g = (t.detach().double() for t in (q, k, v, grad_out))
    B, H, Sq, D = q.shape
    group = H // k.shape[1]
    scale = options.get("scale") or D ** -0.5
    mask = options.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        options = {**options, "attn_mask": mask.double()}
    p, _, v_h = probabilities(q, k, v, **options)
    k_h = k.repeat_interleave(group, 1)
    dp = g @ v_h.transpose(-1, -2)
    delta = (g * (p @ v_h)).sum(-1, keepdim=True)
    terms = p * (dp.abs() + delta.abs())
    dq = scale * terms @ k_h.abs()
    dk = scale * terms.transpose(-1, -2) @ q.abs()
    dv = p.transpose(-1, -2) @ g.abs()
    return dq.max().item(), dk.max().item(), dv.max().item()
