"""Attention in plain PyTorch, chunked over keys: the spec, the CPU path and the oracle's twin.

    out[b, h, i] = sum_j softmax_j(scale * q[b,h,i] . k[b,g(h),j] + bias[b,h,i,j]) v[b,g(h),j]

over the keys j visible to query i, where g(h) = h // (H // Hkv) (grouped-query attention)
and visibility is the AND of:
  causal        j <= i + (Sk - Sq)              (aligned to the bottom right, as FlashAttention-2)
  window (l, r) i + off - l <= j <= i + off + r  (off = Sk - Sq; None or -1 = unbounded side)
  attn_mask     bool: True = visible; float: added to the scores (-inf hides the key)
  block_mask    a kernelforge.BlockMask
  seqlens       a KV cache's filled lengths L (B,): batch b sees keys j < L[b] only, and causal /
                window align to L[b] instead of Sk (off = L[b] - Sq); read on the device,
                clamped to [0, Sk]
  block_table   a paged cache (with seqlens): k, v are page pools (num_blocks, Hkv, page_size, D)
                and batch b's key j is slot j % page_size of page block_table[b, j // page_size];
                the reference gathers the pages into a contiguous (B, Hkv, capacity, D) cache
                first (`unpage`: a copy of every page the table names, capacity = its columns *
                page_size) and takes the seqlens path
A row with no visible key gives zeros (not NaN) and log-sum-exp -inf; its gradient is zero.
NaN and infinities follow torch's softmax: a NaN among a row's visible scores (a NaN in q, in a
visible key's k, or in a float mask) or an infinite score (inf - inf) gives that row NaN out and
lse, and NaN gradients; a NaN in v reaches every row that sees its key. A hidden key's score is
replaced by -inf, so a NaN in its k reaches no row's output; a NaN in its v (or its k, in dq) meets
a zero weight inside a chunk's matrix product and makes the chunk's rows NaN, as in torch's math
SDPA (docs/special_values.md).

Memory: the keys are walked in chunks with an online softmax (running max and rescaled
sum), so the scores held at any time are Sq x chunk per (batch, head), never Sq x Sk: a
16k-token attention on the CPU does not allocate a 16k x 16k matrix. Accumulates in float32
(float64 for float64 inputs) and rounds once on output.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from kernelforge.reference._accumulation import accumulation_dtype as _acc_dtype

DEFAULT_CHUNK = 256  # keys per step: large enough for BLAS efficiency, small enough for cache


@dataclass(frozen=True)
class Visibility:
    """Which keys each query sees, in the form every backend takes: a band of key offsets
    relative to the query's aligned position i + off (left and right reach, None = unbounded),
    plus the optional masks and a KV cache's per-batch filled lengths (`seqlens`, (B,) int32 or
    int64 on the inputs' device: off = seqlens[b] - Sq and keys from seqlens[b] on are hidden),
    and a paged cache's page table (`block_table`, (B, max_blocks) int32 or int64: k and v are
    then page pools (num_blocks, Hkv, page_size, D); never without seqlens)."""

    left: Optional[int]
    right: Optional[int]
    attn_mask: Optional[torch.Tensor] = None
    block_mask: Optional[object] = None
    seqlens: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None

    @staticmethod
    def of(causal: bool, window, attn_mask=None, block_mask=None, seqlens=None, block_table=None) -> "Visibility":
        left = right = None
        if window is not None:
            left, right = (None if w is None or w < 0 else int(w) for w in window)
        if causal:
            right = 0 if right is None else min(right, 0)
        return Visibility(left, right, attn_mask, block_mask, seqlens, block_table)

    @property
    def has_band(self) -> bool:
        return self.left is not None or self.right is not None


def gather_pages(pool: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """A page pool (num_blocks, Hkv, page_size, X), any strides, as the contiguous cache
    (B, Hkv, max_blocks * page_size, X) its block table (B, max_blocks) names: a copy, made with
    torch index ops on the device (no host sync). Entries are clamped into [0, num_blocks): a
    table's unused entries (pages past a sequence's length, often padded with -1 or garbage) may
    hold anything, and the keys they bring in lie past the filled length, hidden. An entry of a
    filled page out of range is the caller's error (its keys come from a clamped page)."""
    num_blocks, kv_heads, page, x = pool.shape
    B, max_blocks = block_table.shape
    index = block_table.clamp(0, max(num_blocks - 1, 0)).long()
    pages = pool[index]  # (B, max_blocks, Hkv, page_size, X)
    return pages.permute(0, 2, 1, 3, 4).reshape(B, kv_heads, max_blocks * page, x)


def unpage(k: torch.Tensor, v: torch.Tensor, vis: Visibility):
    """(k, v, vis) of a paged call as the contiguous cache of the same lengths (gather_pages:
    a copy); a call without a block table as it is."""
    if vis.block_table is None:
        return k, v, vis
    table = vis.block_table
    return gather_pages(k, table), gather_pages(v, table), dataclasses.replace(vis, block_table=None)


def _grouped(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, S, X) -> (B, Hkv, H // Hkv, S, X): the q heads that share one kv head, together."""
    B, H, S, X = t.shape
    return t.reshape(B, kv_heads, H // kv_heads, S, X)


def _chunk_masks(vis: Visibility, B: int, H: int, kv_heads: int, Sq: int, Sk: int, k0: int, k1: int,
                 device, acc) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(hidden, additive) for keys [k0, k1), each None when it has nothing to say, shaped to
    broadcast against grouped scores (B, Hkv, G, Sq, k1 - k0): hidden (bool) is True where causal,
    the window, a bool attn_mask, a block mask or a KV cache's length hide the key; additive is a
    float attn_mask. Hidden scores are replaced by -inf, not offset by it: a NaN or inf score of a
    hidden key (a NaN in its k) must not reach the row (NaN + -inf is NaN), as in torch's SDPA. A
    float mask adds, as in torch: its -inf hides, its NaN poisons the row."""
    hidden = additive = None
    if vis.seqlens is not None:  # per batch: the filled length and the band aligned to it, (B, 1, Sq, C)
        length = vis.seqlens.clamp(0, Sk).view(B, 1, 1, 1)
        i = torch.arange(Sq, device=device).view(1, 1, -1, 1) + (length - Sq)
        j = torch.arange(k0, k1, device=device).view(1, 1, 1, -1)
        seen = j < length
        if vis.left is not None:
            seen = seen & (j >= i - vis.left)
        if vis.right is not None:
            seen = seen & (j <= i + vis.right)
        hidden = ~seen
    elif vis.has_band:
        i = torch.arange(Sq, device=device).view(-1, 1) + (Sk - Sq)
        j = torch.arange(k0, k1, device=device).view(1, -1)
        seen = torch.ones(Sq, k1 - k0, dtype=torch.bool, device=device)
        if vis.left is not None:
            seen &= j >= i - vis.left
        if vis.right is not None:
            seen &= j <= i + vis.right
        hidden = ~seen
    for mask in (vis.attn_mask, None if vis.block_mask is None else vis.block_mask.element_mask(0, Sq, k0, k1)):
        if mask is None:
            continue
        m = mask[..., k0:k1] if mask is vis.attn_mask else mask
        if m.dtype == torch.bool:
            hidden = ~m if hidden is None else hidden | ~m
        else:
            additive = m.to(acc)
    return tuple(None if t is None else _grouped_mask(t, B, H, kv_heads, Sq, k1 - k0) for t in (hidden, additive))


def _grouped_mask(mask: torch.Tensor, B: int, H: int, kv_heads: int, Sq: int, C: int) -> torch.Tensor:
    """A mask broadcastable to (B, H, Sq, C) viewed against grouped scores (B, Hkv, G, Sq, C)."""
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.shape[1] == 1:
        return mask.expand(B, 1, Sq, C).unsqueeze(2)  # (B, 1, 1, Sq, C): broadcasts over kv heads and groups
    return mask.expand(B, H, Sq, C).reshape(B, kv_heads, H // kv_heads, Sq, C)


def _masked_scores(s: torch.Tensor, hidden: Optional[torch.Tensor], additive: Optional[torch.Tensor]) -> torch.Tensor:
    if additive is not None:
        s = s.add_(additive)
    if hidden is not None:
        s = s.masked_fill_(hidden, -math.inf)
    return s


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, vis: Visibility,
                      chunk_size: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype (B, H, Sq, D), lse float32 (float64 for float64) (B, H, Sq)).
    A paged cache (vis.block_table) is gathered into a contiguous one first (unpage: a copy)."""
    k, v, vis = unpage(k, v, vis)
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    acc = _acc_dtype(q.dtype)
    qg = _grouped(q.to(acc), Hkv)  # (B, Hkv, G, Sq, D)
    kf, vf = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)  # (B, Hkv, 1, Sk, D)
    if vis.seqlens is not None:
        # past a filled length the cache may hold anything (an unfilled buffer's NaN): never let it
        # into a product, as the kernels never load it
        filled = (torch.arange(Sk, device=q.device) < vis.seqlens.clamp(0, Sk).view(B, 1)).view(B, 1, 1, Sk, 1)
        kf, vf = torch.where(filled, kf, 0.0), torch.where(filled, vf, 0.0)
    row_max = torch.full(qg.shape[:-1], -math.inf, dtype=acc, device=q.device)
    row_sum = torch.zeros_like(row_max)
    out = torch.zeros(qg.shape[:-1] + (v.shape[-1],), dtype=acc, device=q.device)
    for k0 in range(0, Sk, chunk_size):
        k1 = min(Sk, k0 + chunk_size)
        s = torch.matmul(qg, kf[..., k0:k1, :].transpose(-1, -2)).mul_(scale)
        s = _masked_scores(s, *_chunk_masks(vis, B, H, Hkv, Sq, Sk, k0, k1, q.device, acc))
        new_max = torch.maximum(row_max, s.amax(-1))
        safe_max = torch.where(new_max == -math.inf, 0.0, new_max)  # a row hidden so far stays 0
        p = torch.exp(s.sub_(safe_max.unsqueeze(-1)))
        rescale = torch.exp(row_max - safe_max)
        row_sum = row_sum.mul_(rescale).add_(p.sum(-1))
        out = out.mul_(rescale.unsqueeze(-1)).add_(torch.matmul(p, vf[..., k0:k1, :]))
        row_max = new_max
    # row_sum is 0 exactly where a row saw no key; NaN (a NaN score, or inf - inf) is not 0 and
    # reaches out and lse, as in torch's softmax
    seen = row_sum != 0
    out = torch.where(seen.unsqueeze(-1), out / torch.where(seen, row_sum, 1.0).unsqueeze(-1), 0.0)
    lse = torch.where(seen, row_max + torch.log(torch.where(seen, row_sum, 1.0)), -math.inf)
    return out.reshape(B, H, Sq, -1).to(q.dtype), lse.reshape(B, H, Sq)


def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, scale: float, vis: Visibility,
                       chunk_size: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the forward's output and log-sum-exp, chunked over keys:
    P = exp(scale q k^T + bias - lse), dV = P^T dO, dS = P (dO V^T - rowsum(dO * O)),
    dQ = scale dS K, dK = scale dS^T Q (summed over the q heads of a group)."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    acc = _acc_dtype(q.dtype)
    qg, dog = _grouped(q.to(acc), Hkv), _grouped(grad_out.to(acc), Hkv)
    kf, vf = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)
    delta = (dog * _grouped(out.to(acc), Hkv)).sum(-1, keepdim=True)  # (B, Hkv, G, Sq, 1)
    # rows with no visible key: lse = -inf; +inf makes their P exactly 0
    lse_g = _grouped(lse.to(acc).unsqueeze(-1), Hkv)
    lse_g = torch.where(lse_g == -math.inf, math.inf, lse_g)
    dq = torch.zeros_like(qg)
    dk = torch.empty(k.shape, dtype=acc, device=k.device)
    dv = torch.empty(v.shape, dtype=acc, device=v.device)
    for k0 in range(0, Sk, chunk_size):
        k1 = min(Sk, k0 + chunk_size)
        kc, vc = kf[..., k0:k1, :], vf[..., k0:k1, :]
        s = torch.matmul(qg, kc.transpose(-1, -2)).mul_(scale)
        s = _masked_scores(s, *_chunk_masks(vis, B, H, Hkv, Sq, Sk, k0, k1, q.device, acc))
        p = torch.exp(s.sub_(lse_g))  # (B, Hkv, G, Sq, C)
        dv[:, :, k0:k1] = torch.matmul(p.transpose(-1, -2), dog).sum(2)
        ds = p.mul_(torch.matmul(dog, vc.transpose(-1, -2)).sub_(delta))
        dq += torch.matmul(ds, kc)
        dk[:, :, k0:k1] = torch.matmul(ds.transpose(-1, -2), qg).sum(2)
    # dense outputs whatever the inputs' layout (the op's contract)
    return ((dq * scale).reshape(q.shape).to(q.dtype).contiguous(), (dk * scale).to(k.dtype), dv.to(v.dtype))


# ----------------------------------------------------------------------------- CPU entry points
def cpu_fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                        causal: bool = False) -> torch.Tensor:
    """Attention on (batch, heads, seq, head_dim) tensors in one pass over the keys with an
    online softmax (no Sq x Sk score matrix). No autograd of its own: for gradients, masks
    and every option use kernelforge.flash_attention, which runs this path on the CPU."""
    return optimized_cpu_attention(q, k, v, chunk_size=DEFAULT_CHUNK, scale=scale, causal=causal)


def optimized_cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int = 64, *,
                            scale: Optional[float] = None, causal: bool = False) -> torch.Tensor:
    """cpu_fused_attention with the key chunk chosen: memory O(Sq * chunk_size) per head."""
    if chunk_size < 1:
        raise ValueError(f"optimized_cpu_attention: chunk_size must be >= 1, got {chunk_size}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return attention_forward(q, k, v, scale, Visibility.of(causal, None), chunk_size)[0]


# Launchers: the interface every backend of the attention op implements (kernelforge/ops/attention.py).
flash_forward = attention_forward
flash_backward = attention_backward
