"""fused linear cross-entropy at Llama-3.2-1B's head (8192 tokens x hidden 2048 x 128256 classes, bf16):
kernelforge against Liger-Kernel, PyTorch (float32 logits) and torch.compile; device time
(triton.testing.do_bench) forward without grad and forward+backward, the peak memory above the
inputs, each one's error against a float64 head (loss, grad_x, grad_W: the largest error over the
largest magnitude, and the root-mean-square error over the root-mean-square value), and a kernel
table of kernelforge's forward+backward.

kernelforge's variants: its default (a mean loss: the gradients computed in the forward, row
chunks of default_chunk_rows), the same with larger chunks, and the recomputing backward (the
rows' losses, reduction "none", summed and divided here: what a per-row loss runs).

    PYTHONPATH=. python benchmarks/tools/linear_cross_entropy_head.py     (a GPU; Liger-Kernel if importable)

--tiny: a 16 x 32 x 100 float32 head on the CPU, without torch.compile (an Inductor build takes
minutes there) and without a peak-memory column: checks the script runs.
"""
import argparse

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import kernelforge as kf
from kernelforge.bench.timing import time_function


def errors(got, want):
    """(largest error / largest magnitude, rms error / rms value) of got against want (float64)."""
    diff = got.double() - want
    return (diff.abs().max() / want.abs().max()).item(), (diff.norm() / want.norm()).item()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small head on the CPU: checks the script runs")
    args = parser.parse_args(argv)
    on_gpu = not args.tiny
    dev, dt = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    R, H, V = (8192, 2048, 128256) if on_gpu else (16, 32, 100)
    torch.manual_seed(0)
    x = torch.randn(R, H, device=dev, dtype=dt)
    W = torch.randn(V, H, device=dev, dtype=dt) * 0.02
    target = torch.randint(0, V, (R,), device=dev)
    xg, Wg = x.clone().requires_grad_(), W.clone().requires_grad_()

    def bench(fn):
        if not on_gpu:
            return time_function(fn, "cpu", warmup=1, repeat=2).median_ms
        return triton.testing.do_bench(fn, warmup=5, rep=60)

    def float64_head():
        xe, We = x.double().requires_grad_(), W.double().requires_grad_()
        loss = torch.nn.functional.cross_entropy(xe @ We.t(), target)
        loss.backward()
        return loss.detach(), xe.grad, We.grad

    variants = {
        "kf": lambda: kf.fused_linear_cross_entropy(xg, Wg, target),
        "kf chunk 2048": lambda: kf.fused_linear_cross_entropy(xg, Wg, target, chunk_rows=2048),
        "kf recompute": lambda: kf.fused_linear_cross_entropy(xg, Wg, target, reduction="none").sum() / R,
        "torch (float logits)": lambda: torch.nn.functional.cross_entropy((xg @ Wg.t()).float(), target),
    }
    if on_gpu:
        compiled = torch.compile(lambda a, b, tg: torch.nn.functional.cross_entropy((a @ b.t()).float(), tg))
        variants["torch.compile"] = lambda: compiled(xg, Wg, target)
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        variants["liger"] = lambda: liger_fused_linear_cross_entropy(xg, Wg, target)
    except ImportError:
        print("Liger-Kernel is not importable: its row is left out")

    exact = float64_head()
    if on_gpu:
        torch.cuda.empty_cache()
    print(f"{'':22s} {'fwd (no grad)':>14s} {'fwd+bwd':>10s} {'peak above inputs':>18s}   error / largest, rms: "
          f"{'loss':>9s} {'grad_x':>19s} {'grad_W':>19s}")
    for name, fn in variants.items():
        with torch.no_grad():
            forward = bench(fn)
        both = bench(lambda: fn().backward())
        xg.grad = Wg.grad = None
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        loss = fn()
        loss.backward()
        peak = float("nan")  # the CPU keeps no peak statistics
        if on_gpu:
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        loss_error = abs(loss.item() - exact[0].item()) / exact[0].item()
        gx, gw = errors(xg.grad, exact[1]), errors(Wg.grad, exact[2])
        xg.grad = Wg.grad = None
        print(f"{name:22s} {forward:11.2f} ms {both:7.2f} ms {peak:14.0f} MiB   {loss_error:26.1e} "
              f"{gx[0]:9.1e} {gx[1]:9.1e} {gw[0]:9.1e} {gw[1]:9.1e}", flush=True)
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            kf.fused_linear_cross_entropy(xg, Wg, target).backward()
        if on_gpu:
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total" if on_gpu else "self_cpu_time_total",
                                    row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
