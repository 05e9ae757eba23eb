"""Experiment: the Gluon backward (kernelforge/triton/attention_gluon_backward.py) at other tile
shapes and pipeline depths, against the Triton backward, on a sliding window, causal and full
attention, and on the harness's BlockMasks (the window as a mask, local + global, dilated: the
block-sparse kernels); and the library's backward with delta from its own launch and computed in
the dQ launch (FUSE_DELTA).

    python3 benchmarks/gluon_backward_experiment.py                 # GPU: agreement and timing
    python3 benchmarks/gluon_backward_experiment.py --compile-only  # CPU: sm_90a build report

Earlier runs (benchmarks/results/nvidia-h200/attention/gluon-backward-experiment/) also timed a
variant of each kernel that issued step t + 1's score MMAs before waiting for step t's
accumulating MMAs; it was slower (causal window 512, d128: dK/dV 502 against 305 us, dQ 261
against 216) and is gone. It needs two ring stages: at one it waits for a tile never loaded.
Run 6 timed a ring step's tiles on one mbarrier (Q, dO, lse, delta in dK/dV; K and V in dQ,
both fetched at the step's end) to save Triton's bar.syncs around each barrier: 7 to 15 us
slower at d128, and gone.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton

from kernelforge.reference.attention import Visibility
from kernelforge.triton import attention_gluon_backward as glb

# (block_m, block_n, stages, num_warps): one warpgroup a 64-row tile, or two sharing the streamed tiles
DKDV_CONFIGS = [(64, 64, 2, 4), (32, 64, 2, 4), (64, 128, 2, 8), (64, 64, 1, 4)]
DQ_CONFIGS = [(64, 64, 2, 4), (64, 64, 3, 4), (128, 64, 2, 8), (64, 64, 1, 4)]


def _config(values):
    return dict(zip(("block_m", "block_n", "stages", "num_warps"), values))


def dkdv(q, k, v, do, lse, delta, scale, vis, config):
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    args, constexprs = glb._arguments((dk, dv), q, k, v, do, lse, delta, scale, vis, **_config(config))
    glb.dkdv_kernel[(triton.cdiv(k.shape[2], config[1]), k.shape[0] * k.shape[1])](*args, **constexprs)
    return dk, dv


def dq(q, k, v, do, lse, delta, scale, vis, config):
    out = torch.empty_like(q)
    args, constexprs = glb._arguments((out,), q, k, v, do, lse, delta, scale, vis, **_config(config))
    glb.dq_kernel[(triton.cdiv(q.shape[2], config[0]), q.shape[0] * q.shape[1])](*args, **constexprs)
    return out


def compile_report(head_dim: int):
    for kernel, configs in (("dkdv", DKDV_CONFIGS), ("dq", DQ_CONFIGS)):
        for config in configs:
            usage = glb.compile_for_sm90(head_dim, torch.bfloat16, False, (kernel,), **_config(config))
            print(f"{kernel} d{head_dim} {config}: {usage[kernel]}", flush=True)


def _timed(label, fn, check):
    """Time fn after checking it against the Triton backward; a configuration that fails prints
    why and the sweep goes on."""
    from triton.testing import do_bench
    try:
        for name, mine, ref in check(fn()):
            err = (mine.float() - ref.float()).abs().max().item()
            print(f"  {label}: max |{name} - triton| {err:.3g} (|{name}| max {ref.abs().max().item():.3g})")
        ms = do_bench(fn, rep=200)
        print(f"  {label}: {ms * 1e3:.1f} us", flush=True)
        return ms
    except Exception as e:  # noqa: BLE001 - a report line per configuration
        print(f"  {label}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
        return float("inf")


def _cases(S: int, window: int):
    """name -> (Visibility, the ENABLED switch that sends it to the Gluon backward)."""
    import kernelforge as kf
    from kernelforge.bench.attention_suites import BLOCK_PATTERNS

    cases = {"window": (Visibility.of(True, (window, None)), "backward"),
             "causal": (Visibility.of(True, None), "backward"), "full": (Visibility.of(False, None), "backward"),
             "block-window": (Visibility.of(False, None, block_mask=kf.sliding_window_block_mask(
                 S, S, window, device="cuda")), "block_mask_backward")}
    for name, fn in BLOCK_PATTERNS.items():
        cases[f"block-{name}"] = (Visibility.of(False, None, block_mask=kf.BlockMask.from_mask_function(
            fn, S, S, device="cuda")), "block_mask_backward")
    return cases


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--s", type=int, default=8192)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--sweep", action="store_true", help="also time the tile configurations, not the library's only")
    ap.add_argument("--cases", default="window,causal,full,block-window,block-local_global,block-dilated",
                    help="which of window, causal, full, block-window, block-local_global, block-dilated to run")
    args = ap.parse_args()
    if args.compile_only:
        for d in (64, 128):
            compile_report(d)
        return
    from triton.testing import do_bench

    from kernelforge.triton import attention as tri

    S = args.s
    cases = _cases(S, args.window)
    for D in (128, 64):
        B, H = 16384 // S, 16
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        do = torch.randn_like(q)
        scale = D ** -0.5
        for name in args.cases.split(","):
            vis, switch = cases[name]
            out, lse = tri.flash_forward(q, k, v, scale, vis)
            delta = (out.float() * do.float()).sum(-1)
            glb.ENABLED[switch] = False  # the Triton backward as the yardstick
            ref_dq, ref_dk, ref_dv = tri.flash_backward(do, q, k, v, out, lse, scale, vis)
            t_tri = do_bench(lambda: tri.flash_backward(do, q, k, v, out, lse, scale, vis), rep=200)
            glb.ENABLED[switch] = True
            library = {}
            saved = glb.FUSE_DELTA
            for fuse in (False, True):
                glb.FUSE_DELTA = fuse
                label = f"backward, delta {'in the dQ launch' if fuse else 'from its own launch'}"
                library[label] = _timed(f"the library's {label}",
                                        lambda: tri.flash_backward(do, q, k, v, out, lse, scale, vis),
                                        lambda r: (("dq", r[0], ref_dq), ("dk", r[1], ref_dk), ("dv", r[2], ref_dv)))
            glb.FUSE_DELTA = saved
            print(f"d{D} {name}: triton backward (delta, dK/dV, dQ) {t_tri * 1e3:.1f} us; "
                  + "; ".join(f"{label} {t * 1e3:.1f} us" for label, t in library.items()), flush=True)
            # mask tiles of 64 take the library's tiles only
            sweep = args.sweep and vis.block_mask is None
            best_dkdv = min(_timed(f"dK/dV {c}", lambda c=c: dkdv(q, k, v, do, lse, delta, scale, vis, c),
                                   lambda r: (("dk", r[0], ref_dk), ("dv", r[1], ref_dv)))
                            for c in (DKDV_CONFIGS if sweep else DKDV_CONFIGS[:1]))
            best_dq = min(_timed(f"dQ {c}", lambda c=c: dq(q, k, v, do, lse, delta, scale, vis, c),
                                 lambda r: (("dq", r, ref_dq),)) for c in (DQ_CONFIGS if sweep else DQ_CONFIGS[:1]))
            print(f"d{D} {name}: best gluon dK/dV {best_dkdv * 1e3:.1f} + dQ {best_dq * 1e3:.1f} us against "
                  f"triton {t_tri * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    sys.exit(main())
