"""Host cost per kf.gemm call on a GPU: calls queued back to back (no synchronization inside
the loop), so the wall time per call is the host's whenever it exceeds the GPU's; then where
that time goes (cProfile, by own time).

    PYTHONPATH=. python benchmarks/tools/gemm_overhead.py   (a CUDA GPU)

--tiny: small float32 products on the CPU (kernelforge's default backend there), a few calls each:
checks the script runs.
"""
import argparse
import cProfile
import pstats

import torch

import kernelforge as kf
from kernelforge.bench.timing import wall_us_per_call


SHAPES = ((16, 4096, 4096), (128, 4096, 4096), (1024, 1024, 1024))
PROFILED_SHAPE = (16, 4096, 4096)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small products on the CPU: checks the script runs")
    args = parser.parse_args(argv)
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    shapes, (pm, pn, pk) = (((4, 64, 64),), (4, 64, 64)) if args.tiny else (SHAPES, PROFILED_SHAPE)
    timed_calls, profiled_calls = (5, 5) if args.tiny else (300, 100)

    def per_call_us(fn):
        return wall_us_per_call(fn, calls=timed_calls, warmup=2 if args.tiny else 20, device=device)

    torch.manual_seed(0)
    for M, N, K in shapes:
        a = torch.randn(M, K, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(N, K, device=device, dtype=dtype, requires_grad=True)
        bias = torch.randn(N, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(M, N, device=device, dtype=dtype)
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
    a16 = torch.randn(pm, pk, device=device, dtype=dtype, requires_grad=True)
    w16 = torch.randn(pn, pk, device=device, dtype=dtype, requires_grad=True)
    g16 = torch.randn(pm, pn, device=device, dtype=dtype)
    profiled = {"fwd": lambda: kf.gemm(a16.detach(), w16.detach().t()),
                "fwd+bwd": lambda: torch.autograd.grad(kf.gemm(a16, w16.t()), (a16, w16), g16)}
    # The backward on this thread (autograd runs a CUDA backward on its own device thread,
    # which cProfile does not see).
    with torch.autograd.set_multithreading_enabled(False):
        for name, fn in profiled.items():
            print(f"{pm}x{pn}x{pk} {name}, backward on the calling thread: {per_call_us(fn):.1f} us a call",
                  flush=True)
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(profiled_calls):
                fn()
            profile.disable()
            if device == "cuda":
                torch.cuda.synchronize()
            print(f"== profile of {name} ({profiled_calls} calls), by own time")
            pstats.Stats(profile).sort_stats("tottime").print_stats(20)
            print(f"== profile of {name} ({profiled_calls} calls), by cumulative time")
            pstats.Stats(profile).sort_stats("cumtime").print_stats(30)


if __name__ == "__main__":
    main()
