"""Host cost per kf.gemm call on a GPU: calls queued back to back (no synchronization inside
the loop), so the wall time per call is the host's whenever it exceeds the GPU's; then where
that time goes (cProfile, by own time).

    PYTHONPATH=. python benchmarks/gemm_overhead.py   (a CUDA GPU)
"""
import cProfile
import pstats

import torch

import kernelforge as kf
from kernelforge.bench.timing import wall_us_per_call


def per_call_us(fn, calls=300):
    return wall_us_per_call(fn, calls=calls, warmup=20)


def main():
    torch.manual_seed(0)
    for M, N, K in ((16, 4096, 4096), (128, 4096, 4096), (1024, 1024, 1024)):
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        calls = {
            "fwd kf.gemm": lambda: kf.gemm(a.detach(), w.detach().t()),
            "fwd torch.matmul": lambda: torch.matmul(a.detach(), w.detach().t()),
            "fwd kf.gemm bias+gelu_tanh": lambda: kf.gemm(a.detach(), w.detach().t(), bias=bias.detach(),
                                                          activation="gelu_tanh"),
            "fwd+bwd kf.gemm": lambda: torch.autograd.grad(kf.gemm(a, w.t()), (a, w), g),
            "fwd+bwd torch.matmul": lambda: torch.autograd.grad(torch.matmul(a, w.t()), (a, w), g),
        }
        for name, fn in calls.items():
            print(f"{M}x{N}x{K} {name}: {per_call_us(fn):.1f} us a call, back to back", flush=True)
    a16 = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w16 = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g16 = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    profiled = {"fwd": lambda: kf.gemm(a16.detach(), w16.detach().t()),
                "fwd+bwd": lambda: torch.autograd.grad(kf.gemm(a16, w16.t()), (a16, w16), g16)}
    # The backward on this thread (autograd runs a CUDA backward on its own device thread,
    # which cProfile does not see).
    with torch.autograd.set_multithreading_enabled(False):
        for name, fn in profiled.items():
            print(f"16x4096x4096 {name}, backward on the calling thread: {per_call_us(fn):.1f} us a call", flush=True)
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(100):
                fn()
            profile.disable()
            torch.cuda.synchronize()
            print(f"== profile of {name} (100 calls), by own time")
            pstats.Stats(profile).sort_stats("tottime").print_stats(20)
            print(f"== profile of {name} (100 calls), by cumulative time")
            pstats.Stats(profile).sort_stats("cumtime").print_stats(30)

if __name__ == "__main__":
    main()
