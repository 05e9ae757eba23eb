"""Backward tiles for block-sparse attention: the causal sliding-window-512 BlockMask at S=8192,
d128, bf16 on one GPU, next to the dense window path (window=(512, 0)).

    python3 benchmarks/attention_block_sweep.py [--stages]

Times tri.flash_backward with triton.testing.do_bench (median ms) for each candidate tile.
--stages instead times the block-sparse backward's pipeline depth (BLOCK_SPARSE_BACKWARD_STAGES)
on 64 x 64 and 128 x 128 mask tiles, with the library's tiles.
"""
import sys

import torch
from triton.testing import do_bench

import kernelforge as kf
from kernelforge.reference.attention import Visibility
from kernelforge.triton import attention as tri

B, H, S, D, W = 2, 16, 8192, 128, 512
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
bm = kf.sliding_window_block_mask(S, S, W, device="cuda")
if "--stages" in sys.argv:
    for tile in (64, 128):
        vis = Visibility(None, None, None, kf.sliding_window_block_mask(S, S, W, block_q=tile, block_k=tile,
                                                                        device="cuda"))
        out, lse = tri.flash_forward(q, k, v, D ** -0.5, vis)
        g = torch.randn_like(out)
        for stages in (1, 2, 3):
            tri.BLOCK_SPARSE_BACKWARD_STAGES = {"whole": stages, "cut": stages}
            ms = do_bench(lambda: tri.flash_backward(g, q, k, v, out, lse, D ** -0.5, vis))
            print(f"block mask {tile}x{tile}, {stages} stages: backward {ms:.4f} ms", flush=True)
    sys.exit(0)
cases = {"dense window": Visibility.of(True, (W, 0)), "block mask": Visibility(None, None, None, bm)}
for name, vis in cases.items():
    out, lse = tri.flash_forward(q, k, v, D ** -0.5, vis)
    g = torch.randn_like(out)
    for cfg in [tri.TileConfig(*c) for c in [(64, 64, 4, 2), (64, 64, 4, 1), (64, 64, 4, 3), (32, 64, 4, 2),
                                             (64, 128, 8, 2), (128, 128, 8, 2), (64, 32, 4, 2)]]:
        tri.BACKWARD_TILES[128] = cfg
        ms = do_bench(lambda: tri.flash_backward(g, q, k, v, out, lse, D ** -0.5, vis))
        print(f"{name:13s} {cfg}: backward {ms:.4f} ms", flush=True)
