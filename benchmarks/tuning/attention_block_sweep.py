"""Backward tiles for block-sparse attention: the causal sliding-window-512 BlockMask at S=8192,
d128, bf16 on one GPU, next to the dense window path (window=(512, 0)).

    python3 benchmarks/tuning/attention_block_sweep.py [--stages]

Times tri.flash_backward with triton.testing.do_bench (median ms) for each candidate tile.
--stages instead times the block-sparse backward's pipeline depth (BLOCK_SPARSE_BACKWARD_STAGES)
on 64 x 64 and 128 x 128 mask tiles, with the library's tiles.
--tiny: S=128, d16, a window of 32, float32 on the CPU, one tile (Triton through
TRITON_INTERPRET=1): checks the script runs.
"""
import argparse

import torch
from triton.testing import do_bench

import kernelforge as kf
from kernelforge.bench.timing import time_function
from kernelforge.reference.attention import Visibility
from kernelforge.triton import attention as tri

TILES = [tri.TileConfig(*c) for c in [(64, 64, 4, 2), (64, 64, 4, 1), (64, 64, 4, 3), (32, 64, 4, 2),
                                      (64, 128, 8, 2), (128, 128, 8, 2), (64, 32, 4, 2)]]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", action="store_true", help="time the block-sparse backward's pipeline depth")
    parser.add_argument("--tiny", action="store_true", help="small sizes on the CPU: checks the script runs")
    args = parser.parse_args(argv)
    B, H, S, D, W = (1, 1, 128, 16, 32) if args.tiny else (2, 16, 8192, 128, 512)
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)

    def median_ms(fn) -> float:
        """do_bench's median on the GPU; under --tiny two timed calls on the CPU (a check only)."""
        return time_function(fn, "cpu", warmup=1, repeat=2).median_ms if args.tiny else do_bench(fn)

    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype) for _ in range(3))
    if args.stages:
        for tile in (64,) if args.tiny else (64, 128):
            mask = kf.sliding_window_block_mask(S, S, W, block_q=tile, block_k=tile, device=device)
            vis = Visibility(None, None, None, mask)
            out, lse = tri.flash_forward(q, k, v, D ** -0.5, vis)
            g = torch.randn_like(out)
            for stages in (1, 2, 3):
                tri.BLOCK_SPARSE_BACKWARD_STAGES = {"whole": stages, "cut": stages}
                ms = median_ms(lambda: tri.flash_backward(g, q, k, v, out, lse, D ** -0.5, vis))
                print(f"block mask {tile}x{tile}, {stages} stages: backward {ms:.4f} ms", flush=True)
        return
    mask = kf.sliding_window_block_mask(S, S, W, device=device)
    cases = {"dense window": Visibility.of(True, (W, 0)), "block mask": Visibility(None, None, None, mask)}
    for name, vis in cases.items():
        out, lse = tri.flash_forward(q, k, v, D ** -0.5, vis)
        g = torch.randn_like(out)
        for cfg in TILES[:1] if args.tiny else TILES:
            tri.BACKWARD_TILES[D] = cfg
            ms = median_ms(lambda: tri.flash_backward(g, q, k, v, out, lse, D ** -0.5, vis))
            print(f"{name:13s} {cfg}: backward {ms:.4f} ms", flush=True)


if __name__ == "__main__":
    main()
