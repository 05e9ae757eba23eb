"""Host time of one decode call through kf.flash_attention (B1, 32/8 heads, 1 query token, 4096
keys, fp16) on the CPU, with the Triton launches replaced by a no-op: what the op layer and the
launchers cost in Python before any kernel runs, without a GPU. Then a profile by own time.

    TRITON_INTERPRET=1 python3 benchmarks/decode_host_cpu.py
"""
from __future__ import annotations

import cProfile
import os
import pstats
import time

import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

import kernelforge as kf  # noqa: E402
from kernelforge.triton import attention, attention_decode  # noqa: E402


def main(calls: int = 2000):
    launched = []

    def no_launch(kernel, grid, *args, **kwargs):
        launched.append(kernel)

    for module in (attention, attention_decode):
        module.launch = no_launch
    q = torch.randn(1, 32, 1, 128, dtype=torch.float16)
    k, v = (torch.randn(1, 8, 4096, 128, dtype=torch.float16) for _ in range(2))
    with kf.use_backend("triton"):
        for _ in range(200):
            kf.flash_attention(q, k, v, causal=True)
        start = time.perf_counter()
        for _ in range(calls):
            kf.flash_attention(q, k, v, causal=True)
        per_call = (time.perf_counter() - start) / calls * 1e6
        print(f"host time a call, launches skipped: {per_call:.1f} us ({len(launched) / (calls + 200):.0f} launches "
              f"a call)")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            kf.flash_attention(q, k, v, causal=True)
        profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
