"""Variable-length (packed) attention in plain PyTorch: the CPU path of flash_attention_varlen.

q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) hold `batch` sequences packed
along the first dimension; sequence b is q rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] and k / v
rows cu_seqlens_k[b]:cu_seqlens_k[b + 1], and attends to its own keys only. Each sequence is
one call of kernelforge.reference.attention's chunked attention on a (1, H, L, D) view of its
rows (no copy), so the masks (causal and window aligned bottom-right per sequence: off =
Lk - Lq), the zero rows, the NaN behaviour and the accumulation dtype are that reference's.
The work is sum_b Lq_b x Lk_b, not total_q x total_k.

Host values: the loop over sequences needs their offsets on the host, so cu_seqlens is read
with one .tolist() per call (a device sync where the tensors are on a GPU; this path is the
CPU one). That is not traceable, so the backend is registered opaque
(kernelforge/ops/attention_varlen.py): under torch.compile the call stays one custom op (its
fake at trace time, this code at run time), with no graph break. Because the values are on
the host anyway, they are checked here (start at 0, non-decreasing, within the tensors, no
length above max_seqlen), which the Triton kernels, reading them on the device, cannot do.
Rows of q past cu_seqlens_q[-1] are zeros with lse -inf; keys past cu_seqlens_k[-1] get zero
gradients.
"""
from __future__ import annotations

import math

import torch

from kernelforge.reference.attention import Visibility, attention_backward, attention_forward


def _spans(cu: torch.Tensor, total: int, max_seqlen: int, name: str) -> list[tuple[int, int]]:
    """[(start, end)] of each sequence, checked (the values are on the host here)."""
    offsets = cu.tolist()
    if offsets and offsets[0] != 0:
        raise ValueError(f"flash_attention_varlen: {name}[0] must be 0, got {offsets[0]}")
    spans = list(zip(offsets[:-1], offsets[1:]))
    for b, (start, end) in enumerate(spans):
        if end < start:
            raise ValueError(f"flash_attention_varlen: {name} must be non-decreasing, got {name}[{b}] = {start} "
                             f"> {name}[{b + 1}] = {end}")
        if end - start > max_seqlen:
            raise ValueError(f"flash_attention_varlen: sequence {b} has {end - start} rows in {name} but the "
                             f"matching max_seqlen is {max_seqlen}")
    if offsets and offsets[-1] > total:
        raise ValueError(f"flash_attention_varlen: {name}[-1] = {offsets[-1]} exceeds the {total} packed rows")
    return spans


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """(L, H, X) rows -> a (1, H, L, X) view, the layout the reference attention takes."""
    return t.transpose(0, 1).unsqueeze(0)


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                   vis: Visibility) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (total_q, H, Dv) in q's dtype, lse (total_q, H) float32 (float64 for float64))."""
    total_q, H, _ = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_zeros(total_q, H, v.shape[-1])
    lse = torch.full((total_q, H), -math.inf, dtype=acc, device=q.device)
    q_spans = _spans(cu_seqlens_q, total_q, max_seqlen_q, "cu_seqlens_q")
    k_spans = _spans(cu_seqlens_k, k.shape[0], max_seqlen_k, "cu_seqlens_k")
    for (q0, q1), (k0, k1) in zip(q_spans, k_spans):
        if q1 == q0:
            continue
        o, s = attention_forward(_heads_first(q[q0:q1]), _heads_first(k[k0:k1]), _heads_first(v[k0:k1]), scale, vis)
        out[q0:q1] = o[0].transpose(0, 1)
        lse[q0:q1] = s[0].transpose(0, 1)
    return out, lse


def varlen_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                    max_seqlen_k: int, scale: float,
                    vis: Visibility) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), dense, in the inputs' dtypes; zero outside every sequence."""
    dq, dk, dv = q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    q_spans = _spans(cu_seqlens_q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
    k_spans = _spans(cu_seqlens_k, k.shape[0], max_seqlen_k, "cu_seqlens_k")
    for (q0, q1), (k0, k1) in zip(q_spans, k_spans):
        if q1 == q0 or k1 == k0:  # no pair: the gradients stay zero
            continue
        g = attention_backward(_heads_first(grad_out[q0:q1]), _heads_first(q[q0:q1]), _heads_first(k[k0:k1]),
                               _heads_first(v[k0:k1]), _heads_first(out[q0:q1]), lse[q0:q1].t().unsqueeze(0),
                               scale, vis)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = (t[0].transpose(0, 1) for t in g)
    return dq, dk, dv
