"""Flash-decoding launch parameters against SDPA, at memory-bound cache sizes.

The split-key decode kernels (kernelforge/triton/attention_decode.py) read the KV cache once;
at B8 and long caches they reach ~4.0-4.1 TB/s where SDPA's default reaches ~4.5 (H200,
results/nvidia-h200/0.1.0/attention/4637225/). This varies the key tile, warps, stages, and how many
programs an SM gets (the split count), timing the op (L2 flushed, median of
triton.testing.do_bench) next to SDPA.

    PYTHONPATH=. python benchmarks/tuning/decode_sweep.py

--tiny: one small float32 cache on the CPU, one point of the grid, the Triton backend forced
(through TRITON_INTERPRET=1): checks the script runs.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import kernelforge as kf
from kernelforge.bench.timing import time_function
from kernelforge.triton import attention_decode as decode

SHAPES = [(8, 32, 8, 1, 65536, 128), (8, 32, 32, 1, 16384, 128), (1, 32, 8, 1, 16384, 128), (1, 32, 32, 4, 4096, 128)]
GRID = dict(BLOCK_N=(64, 128), NUM_WARPS=(4, 8), NUM_STAGES=(2, 3, 4), PROGRAMS_PER_SM=(1, 2, 4))
# the split path needs decode.MIN_KEYS keys or more
TINY_SHAPES = [(1, 4, 2, 1, 512, 16)]
TINY_GRID = dict(BLOCK_N=(64,), NUM_WARPS=(4,), NUM_STAGES=(2,), PROGRAMS_PER_SM=(2,))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small cache on the CPU: checks the script runs")
    args = parser.parse_args(argv)
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    grid = TINY_GRID if args.tiny else GRID

    def median_ms(fn) -> float:
        """do_bench's median on the GPU; under --tiny two timed calls on the CPU (a check only)."""
        return time_function(fn, "cpu", warmup=1, repeat=2).median_ms if args.tiny else do_bench(
            fn, return_mode="median")

    torch.manual_seed(0)
    defaults = {name: getattr(decode, name) for name in GRID}
    for B, H, Hkv, Sq, Sk, D in TINY_SHAPES if args.tiny else SHAPES:
        q = torch.randn(B, H, Sq, D, device=device, dtype=dtype)
        k = torch.randn(B, Hkv, Sk, D, device=device, dtype=dtype)
        v = torch.randn(B, Hkv, Sk, D, device=device, dtype=dtype)
        cache_gb = 2 * k.numel() * k.element_size() / 1e9
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        sdpa = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        print(f"== B{B} H{H}/{Hkv} Sq{Sq} Sk{Sk} D{D}: sdpa {sdpa * 1e3:.1f} us ({cache_gb / sdpa * 1e3:.0f} GB/s)",
              flush=True)
        results = []
        for values in itertools.product(*grid.values()):
            for name, value in zip(grid, values):
                setattr(decode, name, value)
            try:
                # on the CPU the default backend is the reference: the interpreter runs the Triton kernels
                with kf.use_backend("triton") if args.tiny else contextlib.nullcontext():
                    out = kf.flash_attention(q, k, v)
                    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
                    ms = median_ms(lambda: kf.flash_attention(q, k, v))
            except Exception as err:  # a config that does not compile or fit: reported
                print(f"   {dict(zip(grid, values))}: {type(err).__name__}: {str(err)[:120]}")
                continue
            results.append((ms, values))
        for name, value in defaults.items():
            setattr(decode, name, value)
        results.sort()
        for ms, values in results[:6] + [r for r in results if r[1] == tuple(defaults.values())]:
            tag = " (current)" if values == tuple(defaults.values()) else ""
            print(f"   {dict(zip(grid, values))}: {ms * 1e3:.1f} us ({cache_gb / ms * 1e3:.0f} GB/s), "
                  f"{sdpa / ms:.2f}x sdpa{tag}", flush=True)


if __name__ == "__main__":
    main()
