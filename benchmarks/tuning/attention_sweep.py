"""Tile sweep of the Triton flash-attention kernels on one GPU, next to SDPA's FlashAttention-2
and cuDNN backends, at the attention target shapes (B*S = 16384 tokens, 16 heads).

    python3 benchmarks/tuning/attention_sweep.py --out DIR [--dims 128 64] [--quick]

Times with triton.testing.do_bench (CUDA events, median), forward and backward apart
(backward = the three backward kernels through flash_backward, from saved out / lse).
TFLOP/s count 4*B*H*S*S*D forward and 10*B*H*S*S*D backward (2.5x), halved when causal,
and only the window's S*(window+1) pairs for the sliding-window row.
Writes attention_sweep.json and prints one table per head dim: the best configuration per
shape is what kernelforge/triton/attention.py should carry.

--tiny: two small float32 shapes (causal, and a causal window) on the CPU, one tile a direction
(Triton through TRITON_INTERPRET=1): checks the script runs; writes only where --out says.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from kernelforge.bench.timing import time_function
from kernelforge.reference.attention import Visibility
from kernelforge.triton import attention as tri

# (B, S, causal, window left): the last is the causal sliding window of 512 of the targets
SHAPES = [(16, 1024, False, None), (4, 4096, False, None), (4, 4096, True, None), (2, 8192, False, None),
          (2, 8192, True, None), (2, 8192, True, 512)]
FORWARD = [tri.TileConfig(m, n, w, s) for (m, n, w, s) in
           [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2),
            (64, 64, 4, 3), (128, 32, 4, 4), (64, 128, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3)]]
BACKWARD = [tri.TileConfig(m, n, w, s) for (m, n, w, s) in
            [(64, 128, 8, 2), (64, 64, 4, 2), (64, 128, 8, 3), (128, 128, 8, 2), (32, 128, 4, 2),
             (64, 64, 4, 3), (128, 64, 8, 2)]]
TINY_SHAPES, TINY_DIM, TINY_TILES = [(1, 64, True, None), (1, 64, True, 16)], 16, 1


def sdpa(backend, q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, backend)):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def tflops(flops, ms):
    return flops / ms / 1e9


def median_ms(fn, tiny: bool) -> float:
    """do_bench's time on the GPU; under --tiny two timed calls on the CPU (a check, not a measurement)."""
    return time_function(fn, "cpu", warmup=1, repeat=2).median_ms if tiny else do_bench(fn)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="directory for attention_sweep.json (default: here; with --tiny: none)")
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU: checks the script runs")
    args = ap.parse_args()
    dev, dtype, H = ("cpu", torch.float32, 2) if args.tiny else ("cuda", torch.bfloat16, 16)
    shapes = TINY_SHAPES if args.tiny else SHAPES[:3] if args.quick else SHAPES
    forward_tiles, backward_tiles = (FORWARD[:TINY_TILES], BACKWARD[:TINY_TILES]) if args.tiny else (FORWARD, BACKWARD)
    rows = []
    for D in [TINY_DIM] if args.tiny else args.dims:
        for B, S, causal, window in shapes:
            q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=dtype) for _ in range(3))
            vis = Visibility.of(causal, None if window is None else (window, 0))
            scale = D ** -0.5
            flops = 4 * B * H * S * (S * (0.5 if causal else 1.0) if window is None else window + 1) * D
            row = dict(D=D, B=B, S=S, causal=causal, window=window)
            for name in (("FLASH_ATTENTION", "CUDNN_ATTENTION") if window is None else ()):
                try:
                    ms = median_ms(lambda: sdpa(name, q, k, v, causal), args.tiny)
                    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                    out = sdpa(name, qg, kg, vg, causal)
                    g = torch.randn_like(out)
                    ms_b = median_ms(lambda: torch.autograd.grad(out, (qg, kg, vg), g, retain_graph=True), args.tiny)
                    row[name] = (round(tflops(flops, ms), 1), round(tflops(2.5 * flops, ms_b), 1))
                except Exception as err:  # a backend that does not take the shape
                    row[name] = str(err)[:80]
            fwd = {}
            for cfg in forward_tiles:
                tri.FORWARD_TILES[triton.next_power_of_2(D)] = tri.WINDOW_FORWARD_TILE = cfg
                try:
                    ms = median_ms(lambda: tri.flash_forward(q, k, v, scale, vis), args.tiny)
                    fwd[str(cfg)] = round(tflops(flops, ms), 1)
                except Exception as err:
                    fwd[str(cfg)] = str(err)[:80]
            row["fwd"] = fwd
            best_fwd = max((c for c in forward_tiles if isinstance(fwd[str(c)], float)), key=lambda c: fwd[str(c)])
            tri.FORWARD_TILES[triton.next_power_of_2(D)] = tri.WINDOW_FORWARD_TILE = best_fwd
            out, lse = tri.flash_forward(q, k, v, scale, vis)
            if window is None:
                ref = sdpa("FLASH_ATTENTION", q, k, v, causal)
                row["fwd_max_err_vs_flash"] = (out.float() - ref.float()).abs().max().item()
            g = torch.randn_like(out)
            bwd = {}
            for cfg in backward_tiles:
                tri.BACKWARD_TILES[triton.next_power_of_2(D)] = cfg
                try:
                    ms = median_ms(lambda: tri.flash_backward(g, q, k, v, out, lse, scale, vis), args.tiny)
                    bwd[str(cfg)] = round(tflops(2.5 * flops, ms), 1)
                except Exception as err:
                    bwd[str(cfg)] = str(err)[:80]
            row["bwd"] = bwd
            rows.append(row)
            best_b = max((v for v in bwd.values() if isinstance(v, float)), default=None)
            print(f"D{D} B{B} S{S} causal={causal} window={window}: flash {row.get('FLASH_ATTENTION')} "
                  f"cudnn {row.get('CUDNN_ATTENTION')} | ours fwd best {fwd[str(best_fwd)]} ({best_fwd}) "
                  f"bwd best {best_b} | err {row.get('fwd_max_err_vs_flash', float('nan')):.3g}", flush=True)
            for name, table in (("fwd", fwd), ("bwd", bwd)):
                print(f"   {name}: " + "; ".join(f"{c.replace('TileConfig', '')}={t}" for c, t in table.items()))
    out_dir = args.out or (None if args.tiny else ".")
    if out_dir is None:
        return
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=os.environ.get("KERNELFORGE_COMMIT", "?"))
    (Path(out_dir) / "attention_sweep.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    sys.exit(main())
