"""Experiment: what holds the sliding-window forward at ~305 TFLOP/s computed when the same
64x64 tiles run a dense row at ~459? Hypothesis: per-program fixed costs (the Q load, three
separately pipelined loops of 1 + 7 + 1 key tiles, each with its own prologue and drain,
the epilogue) that a 9-tile run cannot amortize.

Variants of one causal-band forward kernel (no attn_mask, no block mask), timed against
kernelforge's current path and FlexAttention on the same window:
- loop=single-masked: one pipelined loop over the band, every tile masked through a
  loop-invariant (j - i) tile, so a mask costs an add, two compares and a select;
- loop=single-branch: one loop, the mask applied under a run-time branch on edge tiles;
- persistent: a grid of a few programs per SM walking the query tiles (optionally with
  tl.range(flatten=True), so the next tile's loads overlap this tile's tail).

    python3 benchmarks/window_experiment.py [--s 8192] [--window 512] [--variants [--tma]]

Without --variants: the library's forward and backward with the one-loop band walk on and
off (kernelforge.triton.attention.ONE_LOOP_WINDOW), next to Flex forward and forward+backward.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

from kernelforge.reference.attention import Visibility
from kernelforge.triton import attention as tri
from kernelforge.triton.attention_kernels import (flash_backward_dkdv_kernel, flash_backward_dq_kernel,
                                                  flash_forward_kernel)

LIBRARY_KERNELS = (flash_forward_kernel, flash_backward_dkdv_kernel, flash_backward_dq_kernel)

LOG2E = 1.4426950408889634


@triton.jit
def _band_bounds(m0, Sq, Sk, off, LEFT, RIGHT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key range [lo, hi) the query tile at m0 sees, and [full_lo, full_hi): its key tiles
    that need no mask."""
    m_last = tl.minimum(m0 + BLOCK_M, Sq) - 1
    lo = tl.maximum(m0 + off - LEFT, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(Sk, m_last + off + RIGHT + 1)
    full_lo = tl.maximum(m_last + off - LEFT + BLOCK_N - 1, 0) // BLOCK_N * BLOCK_N
    full_hi = tl.minimum((Sk // BLOCK_N) * BLOCK_N, tl.maximum(m0 + off + RIGHT + 1, 0) // BLOCK_N * BLOCK_N)
    return lo, hi, full_lo, full_hi


@triton.jit
def band_forward_kernel(Q, K, V, O, LSE, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                        H, Sq, Sk, off, LEFT, RIGHT, qk_scale, num_tiles, tiles_m,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BRANCH: tl.constexpr, FLATTEN: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr):
    """TMA: Q, K, V, O are 4-D TMA descriptors (block [1, 1, tile rows, HEAD_DIM]) instead of
    pointers; key rows past Sk come back as zeros, so the loads need no mask."""
    offs_i = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rel = offs_n[None, :] - offs_i[:, None]  # j - i inside a tile pair, loop invariant
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m = tiles_m - 1 - tile % tiles_m
        pid_bh = tile // tiles_m
        b = pid_bh // H
        h = pid_bh % H
        m0 = pid_m * BLOCK_M
        offs_m = m0 + offs_i
        if TMA:
            q = Q.load([b, h, m0, 0]).reshape(BLOCK_M, HEAD_DIM)
            k_base, v_base = K, V
        else:
            q = tl.load(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                        mask=offs_m[:, None] < Sq, other=0.0)
            k_base = K + b.to(tl.int64) * skb + h.to(tl.int64) * skh
            v_base = V + b.to(tl.int64) * svb + h.to(tl.int64) * svh
        lo, hi, full_lo, full_hi = _band_bounds(m0, Sq, Sk, off, LEFT, RIGHT, BLOCK_M, BLOCK_N)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for n0 in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
            cols = n0 + offs_n
            if TMA:
                k = k_base.load([b, h, n0, 0]).reshape(BLOCK_N, HEAD_DIM)
            else:
                k = tl.load(k_base + cols[:, None] * skn + offs_d[None, :], mask=cols[:, None] < Sk, other=0.0)
            qk = tl.dot(q, tl.trans(k))
            if BRANCH:
                if (n0 < full_lo) | (n0 >= full_hi):
                    t = rel + (n0 - m0 - off)
                    qk = tl.where((t >= -LEFT) & (t <= RIGHT) & (cols[None, :] < Sk), qk, float("-inf"))
            else:
                t = rel + (n0 - m0 - off)
                qk = tl.where((t >= -LEFT) & (t <= RIGHT) & (cols[None, :] < Sk), qk, float("-inf"))
            # scale > 0: max(qk) * scale is the max of the scaled scores, qk * scale - m one FMA
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk * qk_scale - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            if TMA:
                v = v_base.load([b, h, n0, 0]).reshape(BLOCK_N, HEAD_DIM)
            else:
                v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :], mask=cols[:, None] < Sk, other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        seen = l_i > 0
        l_safe = tl.where(seen, l_i, 1.0)
        out = tl.where(seen[:, None], acc / l_safe[:, None], 0.0)
        tl.store(LSE + pid_bh.to(tl.int64) * Sq + offs_m, tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf")) * 0.6931471805599453,
                 mask=offs_m < Sq)
        if TMA:
            O.store([b, h, m0, 0], out.reshape(1, 1, BLOCK_M, HEAD_DIM).to(O.dtype))
        else:
            tl.store(O + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * som + offs_d[None, :],
                     out.to(O.dtype.element_ty), mask=offs_m[:, None] < Sq)


@triton.jit
def _band_scores(q, K, skn, offs_d, m0, n0, offs_i, offs_n, Sk, off, LEFT, RIGHT, full_lo, full_hi):
    """S = Q K^T of key tile n0, the band applied on edge tiles (raw scores, -inf hidden)."""
    cols = n0 + offs_n
    k = tl.load(K + cols[:, None] * skn + offs_d[None, :], mask=cols[:, None] < Sk, other=0.0)
    qk = tl.dot(q, tl.trans(k))
    if (n0 < full_lo) | (n0 >= full_hi):
        t = offs_n[None, :] - offs_i[:, None] + (n0 - m0 - off)
        qk = tl.where((t >= -LEFT) & (t <= RIGHT) & (cols[None, :] < Sk), qk, float("-inf"))
    return qk


@triton.jit
def band_forward_pipelined_kernel(Q, K, V, O, LSE, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                                  H, Sq, Sk, off, LEFT, RIGHT, qk_scale,
                                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  STAGES: tl.constexpr):
    """The band forward with the softmax of key tile j placed after P_{j-1} V_{j-1} is issued
    (FlashAttention-3's intra-warpgroup overlap, by program order): iteration j issues
    S_j = Q K_j^T and acc += P_{j-1} V_{j-1}, then computes P_j while the second product runs,
    then rescales acc. Whether the tensor cores and the softmax really overlap is up to Triton's
    placement of the wgmma waits."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_i = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + offs_i
    q = tl.load(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=offs_m[:, None] < Sq, other=0.0)
    k_base = K + b.to(tl.int64) * skb + h.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + h.to(tl.int64) * svh
    lo, hi, full_lo, full_hi = _band_bounds(m0, Sq, Sk, off, LEFT, RIGHT, BLOCK_M, BLOCK_N)
    qk = _band_scores(q, k_base, skn, offs_d, m0, lo, offs_i, offs_n, Sk, off, LEFT, RIGHT, full_lo, full_hi)
    m_i = tl.max(qk, 1) * qk_scale
    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    p = tl.math.exp2(qk * qk_scale - m_use[:, None])
    l_i = tl.sum(p, 1)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in tl.range(lo + BLOCK_N, hi, BLOCK_N, num_stages=STAGES):
        qk = _band_scores(q, k_base, skn, offs_d, m0, n0, offs_i, offs_n, Sk, off, LEFT, RIGHT, full_lo, full_hi)
        prev = n0 - BLOCK_N + offs_n
        v = tl.load(v_base + prev[:, None] * svn + offs_d[None, :], mask=prev[:, None] < Sk, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
    last = lo + (tl.cdiv(hi - lo, BLOCK_N) - 1) * BLOCK_N + offs_n
    v = tl.load(v_base + last[:, None] * svn + offs_d[None, :], mask=last[:, None] < Sk, other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc)
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = tl.where(seen[:, None], acc / l_safe[:, None], 0.0)
    tl.store(LSE + pid_bh.to(tl.int64) * Sq + offs_m,
             tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf")) * 0.6931471805599453, mask=offs_m < Sq)
    tl.store(O + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * som + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=offs_m[:, None] < Sq)


def band_forward_pipelined(q, k, v, scale, left, block_m, block_n, warps, stages):
    B, H, S, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    band_forward_pipelined_kernel[(triton.cdiv(S, block_m), B * H)](
        q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        H, S, S, 0, left, 0, scale * LOG2E, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
        num_warps=warps, num_stages=stages)
    return out, lse


def report_resources(*kernels):
    """Registers, spills and shared memory of every compiled variant of `kernels`, and how many
    programs of each fit an SM by registers (64K) and by shared memory (227 KB)."""
    for kernel in kernels:
        for cache in kernel.device_caches.values():
            for compiled in cache[0].values():
                compiled._init_handles()
                meta = compiled.metadata
                threads = meta.num_warps * 32
                by_regs = 65536 // max(1, compiled.n_regs * threads)
                by_smem = (227 * 1024) // max(1, meta.shared)
                print(f"   {meta.name}: {meta.num_warps} warps, {meta.num_stages} stages, {compiled.n_regs} registers, "
                      f"{compiled.n_spills} spilled, {meta.shared} B shared: {min(by_regs, by_smem)} programs an SM "
                      f"(registers {by_regs}, shared {by_smem})", flush=True)


def _descriptor(t, rows):
    return TensorDescriptor.from_tensor(t, [1, 1, rows, t.shape[-1]])


def band_forward(q, k, v, scale, left, block_m, block_n, warps, stages, branch, programs_per_sm, flatten, tma=False):
    B, H, S, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    tiles_m = triton.cdiv(S, block_m)
    num_tiles = tiles_m * B * H
    if programs_per_sm:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        grid = (min(num_tiles, sms * programs_per_sm),)
    else:
        grid = (num_tiles,)
    tensors = (q, k, v, out)
    if tma:
        tensors = (_descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), _descriptor(out, block_m))
    band_forward_kernel[grid](*tensors, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                              *out.stride()[:3], H, S, S, 0, left, 0, scale * LOG2E, num_tiles, tiles_m,
                              HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, BRANCH=branch, FLATTEN=flatten,
                              STAGES=stages, TMA=tma, num_warps=warps, num_stages=stages)
    return out, lse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--s", type=int, default=8192)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--variants", action="store_true", help="time the experimental kernel's variants")
    ap.add_argument("--tma", action="store_true", help="with --variants: the kernel on TMA descriptors")
    ap.add_argument("--pipelined", action="store_true",
                    help="with --variants: the softmax of tile j after P_{j-1} V_{j-1} is issued")
    ap.add_argument("--backward-tiles", action="store_true",
                    help="time the library's one-loop backward at other tiles (BACKWARD_TILES[128] swapped)")
    args = ap.parse_args()
    B, H, S, D, W = 16384 // args.s, 16, args.s, 128, args.window
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = D ** -0.5
    flops = 4 * B * H * S * (W + 1) * D  # each query sees itself and W keys before it
    vis = Visibility.of(True, (W, 0))
    g = torch.randn_like(q)
    results = {}
    for one_loop in (True, False):
        tri.ONE_LOOP_WINDOW.update(forward=one_loop, backward=one_loop)
        out, lse = tri.flash_forward(q, k, v, scale, vis)
        grads = tri.flash_backward(g, q, k, v, out, lse, scale, vis)
        results[one_loop] = (out, lse, grads)
        fwd = do_bench(lambda: tri.flash_forward(q, k, v, scale, vis), rep=200)
        bwd = do_bench(lambda: tri.flash_backward(g, q, k, v, out, lse, scale, vis), rep=200)
        print(f"kernelforge one_loop={one_loop}: fwd {fwd * 1e3:.1f} us ({flops / fwd / 1e9:.1f} TFLOP/s), "
              f"bwd {bwd * 1e3:.1f} us, fwd+bwd {(fwd + bwd) * 1e3:.1f} us", flush=True)
    (o1, l1, g1), (o0, l0, g0) = results[True], results[False]
    print("one loop against three loops, max diff: out %.3g lse %.3g dq %.3g dk %.3g dv %.3g" % (
        (o1.float() - o0.float()).abs().max().item(), (l1 - l0).abs().max().item(),
        *((a.float() - b.float()).abs().max().item() for a, b in zip(g1, g0))), flush=True)
    tri.ONE_LOOP_WINDOW.update(forward=True, backward=True)
    ref, ref_lse = o1, l1
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        bm = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j <= W), None, None, S, S, device="cuda")
        flex = torch.compile(flex_attention, dynamic=False)
        fo = flex(q, k, v, block_mask=bm)
        print(f"flex vs ours max diff {(fo.float() - ref.float()).abs().max().item():.3g}")
        ms = do_bench(lambda: flex(q, k, v, block_mask=bm), rep=200)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        fo = flex(qg, kg, vg, block_mask=bm)
        ms_b = do_bench(lambda: torch.autograd.grad(fo, (qg, kg, vg), g, retain_graph=True), rep=200)
        print(f"flex: fwd {ms * 1e3:.1f} us ({flops / ms / 1e9:.1f} TFLOP/s), bwd {ms_b * 1e3:.1f} us, "
              f"fwd+bwd {(ms + ms_b) * 1e3:.1f} us", flush=True)
    except Exception as err:
        print("flex failed:", str(err)[:200])
    if args.backward_tiles:
        sweep_backward_tiles(q, k, v, g, scale, vis, flops, results[True][2])
    if not args.variants:
        return
    tiles = [(64, 64, 4, 3), (64, 64, 8, 3), (64, 64, 4, 4), (64, 32, 4, 3), (64, 32, 4, 4), (64, 128, 8, 2),
             (32, 64, 4, 3), (32, 32, 4, 3), (128, 64, 8, 3)]
    runs = [(tile, False, 0) for tile in tiles]
    if args.tma:  # the same kernel on TMA descriptors, at the tiles that came close without them
        tma_tiles = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3),
                     (128, 128, 8, 2)]
        runs = [((64, 64, 4, 3), False, 0)] + [(tile, True, 0) for tile in tma_tiles] + [((64, 64, 4, 3), True, 2)]
    if args.pipelined:
        for bm_, bn, w, st in ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 32, 4, 3)):
            label = f"pipelined {bm_}x{bn}/{w}w/{st}s"
            try:
                out, lse = band_forward_pipelined(q, k, v, scale, W, bm_, bn, w, st)
                err = (out.float() - ref.float()).abs().max().item()
                lerr = (lse - ref_lse).abs().max().item()
                ms = do_bench(lambda: band_forward_pipelined(q, k, v, scale, W, bm_, bn, w, st), rep=100)
                print(f"{label}: {ms * 1e3:.1f} us, {flops / ms / 1e9:.1f} TFLOP/s (err {err:.3g}, lse {lerr:.3g})",
                      flush=True)
            except Exception as err:
                print(f"{label}: failed {str(err)[:300]}", flush=True)
        runs = runs[:1]
    for (bm_, bn, w, st), tma, pps in runs:
        label = f"{bm_}x{bn}/{w}w/{st}s branch=1 persist={pps} tma={int(tma)}"
        try:
            out, lse = band_forward(q, k, v, scale, W, bm_, bn, w, st, True, pps, False, tma)
            err = (out.float() - ref.float()).abs().max().item()
            lerr = (lse - ref_lse).abs().max().item()
            ms = do_bench(lambda: band_forward(q, k, v, scale, W, bm_, bn, w, st, True, pps, False, tma), rep=100)
            print(f"{label}: {ms * 1e3:.1f} us, {flops / ms / 1e9:.1f} TFLOP/s (err {err:.3g}, lse {lerr:.3g})",
                  flush=True)
        except Exception as err:
            print(f"{label}: failed {str(err)[:300]}", flush=True)


    report_resources(band_forward_kernel, band_forward_pipelined_kernel, *LIBRARY_KERNELS)


def sweep_backward_tiles(q, k, v, g, scale, vis, flops, reference_grads):
    """The library's backward (both kernels take BACKWARD_TILES) at each candidate tile."""
    default = tri.BACKWARD_TILES[128]
    out, lse = tri.flash_forward(q, k, v, scale, vis)
    for block_m, block_n, warps, stages in ((64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (32, 64, 4, 3),
                                            (64, 32, 4, 3), (64, 128, 8, 2), (128, 64, 8, 2), (32, 128, 4, 2)):
        tri.BACKWARD_TILES[128] = tri.TileConfig(block_m, block_n, warps, stages)
        label = f"backward {block_m}x{block_n}/{warps}w/{stages}s"
        try:
            grads = tri.flash_backward(g, q, k, v, out, lse, scale, vis)
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, reference_grads))
            ms = do_bench(lambda: tri.flash_backward(g, q, k, v, out, lse, scale, vis), rep=100)
            print(f"{label}: {ms * 1e3:.1f} us, {2.5 * flops / ms / 1e9:.1f} TFLOP/s (max diff {err:.3g})",
                  flush=True)
        except Exception as err:
            print(f"{label}: failed {str(err)[:160]}", flush=True)
    tri.BACKWARD_TILES[128] = default


if __name__ == "__main__":
    main()
