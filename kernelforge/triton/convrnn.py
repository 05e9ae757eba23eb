"""Triton ConvRNN kernels: all T steps of one batch row in one program (forward and backward
through time), and their launchers (the backend interface of kernelforge/ops/convrnn.py).

The recurrence couples neighbouring features (the K-tap convolution), so a step needs the whole
previous state: one program owns one batch row and walks the time steps in order, the state in
float32. A Triton tensor cannot be shifted by a tap offset in registers, so each step writes
its state to a float32 workspace row (two rows, alternating: the step that reads one writes the
other), a barrier makes the writes visible to the program's other threads, and the K shifted
reads come back from L1/L2 (`.cg`: from L2, never a stale line).

Per batch row and step, forward: F inputs read, F outputs written (input dtype), K * F taps;
backward: grad_out, out (h_t and h_{t-1}) read, dx written, 2 K * F taps. About 2K + 20 FLOPs
a feature a step: latency-bound (one barrier a step), never bandwidth-bound; the win over the
reference loop is doing T steps in one launch instead of ~5 launches a step.

Every step's tanh is libdevice's on the GPU; Triton's interpreter has no libdevice, so there a
continued fraction (|a| < 0.55) or (1 - e) / (1 + e) with e = exp(-2|a|) stands in, in float64
and rounded once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernelforge.triton import interpreter_enabled
from kernelforge.triton._launch import launch, next_power_of_2, on_device
from kernelforge.triton.masks import block_and_scalar

# One program holds a batch row: its (taps rounded up to a power of two) x (features rounded up)
# tap tile, float32, across at most 16 warps: 64 values a thread at most. Three taps: up to
# 8192 features; five to seven: 4096. Wider rows take the CUDA kernels (16384 features, 15
# taps) or the reference.
MAX_TILE = 32768


@triton.jit
def _tanh(a, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.tanh(a)
    else:  # the interpreter: float64, then one rounding (0.5 ulp, as torch.tanh on the CPU)
        a = a.to(tl.float64)
        mag = tl.abs(a)
        e = tl.exp(-2.0 * mag)
        large = (1.0 - e) / (1.0 + e)  # 1 - e >= 0.66 here: no cancellation
        t = mag * mag  # Lambert's continued fraction a / (1 + a^2 / (3 + a^2 / (5 + ...)))
        c = 17.0 + t / 19.0
        c = 15.0 + t / c
        c = 13.0 + t / c
        c = 11.0 + t / c
        c = 9.0 + t / c
        c = 7.0 + t / c
        c = 5.0 + t / c
        c = 3.0 + t / c
        c = 1.0 + t / c
        r = tl.where(mag < 0.55, mag / c, large)
        return tl.where(a < 0, -r, r).to(tl.float32)


@triton.jit
def _taps(row, f, F, PAD: tl.constexpr, BLOCK_K: tl.constexpr, KSIZE: tl.constexpr, SIGN: tl.constexpr):
    """A (BLOCK_K, BLOCK_F) float32 tile: row[f + SIGN * (j - PAD)] for tap j, 0 outside [0, F)
    and for j >= KSIZE. row: a float32 row pointer (the workspace, or an input row upcast)."""
    j = tl.arange(0, BLOCK_K)
    idx = f[None, :] + SIGN * (j[:, None] - PAD)
    ok = (j[:, None] < KSIZE) & (idx >= 0) & (idx < F)
    return tl.load(row + idx, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def _row_program(F, BLOCK_K: tl.constexpr, BLOCK_F: tl.constexpr):
    """What both kernels start from: this program's batch row b, the feature offsets and their
    mask, the tap offsets. No pointer goes through this call: torch.compile's analysis of which
    tensors a kernel writes (torch.library.wrap_triton) counts every pointer argument of a call
    whose results address a store as written (the taps, an input, would be copied back)."""
    b = tl.program_id(0)
    f = tl.arange(0, BLOCK_F)
    return b, f, f < F, tl.arange(0, BLOCK_K)


@triton.jit
def convrnn_forward_kernel(X, W, H0, OUT, HT, WORK, sxb, sxt, shb, T, F,
                           KSIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_F: tl.constexpr,
                           PRECISE: tl.constexpr):
    """out[b, t] = h_{t+1} = tanh(x[b, t] + conv(h_t)), t = 0..T-1; HT[b] = h_T. x and h0 have
    unit feature stride; out, HT, WORK are dense; WORK is (B, 2, BLOCK_F) float32."""
    PAD: tl.constexpr = KSIZE // 2
    b, f, inside, j = _row_program(F, BLOCK_K, BLOCK_F)
    w = tl.load(W + j, mask=j < KSIZE, other=0.0).to(tl.float32)  # the taps, 0 past KSIZE
    work = WORK + b.to(tl.int64) * 2 * BLOCK_F  # the row's workspace
    h = tl.load(H0 + b.to(tl.int64) * shb + f, mask=inside, other=0.0).to(tl.float32)
    tl.store(work + f, h, mask=inside)
    tl.debug_barrier()
    x_row = X + b.to(tl.int64) * sxb
    out_row = OUT + b.to(tl.int64) * T * F
    x_next = tl.load(x_row + f, mask=block_and_scalar(inside, T > 0), other=0.0).to(tl.float32)
    for t in range(T):
        x_t = x_next
        x_next = tl.load(x_row + (t + 1) * sxt + f, mask=block_and_scalar(inside, t + 1 < T), other=0.0).to(tl.float32)
        prev = _taps(work + (t % 2) * BLOCK_F, f, F, PAD, BLOCK_K, KSIZE, 1)
        h = _tanh(x_t + tl.sum(w[:, None] * prev, 0), PRECISE)
        tl.store(out_row + t * F + f, h.to(OUT.dtype.element_ty), mask=inside)
        tl.store(work + ((t + 1) % 2) * BLOCK_F + f, h, mask=inside)
        tl.debug_barrier()
    tl.store(HT + b.to(tl.int64) * F + f, h.to(HT.dtype.element_ty), mask=inside)


@triton.jit
def convrnn_backward_kernel(GRAD_OUT, GRAD_H, W, H0, OUT, DX, DH0, DW_PART, WORK, sgb, sgt, sghb, shb, T, F,
                            KSIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_F: tl.constexpr):
    """Backward through time for one batch row (the reference's formulas, kernelforge/reference/
    convrnn.py): dx (dense, input dtype), dh0 (dense), and this row's dkernel partial (B, BLOCK_K)
    float32 (summed over rows on the host, in a fixed order). WORK holds da_t, two rows."""
    PAD: tl.constexpr = KSIZE // 2
    b, f, inside, j = _row_program(F, BLOCK_K, BLOCK_F)
    w = tl.load(W + j, mask=j < KSIZE, other=0.0).to(tl.float32)  # the taps, 0 past KSIZE
    work = WORK + b.to(tl.int64) * 2 * BLOCK_F  # the row's workspace
    out_row = OUT + b.to(tl.int64) * T * F
    go_row = GRAD_OUT + b.to(tl.int64) * sgb
    g = tl.load(GRAD_H + b.to(tl.int64) * sghb + f, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_K, BLOCK_F], tl.float32)
    for step in range(T):
        t = T - 1 - step  # out[:, t] is h_{t+1}; its predecessor is out[:, t-1], or h0
        h_t = tl.load(out_row + t * F + f, mask=inside, other=0.0).to(tl.float32)
        da = (g + tl.load(go_row + t * sgt + f, mask=inside, other=0.0).to(tl.float32)) * (1.0 - h_t * h_t)
        tl.store(DX + (b.to(tl.int64) * T + t) * F + f, da.to(DX.dtype.element_ty), mask=inside)
        if t > 0:
            prev = _taps(out_row + (t - 1) * F, f, F, PAD, BLOCK_K, KSIZE, 1)
        else:
            prev = _taps(H0 + b.to(tl.int64) * shb, f, F, PAD, BLOCK_K, KSIZE, 1)
        dw += da[None, :] * prev
        slot = work + (step % 2) * BLOCK_F
        tl.store(slot + f, da, mask=inside)
        tl.debug_barrier()
        # lanes past F stay 0: a tap reaches back inside from there, and da must not grow there
        g = tl.where(inside, tl.sum(w[:, None] * _taps(slot, f, F, PAD, BLOCK_K, KSIZE, -1), 0), 0.0)
    tl.store(DH0 + b.to(tl.int64) * F + f, g.to(DH0.dtype.element_ty), mask=inside)
    tl.store(DW_PART + b * BLOCK_K + j, tl.sum(dw, 1))


def why_not(x: torch.Tensor, kernel: torch.Tensor) -> str | None:
    # int(): a row's tile is a compile-time shape, so symbolic sizes (torch.compile's dynamic
    # shapes) of the features and taps are specialized
    F, K = int(x.shape[-1]), int(kernel.shape[-1])
    tile = next_power_of_2(K) * next_power_of_2(max(F, 16))
    if tile > MAX_TILE:
        return (f"the Triton kernels hold a (taps x features) tile of a row in one program, at most {MAX_TILE} values "
                f"(powers of two), got {K} taps x {F} features")
    return None


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _meta(F: int, K: int) -> dict:
    F, K = int(F), int(K)  # see why_not
    block_f, block_k = next_power_of_2(max(F, 16)), next_power_of_2(K)
    return dict(KSIZE=K, BLOCK_K=block_k, BLOCK_F=block_f, num_warps=min(16, max(4, block_k * block_f // 2048)))


def convrnn_forward(x: torch.Tensor, kernel: torch.Tensor, hidden: torch.Tensor):
    x, hidden = _unit_last(x), _unit_last(hidden)
    B, T, F = x.shape
    K = kernel.shape[-1]
    meta = _meta(F, K)
    out = torch.empty(B, T, F, dtype=x.dtype, device=x.device)
    h_T = torch.empty(B, F, dtype=x.dtype, device=x.device)
    work = torch.empty(B, 2, meta["BLOCK_F"], dtype=torch.float32, device=x.device)
    if B:
        with on_device(x):
            launch(convrnn_forward_kernel, (B,), x, kernel.reshape(-1).contiguous(), hidden, out, h_T, work,
                   x.stride(0), x.stride(1), hidden.stride(0), T, F,
                   PRECISE=not interpreter_enabled(), **meta)
    return out, h_T


def convrnn_backward(grad_out: torch.Tensor, grad_h: torch.Tensor, kernel: torch.Tensor, hidden: torch.Tensor,
                     out: torch.Tensor):
    grad_out, grad_h, hidden, out = (_unit_last(t) for t in (grad_out, grad_h, hidden, out.contiguous()))
    B, T, F = out.shape
    K = kernel.shape[-1]
    meta = _meta(F, K)
    dx = torch.empty(B, T, F, dtype=out.dtype, device=out.device)
    dh0 = torch.empty(B, F, dtype=hidden.dtype, device=out.device)
    dw_part = torch.empty(B, meta["BLOCK_K"], dtype=torch.float32, device=out.device)  # every entry written
    work = torch.empty(B, 2, meta["BLOCK_F"], dtype=torch.float32, device=out.device)
    if B:
        with on_device(out):
            launch(convrnn_backward_kernel, (B,), grad_out, grad_h, kernel.reshape(-1).contiguous(), hidden, out,
                   dx, dh0, dw_part, work, grad_out.stride(0), grad_out.stride(1), grad_h.stride(0),
                   hidden.stride(0), T, F, **meta)
    dkernel = dw_part[:, :K].sum(0).reshape(kernel.shape).to(kernel.dtype)
    return dx, dkernel, dh0
