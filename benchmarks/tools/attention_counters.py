"""One warm forward + backward of the library's attention under Nsight Compute's profiler range,
for hardware counters of its kernels (tensor-pipe use, stall reasons, occupancy):

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section WarpStateStats --section Occupancy python3 benchmarks/tools/attention_counters.py

Default case: the harness's sliding window (2 x 16 x 8192, d128, bf16, causal window 512).
"""
from __future__ import annotations

import argparse

import torch

import kernelforge as kf


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2,16,8192,128", help="B,H,S,D")
    ap.add_argument("--window", type=int, default=512, help="left window of a causal band; 0: plain causal")
    args = ap.parse_args()
    B, H, S, D = (int(x) for x in args.shape.split(","))
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    window = (args.window, None) if args.window else None

    def step():
        out = kf.flash_attention(q, k, v, causal=True, window=window)
        torch.autograd.grad(out, (q, k, v), grad)

    step()  # compiles the kernels outside the profiled range
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
