"""Triton kernels of flash_attention_varlen: packed sequences, offsets read on the device.

q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv); sequence b owns q rows
cu_seqlens_q[b]:cu_seqlens_q[b + 1] and k / v rows cu_seqlens_k[b]:cu_seqlens_k[b + 1]. Every
kernel's grid is (tiles of max_seqlen, heads, batch): a program loads its sequence's two
offsets from cu_seqlens (no host read, so a call can be captured in a CUDA graph), and a
program whose tile starts past its sequence's length exits at once. max_seqlen_q / _k are
trusted, as in FlashAttention: a sequence longer than them has its rows past max_seqlen left
uncomputed (zeros), which nothing here can detect without a host sync. Within a sequence the
work is kernelforge.flash_attention's: Sq = Lq, Sk = Lk, off = Lk - Lq (causal and window
aligned bottom-right per sequence), through the dense kernels' tile helpers of attention_kernels.py
(forward_tile, finish_rows, backward_delta_kernel, dkdv_tile, dq_tile, lse_in_log2: the same code
the dense attention runs, the packed lse read lse_stride = heads apart) and attention_visibility.py
(row_range, col_range), with attn_mask and block masks off (MASK_KIND 0, no BLOCK_SPARSE).

Work per head, summed over sequences (b = bytes per element, P = sum_b Lq_b * Lk_b pairs, half
or less under causal / a window):
  varlen_forward_kernel   FLOPs 2 P (D + Dv). Bytes: Q and O once (total_q * (D + Dv) * b),
                          lse 4 * total_q, K and V once per query tile of their sequence
                          (sum_b ceil(Lq_b / BLOCK_M) * Lk_b * (D + Dv) * b, mostly from L2).
  backward_delta_kernel   FLOPs 2 total_q Dv. Bytes: O and dO read once, 4 * total_q written.
  varlen_dkdv_kernel      FLOPs 2 P (2 D + 2 Dv) (S = K Q^T, dP^T = V dO^T, dV, dK). Bytes: K, V
                          read and dK, dV written once; Q, dO, lse, delta once per key tile of
                          their sequence (sum_b ceil(Lk_b / BLOCK_N) * Lq_b * (D + Dv) * b).
  varlen_dq_kernel        FLOPs 2 P (2 D + Dv) (S, dP, dQ). Bytes: Q, dO, lse, delta read and dQ
                          written once; K, V once per query tile of their sequence.
The backward is deterministic: every dK / dV element is summed by one program (over the q heads
of its group and the query tiles, in order), every dQ element by one; no atomics.

Launch configs: fixed 64 x 64 tiles, 4 warps, 2 stages (the dense kernels' backward tiles; the
backward at head dim 256 takes their 32 x 64, 1 stage), NOT yet tuned or even run on a GPU
for this op (TILES); 16 x 16 under the CPU interpreter, where small tiles exercise more tile
edges per test. The Triton backend takes head dims up to 256 (the padded
head dim is a power of two >= 16).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernelforge.reference.attention import Visibility
from kernelforge.triton import interpreter_enabled
from kernelforge.triton._launch import cdiv, launch, next_power_of_2, on_device
from kernelforge.triton.attention_kernels import (backward_delta_kernel, dkdv_tile, dq_tile, finish_rows, forward_tile,
                                                  lse_in_log2)
from kernelforge.triton.attention_visibility import LN2, col_range, row_range

MAX_HEAD_DIM = 256
LOG2E_HOST = 1.4426950408889634  # the kernels take scores in log2 units
# (BLOCK_M, BLOCK_N, num_warps, num_stages), NOT tuned for this op. A padded head dim of 256
# takes the dense kernels' choice for it (kernelforge/triton/attention.py): the dK/dV program's
# four 64 x 256 float32 tiles leave no room for a 64-row query tile or a second stage.
TILES = {"forward": (64, 64, 4, 2), "backward": (64, 64, 4, 2)}
TILES_D256 = {"forward": (64, 64, 4, 2), "backward": (32, 64, 4, 1)}
INTERPRETER_TILES = (16, 16, 4, 1)


def why_not(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return f"the Triton kernels take head dims up to {MAX_HEAD_DIM}, got {q.shape[-1]} (q, k) and {v.shape[-1]} (v)"
    return None


@triton.jit
def _sequence(CU_Q, CU_K, b):
    """(first q row, Lq, first k row, Lk) of sequence b; offsets as int64 for the pointers."""
    q0 = tl.load(CU_Q + b).to(tl.int64)
    k0 = tl.load(CU_K + b).to(tl.int64)
    Lq = (tl.load(CU_Q + b + 1) - q0).to(tl.int32)
    Lk = (tl.load(CU_K + b + 1) - k0).to(tl.int32)
    return q0, Lq, k0, Lk


@triton.jit
def varlen_forward_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K, sqm, sqh, skn, skh, svn, svh, som, soh, slm,
    GROUP, LEFT, RIGHT, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program per (query tile, head, sequence); the heaviest tiles (causal: the last) first."""
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes a Python float as fp64
    h = tl.program_id(1)
    q0, Lq, k0, Lk = _sequence(CU_Q, CU_K, tl.program_id(2))
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    if m0 >= Lq:  # past this sequence's rows
        return
    off = Lk - Lq
    hk = h // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Lq
    q = tl.load(Q + q0 * sqm + h.to(tl.int64) * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_base = K + k0 * skn + hk.to(tl.int64) * skh
    v_base = V + k0 * svn + hk.to(tl.int64) * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # three runs of key tiles: masked (left edge), inside every bound, masked (right edge and the Lk tail)
    lo, full_lo, full_hi, hi = row_range(m0, Lq, Lk, off, LEFT, RIGHT, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    for n0 in range(lo, full_lo, BLOCK_N):
        acc, m_i, l_i = forward_tile(
            acc, m_i, l_i, q, k_base, v_base, skn, svn, n0, offs_m, offs_n, offs_d, offs_dv, Lq, Lk, off, LEFT,
            RIGHT, qk_scale, Q, 0, 0, Q, -1, True, HEAD_DIM, HEAD_DIM_V, True, HAS_LEFT, HAS_RIGHT, 0, False, 16, 16,
            PRECISION)
    for n0 in range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = forward_tile(
            acc, m_i, l_i, q, k_base, v_base, skn, svn, n0, offs_m, offs_n, offs_d, offs_dv, Lq, Lk, off, LEFT,
            RIGHT, qk_scale, Q, 0, 0, Q, -1, False, HEAD_DIM, HEAD_DIM_V, False, HAS_LEFT, HAS_RIGHT, 0, False, 16,
            16, PRECISION)
    for n0 in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = forward_tile(
            acc, m_i, l_i, q, k_base, v_base, skn, svn, n0, offs_m, offs_n, offs_d, offs_dv, Lq, Lk, off, LEFT,
            RIGHT, qk_scale, Q, 0, 0, Q, -1, True, HEAD_DIM, HEAD_DIM_V, True, HAS_LEFT, HAS_RIGHT, 0, False, 16, 16,
            PRECISION)
    out, lse2 = finish_rows(acc, m_i, l_i)
    tl.store(LSE + (q0 + offs_m) * slm + h, lse2 * LN2, mask=row_ok)
    tl.store(O + q0 * som + h.to(tl.int64) * soh + offs_m[:, None] * som + offs_dv[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def varlen_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, sqm, sqh, skn, skh, svn, svh, sdm, sdh, slm, sdlh,
    sdkn, sdkh, sdvn, sdvh, GROUP, LEFT, RIGHT, qk_scale, scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program per (key tile, kv head, sequence): walks the query tiles of the sequence that
    see the key tile, for each q head of the group in turn, and writes dK, dV once."""
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)
    hk = tl.program_id(1)
    q0, Lq, k0, Lk = _sequence(CU_Q, CU_K, tl.program_id(2))
    n0 = tl.program_id(0) * BLOCK_N
    if n0 >= Lk:
        return
    off = Lk - Lq
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_ok = offs_n[:, None] < Lk
    k = tl.load(K + k0 * skn + hk.to(tl.int64) * skh + offs_n[:, None] * skn + offs_d[None, :],
                mask=key_ok & (offs_d[None, :] < HEAD_DIM), other=0.0)
    v = tl.load(V + k0 * svn + hk.to(tl.int64) * svh + offs_n[:, None] * svn + offs_dv[None, :],
                mask=key_ok & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    # float32 ("ieee"): one accumulator chain per head, summed after (attention_kernels.py says why)
    dk_sum = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv_sum = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo, full_lo, full_hi, hi = col_range(n0, Lq, Lk, off, LEFT, RIGHT, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    for g in range(GROUP):
        h = (hk * GROUP + g).to(tl.int64)
        q_base = Q + q0 * sqm + h * sqh
        do_base = DO + q0 * sdm + h * sdh
        lse_base = LSE + q0 * slm + h
        delta_base = DELTA + h * sdlh + q0
        for m0 in range(lo, full_lo, BLOCK_M):
            dk, dv = dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqm, sdm, m0, offs_m, offs_n,
                               offs_d, offs_dv, Lq, Lk, off, LEFT, RIGHT, qk_scale, q_base, 0, 0, q_base, -1, True,
                               slm, HEAD_DIM, HEAD_DIM_V, True, HAS_LEFT, HAS_RIGHT, 0, False, 16, 16, PRECISION)
        for m0 in range(full_lo, full_hi, BLOCK_M):
            dk, dv = dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqm, sdm, m0, offs_m, offs_n,
                               offs_d, offs_dv, Lq, Lk, off, LEFT, RIGHT, qk_scale, q_base, 0, 0, q_base, -1, False,
                               slm, HEAD_DIM, HEAD_DIM_V, False, HAS_LEFT, HAS_RIGHT, 0, False, 16, 16, PRECISION)
        for m0 in range(full_hi, hi, BLOCK_M):
            dk, dv = dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqm, sdm, m0, offs_m, offs_n,
                               offs_d, offs_dv, Lq, Lk, off, LEFT, RIGHT, qk_scale, q_base, 0, 0, q_base, -1, True,
                               slm, HEAD_DIM, HEAD_DIM_V, True, HAS_LEFT, HAS_RIGHT, 0, False, 16, 16, PRECISION)
        if PRECISION == "ieee":
            dk_sum += dk
            dv_sum += dv
            dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    if PRECISION == "ieee":
        dk = dk_sum
        dv = dv_sum
    tl.store(DK + k0 * sdkn + hk.to(tl.int64) * sdkh + offs_n[:, None] * sdkn + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=key_ok & (offs_d[None, :] < HEAD_DIM))
    tl.store(DV + k0 * sdvn + hk.to(tl.int64) * sdvh + offs_n[:, None] * sdvn + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=key_ok & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def varlen_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K, sqm, sqh, skn, skh, svn, svh, sdm, sdh, slm, sdlh, sdqm, sdqh,
    GROUP, LEFT, RIGHT, qk_scale, scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program per (query tile, head, sequence), over the key tiles it sees, as the forward."""
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)
    h = tl.program_id(1)
    q0, Lq, k0, Lk = _sequence(CU_Q, CU_K, tl.program_id(2))
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    if m0 >= Lq:
        return
    off = Lk - Lq
    hk = h // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m[:, None] < Lq
    q = tl.load(Q + q0 * sqm + h.to(tl.int64) * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=row_ok & (offs_d[None, :] < HEAD_DIM), other=0.0)
    do = tl.load(DO + q0 * sdm + h.to(tl.int64) * sdh + offs_m[:, None] * sdm + offs_dv[None, :],
                 mask=row_ok & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    lse2 = lse_in_log2(LSE + q0 * slm + h, offs_m, Lq, slm)
    delta = tl.load(DELTA + h.to(tl.int64) * sdlh + q0 + offs_m, mask=offs_m < Lq, other=0.0)
    k_base = K + k0 * skn + hk.to(tl.int64) * skh
    v_base = V + k0 * svn + hk.to(tl.int64) * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, full_lo, full_hi, hi = row_range(m0, Lq, Lk, off, LEFT, RIGHT, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    for n0 in range(lo, full_lo, BLOCK_N):
        dq = dq_tile(dq, q, do, lse2, delta, k_base, v_base, skn, svn, n0, offs_m, offs_n, offs_d, offs_dv, Lq, Lk,
                     off, LEFT, RIGHT, qk_scale, k_base, 0, 0, k_base, -1, True, HEAD_DIM, HEAD_DIM_V, True,
                     HAS_LEFT, HAS_RIGHT, 0, False, 16, 16, PRECISION)
    for n0 in range(full_lo, full_hi, BLOCK_N):
        dq = dq_tile(dq, q, do, lse2, delta, k_base, v_base, skn, svn, n0, offs_m, offs_n, offs_d, offs_dv, Lq, Lk,
                     off, LEFT, RIGHT, qk_scale, k_base, 0, 0, k_base, -1, False, HEAD_DIM, HEAD_DIM_V, False,
                     HAS_LEFT, HAS_RIGHT, 0, False, 16, 16, PRECISION)
    for n0 in range(full_hi, hi, BLOCK_N):
        dq = dq_tile(dq, q, do, lse2, delta, k_base, v_base, skn, svn, n0, offs_m, offs_n, offs_d, offs_dv, Lq, Lk,
                     off, LEFT, RIGHT, qk_scale, k_base, 0, 0, k_base, -1, True, HEAD_DIM, HEAD_DIM_V, True,
                     HAS_LEFT, HAS_RIGHT, 0, False, 16, 16, PRECISION)
    tl.store(DQ + q0 * sdqm + h.to(tl.int64) * sdqh + offs_m[:, None] * sdqm + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=row_ok & (offs_d[None, :] < HEAD_DIM))


# ----------------------------------------------------------------------------- launchers
def _pow2(n: int) -> int:
    return max(16, next_power_of_2(int(n)))


def _tiles(q: torch.Tensor, v: torch.Tensor, direction: str) -> tuple:
    if interpreter_enabled() and q.device.type == "cpu":
        return INTERPRETER_TILES
    return (TILES_D256 if max(_pow2(q.shape[-1]), _pow2(v.shape[-1])) > 128 else TILES)[direction]


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _band(vis: Visibility) -> dict:
    return dict(HAS_LEFT=vis.left is not None, HAS_RIGHT=vis.right is not None)


def _precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"  # float32 keeps full float32 products


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float, vis: Visibility):
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    total_q, H, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    batch = cu_seqlens_q.shape[0] - 1
    # rows outside every sequence (past cu_seqlens_q[-1]) are never written by a program: zeros, -inf
    out = torch.zeros(total_q, H, Dv, dtype=q.dtype, device=q.device)
    lse = torch.full((total_q, H), float("-inf"), dtype=torch.float32, device=q.device)
    if batch == 0 or max_seqlen_q == 0:
        return out, lse
    block_m, block_n, warps, stages = _tiles(q, v, "forward")
    with on_device(q):
        launch(varlen_forward_kernel, (cdiv(max_seqlen_q, block_m), H, batch),
               q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
               v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0), H // Hkv,
               vis.left or 0, vis.right or 0, scale * LOG2E_HOST,
               HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=_pow2(D), BLOCK_DV=_pow2(Dv), BLOCK_M=block_m, BLOCK_N=block_n,
               PRECISION=_precision(q), num_warps=warps, num_stages=stages, **_band(vis))
    return out, lse


def varlen_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                    max_seqlen_k: int, scale: float, vis: Visibility):
    q, k, v, out, grad_out = (_unit_last(t) for t in (q, k, v, out, grad_out))
    lse = lse.contiguous()
    total_q, H, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    batch = cu_seqlens_q.shape[0] - 1
    # zeros outside every sequence; inside, each element is written by exactly one program
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))  # dense, any input
    if batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0 or total_q == 0:
        return dq, dk, dv
    delta = torch.empty(H, total_q, dtype=torch.float32, device=q.device)  # (H, total_q): one "batch" of H heads
    block_m, block_n, warps, stages = _tiles(q, v, "backward")
    common = dict(HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=_pow2(D), BLOCK_DV=_pow2(Dv), BLOCK_M=block_m, BLOCK_N=block_n,
                  PRECISION=_precision(q), num_warps=warps, num_stages=stages, **_band(vis))
    band = (vis.left or 0, vis.right or 0, scale * LOG2E_HOST, scale)
    with on_device(q):
        # delta = rowsum(dO * O) needs no sequence: the dense kernel over total_q rows as batch 1
        rows = 64
        launch(backward_delta_kernel, (cdiv(total_q, rows), H), out, grad_out, delta, 0, out.stride(1),
               out.stride(0), 0, grad_out.stride(1), grad_out.stride(0), H, total_q,
               HEAD_DIM_V=Dv, BLOCK_M=rows, BLOCK_DV=_pow2(Dv))
        launch(varlen_dkdv_kernel, (cdiv(max_seqlen_k, block_n), Hkv, batch),
               q, k, v, grad_out, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, q.stride(0), q.stride(1),
               k.stride(0), k.stride(1), v.stride(0), v.stride(1), grad_out.stride(0), grad_out.stride(1),
               lse.stride(0), delta.stride(0), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), H // Hkv,
               *band, **common)
        launch(varlen_dq_kernel, (cdiv(max_seqlen_q, block_m), H, batch),
               q, k, v, grad_out, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, q.stride(0), q.stride(1),
               k.stride(0), k.stride(1), v.stride(0), v.stride(1), grad_out.stride(0), grad_out.stride(1),
               lse.stride(0), delta.stride(0), dq.stride(0), dq.stride(1), H // Hkv, *band, **common)
    return dq, dk, dv
