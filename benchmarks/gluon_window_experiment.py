"""Experiment: the Gluon band forward (kernelforge/triton/attention_gluon.py) against the
Triton forward and FlexAttention on the causal sliding window of the attention targets (S = 8192,
16 heads, bf16, B * S = 16384), at ring depths 2 and 3, head dims 128 and 64; forward +
backward (the backward is the Triton one either way); and a causal window as long as the
sequence, to see whether the Gluon kernel would also pay on dense causal rows.

    python3 benchmarks/gluon_window_experiment.py [--s 8192] [--window 512]
"""
from __future__ import annotations

import argparse
import time

import torch
from triton.testing import do_bench

import kernelforge as kf
from kernelforge.reference.attention import Visibility
from kernelforge.triton import attention as tri
from kernelforge.triton import attention_gluon as glu

# (BLOCK_M, BLOCK_N, ring depth, warps) of the Gluon forward; the library's: the first, or the
# second at d128 (attention_gluon.ring_stages)
CONFIGS = [(64, 64, 2, 4), (64, 64, 1, 4), (64, 64, 3, 4), (64, 128, 1, 4)]
FIELDS = ("BLOCK_M", "BLOCK_N", "STAGES", "NUM_WARPS")


def forward(q, k, v, scale, vis, gluon_on):
    glu.ENABLED["window"] = gluon_on
    try:
        return tri.flash_forward(q, k, v, scale, vis)
    finally:
        glu.ENABLED["window"] = True


def time_forward(q, k, v, scale, vis, gluon_on):
    return do_bench(lambda: forward(q, k, v, scale, vis, gluon_on), rep=200)


def host_us(fn, calls=50):
    """Host time a call, launches queued back to back (the GPU queue does not fill in 50 calls)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def time_fwd_bwd(q, k, v, g, window, gluon_on):
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    glu.ENABLED["window"] = gluon_on

    def step():
        out = kf.flash_attention(qg, kg, vg, causal=True, window=window)
        torch.autograd.grad(out, (qg, kg, vg), g)

    try:
        with kf.use_backend("triton"):
            return do_bench(step, rep=200)
    finally:
        glu.ENABLED["window"] = True


def flex_times(q, k, v, g, W):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    S = q.shape[2]
    bm = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j <= W), None, None, S, S, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)
    fwd = do_bench(lambda: flex(q, k, v, block_mask=bm), rep=200)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def step():
        out = flex(qg, kg, vg, block_mask=bm)
        torch.autograd.grad(out, (qg, kg, vg), g)

    return fwd, do_bench(step, rep=200), flex(q, k, v, block_mask=bm)


def report_resources():
    for cache in glu.forward_kernel.device_caches.values():
        for compiled in cache[0].values():
            compiled._init_handles()
            meta = compiled.metadata
            print(f"   {meta.name}: {meta.num_warps} warps, {compiled.n_regs} registers, {compiled.n_spills} spilled, "
                  f"{meta.shared} B shared", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--s", type=int, default=8192)
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args()
    S, W = args.s, args.window
    print("Gluon configs:", FIELDS)
    for D in (128, 64):
        B, H = 16384 // S, 16
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        g = torch.randn_like(q)
        scale = D ** -0.5
        flops = 4 * B * H * S * (W + 1) * D  # each query sees itself and W keys before it
        vis = Visibility.of(True, (W, None))
        out_t, lse_t = forward(q, k, v, scale, vis, False)
        out_g, lse_g = forward(q, k, v, scale, vis, True)
        print(f"d{D}: gluon vs triton max diff out {(out_g.float() - out_t.float()).abs().max().item():.3g} "
              f"lse {(lse_g - lse_t).abs().max().item():.3g}", flush=True)
        t_tri = time_forward(q, k, v, scale, vis, False)
        print(f"d{D} window {W}: triton fwd {t_tri * 1e3:.1f} us ({flops / t_tri / 1e9:.1f} TFLOP/s)", flush=True)
        print(f"d{D} host us a call: triton {host_us(lambda: forward(q, k, v, scale, vis, False)):.1f}, gluon "
              f"{host_us(lambda: forward(q, k, v, scale, vis, True)):.1f}", flush=True)
        t_default = float("inf")
        default = tuple(getattr(glu, f) for f in FIELDS)
        one_stage, glu.ONE_STAGE_HEAD_DIM = glu.ONE_STAGE_HEAD_DIM, None  # STAGES rules every head dim here
        for config in CONFIGS:
            for field, value in zip(FIELDS, config):
                setattr(glu, field, value)
            try:
                out_c, lse_c = forward(q, k, v, scale, vis, True)
                diff = (out_c.float() - out_t.float()).abs().max().item()
                t_glu = time_forward(q, k, v, scale, vis, True)
            except Exception as err:  # noqa: BLE001 - an experiment reports and goes on
                print(f"d{D} gluon {config}: failed {str(err)[:300]}", flush=True)
                continue
            if config == default:
                t_default = t_glu
            print(f"d{D} window {W}: gluon fwd {config} {t_glu * 1e3:.1f} us "
                  f"({flops / t_glu / 1e9:.1f} TFLOP/s), {t_tri / t_glu:.2f}x triton, max diff {diff:.3g}", flush=True)
        for field, value in zip(FIELDS, default):
            setattr(glu, field, value)
        glu.ONE_STAGE_HEAD_DIM = one_stage
        fb_tri = time_fwd_bwd(q, k, v, g, (W, None), False)
        fb_glu = time_fwd_bwd(q, k, v, g, (W, None), True)
        print(f"d{D} window {W}: fwd+bwd triton {fb_tri * 1e3:.1f} us, gluon fwd + triton bwd {fb_glu * 1e3:.1f} us",
              flush=True)
        try:
            f_fwd, f_fb, f_out = flex_times(q, k, v, g, W)
            diff = (f_out.float() - out_g.float()).abs().max().item()
            print(f"d{D} window {W}: flex fwd {f_fwd * 1e3:.1f} us, fwd+bwd {f_fb * 1e3:.1f} us; gluon "
                  f"{f_fwd / t_default:.2f}x flex fwd (the default config), {f_fb / fb_glu:.2f}x flex fwd+bwd "
                  f"(max diff {diff:.3g})", flush=True)
        except Exception as err:  # noqa: BLE001 - an experiment reports and goes on
            print("flex failed:", str(err)[:300], flush=True)
        # a causal window as long as the sequence: dense causal through each forward
        dense = Visibility.of(True, (S, None))
        causal_flops = 2 * B * H * S * S * D
        t_c_tri = time_forward(q, k, v, scale, Visibility.of(True, None), False)
        t_c_glu = time_forward(q, k, v, scale, dense, True)
        out_c, _ = forward(q, k, v, scale, dense, True)
        ref_c, _ = forward(q, k, v, scale, Visibility.of(True, None), False)
        print(f"d{D} causal: triton {t_c_tri * 1e3:.1f} us ({causal_flops / t_c_tri / 1e9:.1f} TFLOP/s), gluon "
              f"{t_c_glu * 1e3:.1f} us ({causal_flops / t_c_glu / 1e9:.1f}), max diff "
              f"{(out_c.float() - ref_c.float()).abs().max().item():.3g}", flush=True)
    report_resources()


if __name__ == "__main__":
    main()
