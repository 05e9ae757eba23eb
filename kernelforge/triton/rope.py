"""Triton rotary embedding: q and k of one token rotated by one program, forward or transposed
(the gradient), as kernelforge/reference/rope.py defines it (its launcher interface too).

One program a (batch, position) token: it reads the token's cos and sin once (from the given
(B or 1, S, rot) angles, or from the (P, rot) tables at the token's position), then walks q's
heads and k's (GQA: their own count) in blocks of heads, rotating the first rot dims and copying
the rest. Bytes: q and k read and written once, (H + Hkv) * D elements a token each way, plus the
token's 2 * rot angles (from L2 after the first head); FLOPs about 3 an element: memory bound.
q and k are read through their strides (transformers' (B, H, S, D) views of (B, S, H, D)
projections need no copy) and the outputs keep the inputs' memory order.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernelforge.triton._launch import launch, next_power_of_2, on_device

MAX_TILE = 4096  # heads x half-dims a block: 32 float32 values a thread at 4 warps


@triton.jit
def _rotate_heads(X, O, sxh, sxd, soh, sod, H, c1, c2, s1, s2, offs_half, offs_pass, half, rot, D,
                  BLOCK_H: tl.constexpr, HAS_PASS: tl.constexpr):
    """Every head of one token of X into O: the rotation on the first rot dims, a copy after."""
    half_ok = offs_half < half
    pass_ok = offs_pass < D - rot
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        rows = (h < H)[:, None]
        x_row = X + h[:, None].to(tl.int64) * sxh
        o_row = O + h[:, None].to(tl.int64) * soh
        x1 = tl.load(x_row + offs_half[None, :] * sxd, mask=rows & half_ok[None, :], other=0.0).to(tl.float32)
        x2 = tl.load(x_row + (half + offs_half)[None, :] * sxd, mask=rows & half_ok[None, :], other=0.0).to(tl.float32)
        tl.store(o_row + offs_half[None, :] * sod, (x1 * c1 - x2 * s1).to(O.dtype.element_ty),
                 mask=rows & half_ok[None, :])
        tl.store(o_row + (half + offs_half)[None, :] * sod, (x2 * c2 + x1 * s2).to(O.dtype.element_ty),
                 mask=rows & half_ok[None, :])
        if HAS_PASS:
            rest = tl.load(x_row + (rot + offs_pass)[None, :] * sxd, mask=rows & pass_ok[None, :])
            tl.store(o_row + (rot + offs_pass)[None, :] * sod, rest, mask=rows & pass_ok[None, :])


@triton.jit
def rope_kernel(
    Q, K, QO, KO, COS, SIN, POS,
    S, H, HK, D, rot, table_rows,
    sqb, sqs, sqh, sqd, skb, sks, skh, skd, sob, sos, soh, sod, skob, skos, skoh, skod,
    scb, scs, scd, ssb, sss, ssd, spb, sps,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_H: tl.constexpr, HAS_PASS: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, TRANSPOSE: tl.constexpr,
):
    """One token (program b * S + s) of q (B, S, H, D) and k (B, S, HK, D). The angles: COS / SIN
    at (b, s) through their (batch, position, dim) strides (batch stride 0 where they broadcast),
    or with HAS_POSITIONS the table row POS[b, s] (NaN out of [0, table_rows)). TRANSPOSE: the
    gradient's rotation, (s1, s2) -> (-s2, -s1)."""
    token = tl.program_id(0)
    b = token // S
    s = token % S
    half = rot // 2
    offs_half = tl.arange(0, BLOCK_HALF)
    offs_pass = tl.arange(0, BLOCK_PASS)
    half_ok = offs_half < half
    if HAS_POSITIONS:
        position = tl.load(POS + b.to(tl.int64) * spb + s.to(tl.int64) * sps)
        inside = (position >= 0) & (position < table_rows)
        row = tl.where(inside, position, 0).to(tl.int64)
        c_row = COS + row * scs
        s_row = SIN + row * sss
    else:
        c_row = COS + b.to(tl.int64) * scb + s.to(tl.int64) * scs
        s_row = SIN + b.to(tl.int64) * ssb + s.to(tl.int64) * sss
    c1 = tl.load(c_row + offs_half * scd, mask=half_ok, other=0.0).to(tl.float32)
    c2 = tl.load(c_row + (half + offs_half) * scd, mask=half_ok, other=0.0).to(tl.float32)
    s1 = tl.load(s_row + offs_half * ssd, mask=half_ok, other=0.0).to(tl.float32)
    s2 = tl.load(s_row + (half + offs_half) * ssd, mask=half_ok, other=0.0).to(tl.float32)
    if HAS_POSITIONS:  # an out-of-range position shows as NaN, not as another token's angles
        c1 = tl.where(inside, c1, float("nan"))
        c2 = tl.where(inside, c2, float("nan"))
        s1 = tl.where(inside, s1, float("nan"))
        s2 = tl.where(inside, s2, float("nan"))
    if TRANSPOSE:
        s1, s2 = -s2, -s1
    c1, c2, s1, s2 = c1[None, :], c2[None, :], s1[None, :], s2[None, :]
    q_token = Q + b.to(tl.int64) * sqb + s.to(tl.int64) * sqs
    qo_token = QO + b.to(tl.int64) * sob + s.to(tl.int64) * sos
    _rotate_heads(q_token, qo_token, sqh, sqd, soh, sod, H, c1, c2, s1, s2, offs_half, offs_pass, half, rot, D,
                  BLOCK_H, HAS_PASS)
    k_token = K + b.to(tl.int64) * skb + s.to(tl.int64) * sks
    ko_token = KO + b.to(tl.int64) * skob + s.to(tl.int64) * skos
    _rotate_heads(k_token, ko_token, skh, skd, skoh, skod, HK, c1, c2, s1, s2, offs_half, offs_pass, half, rot,
                  D, BLOCK_H, HAS_PASS)


def rope_tokens(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: Optional[torch.Tensor], transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's launcher interface: q (B, S, H, D), k (B, S, HK, D) views; cos / sin
    (Bc, S, rot) or, with positions (B, S), (P, rot) tables."""
    B, S, H, D = q.shape
    HK = k.shape[2]
    rot = cos.shape[-1]
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if q.numel() == 0 and k.numel() == 0:
        return q_out, k_out
    block_half = max(1, next_power_of_2(rot // 2))
    block_pass = max(1, next_power_of_2(D - rot))
    block_h = max(1, min(next_power_of_2(max(H, HK)), MAX_TILE // max(block_half, block_pass)))
    if positions is None:
        cos_strides = (cos.stride(0) if cos.shape[0] > 1 else 0, *cos.stride()[1:])
        sin_strides = (sin.stride(0) if sin.shape[0] > 1 else 0, *sin.stride()[1:])
        position_strides, table_rows, pos = (0, 0), 0, cos
    else:  # tables: the row stride takes the position's place
        cos_strides, sin_strides = (0, *cos.stride()), (0, *sin.stride())
        position_strides = tuple(positions.stride()) if positions.shape[0] > 1 else (0, positions.stride(1))
        table_rows, pos = cos.shape[0], positions
    with on_device(q):
        launch(rope_kernel, (B * S,), q, k, q_out, k_out, cos, sin, pos, S, H, HK, D, rot, table_rows,
               *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(), *cos_strides, *sin_strides,
               *position_strides, BLOCK_HALF=block_half, BLOCK_PASS=block_pass, BLOCK_H=block_h,
               HAS_PASS=rot < D, HAS_POSITIONS=positions is not None, TRANSPOSE=transpose, num_warps=4)
    return q_out, k_out


__all__ = ["rope_kernel", "rope_tokens"]
