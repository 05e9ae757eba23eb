"""Rotary position embedding in plain PyTorch: the definition every backend must match.

transformers' convention (rotate-half): the first `rot` = cos.shape[-1] dims of each head are
rotated, as two halves x1 = x[:rot/2], x2 = x[rot/2:rot], by the angles whose cos and sin the
caller gives per token (each half its own, as cos / sin hold them: transformers repeats the
frequencies, so both halves agree); dims from rot on pass through (partial rotary):

    out1 = x1 c1 - x2 s1          out = x cos + rotate_half(x) sin on the first rot dims,
    out2 = x2 c2 + x1 s2          rotate_half(x) = [-x2, x1]

The gradient is the transposed rotation, the same form with (s1, s2) -> (-s2, -s1):

    dx1 = g1 c1 + g2 s2,   dx2 = g2 c2 - g1 s1

Launcher interface (every backend): rope_tokens(q, k, cos, sin, positions, transpose) with q and
k as (B, S, H, D) views (any strides; the heads of k may differ in number: GQA), cos / sin as
(Bc, S, rot) with Bc in (1, B), or, with positions (B, S) int, as tables (P, rot) that positions
index; returns new (q_out, k_out) in the inputs' shapes, dtype and memory order. A position
outside [0, P) gives NaN for that token (no host read checks it). Computes in float32 (float64
for float64 q) and rounds once.
"""
from __future__ import annotations

from typing import Optional

import torch

from kernelforge.reference._accumulation import accumulation_dtype


def token_angles(cos: torch.Tensor, sin: torch.Tensor, positions: Optional[torch.Tensor], batch: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) as (B or 1, S, rot) in `dtype`: the tables gathered at positions, NaN where a
    position is out of range."""
    if positions is None:
        return cos.to(dtype), sin.to(dtype)
    table = cos.shape[0]
    inside = (positions >= 0) & (positions < table)
    index = torch.where(inside, positions, torch.zeros_like(positions)).long()
    nan = torch.tensor(float("nan"), dtype=dtype, device=cos.device)
    c = torch.where(inside[..., None], cos.to(dtype)[index], nan)
    s = torch.where(inside[..., None], sin.to(dtype)[index], nan)
    return c.expand(batch, *c.shape[1:]), s.expand(batch, *s.shape[1:])


def rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, transpose: bool) -> torch.Tensor:
    """x (B, S, H, D) rotated by c, s (B or 1, S, rot) on its first rot dims, in c's dtype."""
    rot = c.shape[-1]
    half = rot // 2
    x = x.to(c.dtype)
    x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    c1, c2 = c[:, :, None, :half], c[:, :, None, half:]
    s1, s2 = s[:, :, None, :half], s[:, :, None, half:]
    if transpose:
        s1, s2 = -s2, -s1
    return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, rest), dim=-1)


def rope_tokens(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: Optional[torch.Tensor], transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    acc = accumulation_dtype(q.dtype)
    c, s = token_angles(cos, sin, positions, q.shape[0], acc)
    outs = []
    for x in (q, k):
        out = torch.empty_like(x)  # the input's memory order where it is dense
        out.copy_(rotate(x, c, s, transpose))
        outs.append(out)
    return outs[0], outs[1]


def angle_gradients(grad_q: torch.Tensor, grad_k: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    c: torch.Tensor, positions: Optional[torch.Tensor], cos_shape: torch.Size, transpose: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of cos and sin (in cos_shape, float32 / float64) given the outputs' gradients
    and the inputs, all (B, S, H, D); c the (B or 1, S, rot) angles as the forward read them.
    d out1 / d c1 = x1, d out2 / d c2 = x2, d out1 / d s1 = -x2, d out2 / d s2 = x1 (transposed:
    d out2 / d s1 = -x1, d out1 / d s2 = x2): summed over heads, over the batch where cos
    broadcast it, and into the table rows at positions."""
    rot = c.shape[-1]
    half = rot // 2
    dcos = dsin = 0
    for g, x in ((grad_q, q), (grad_k, k)):
        g, x = g[..., :rot].to(c.dtype), x[..., :rot].to(c.dtype)
        (g1, g2), (x1, x2) = (g[..., :half], g[..., half:]), (x[..., :half], x[..., half:])
        dcos = dcos + (g * x).sum(dim=2)
        if transpose:
            dsin = dsin + torch.cat((-g2 * x1, g1 * x2), dim=-1).sum(dim=2)
        else:
            dsin = dsin + torch.cat((-g1 * x2, g2 * x1), dim=-1).sum(dim=2)
    if positions is None:
        return dcos.sum_to_size(cos_shape), dsin.sum_to_size(cos_shape)
    index = positions.long().expand(dcos.shape[:2]).reshape(-1)
    table_cos = dcos.new_zeros(cos_shape).index_add_(0, index, dcos.reshape(-1, rot))
    table_sin = dsin.new_zeros(cos_shape).index_add_(0, index, dsin.reshape(-1, rot))
    return table_cos, table_sin


__all__ = ["angle_gradients", "rope_tokens", "rotate", "token_angles"]
