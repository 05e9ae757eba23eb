"""Where the per-call time of a small softmax goes (host side), layer by layer.

    PYTHONPATH=. python benchmarks/softmax_overhead.py

At 8x4096 the kernel takes a few microseconds, so a back-to-back loop measures the host
cost of each layer: allocation, Triton's launcher, the pybind extension, backend
selection, the dispatcher, autograd. Prints microseconds per call and a cProfile of the
forward+backward path.
"""
import cProfile
import pstats

import torch

import kernelforge as kf
from kernelforge import backends
from kernelforge.bench.timing import wall_us_per_call
from kernelforge.cuda.softmax import softmax_forward_rows as cuda_rows
from kernelforge.triton.softmax import softmax_forward_rows as triton_rows


def main():
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    g = torch.randn_like(x)

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(xg), xg, g)

    def forced(b, f=kf.softmax):
        def run(t):
            with kf.use_backend(b):
                return f(t, -1)
        return run

    rows = {
        "torch.empty_like": lambda: torch.empty_like(x),
        "torch.softmax (eager)": lambda: torch.softmax(x, -1),
        "triton launcher": lambda: triton_rows(x, False),
        "cuda launcher": lambda: cuda_rows(x, False),
        "backends.select": lambda: backends.select("softmax", x, dim=-1),
        "kf.softmax default (fast path)": lambda: kf.softmax(x, -1),
        "kf.softmax forced triton": lambda: forced("triton")(x),
        "kf.softmax forced cuda": lambda: forced("cuda")(x),
        "torch.ops.kernelforge.softmax": lambda: torch.ops.kernelforge.softmax(x, -1),
        "fwd+bwd torch eager": fwd_bwd(lambda t: torch.softmax(t, -1)),
        "fwd+bwd kf default": fwd_bwd(lambda t: kf.softmax(t, -1)),
        "fwd+bwd kf forced cuda": fwd_bwd(forced("cuda")),
    }
    for name, fn in rows.items():
        print(f"{name:<34} {wall_us_per_call(fn, calls=2000, warmup=50):8.1f} us/call", flush=True)

    prof = cProfile.Profile()
    step = fwd_bwd(lambda t: kf.softmax(t, -1))
    prof.enable()
    for _ in range(500):
        step()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
