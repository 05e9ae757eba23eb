"""fused linear cross-entropy at Llama-3.2-1B's head (8192 tokens x hidden 2048 x 128256 classes, bf16):
kernelforge against Liger-Kernel, PyTorch (float32 logits) and torch.compile; device time
(triton.testing.do_bench) forward without grad and forward+backward, the peak memory above the
inputs, and a kernel table of kernelforge's forward+backward.

    PYTHONPATH=. python benchmarks/linear_cross_entropy_head.py     (a GPU; Liger-Kernel if importable)
"""
import torch, triton
import kernelforge as kf
from torch.profiler import profile, ProfilerActivity
dev, dt = "cuda", torch.bfloat16
R, H, V = 8192, 2048, 128256
torch.manual_seed(0)
x = torch.randn(R, H, device=dev, dtype=dt)
W = torch.randn(V, H, device=dev, dtype=dt) * 0.02
target = torch.randint(0, V, (R,), device=dev)
xg = x.clone().requires_grad_(); Wg = W.clone().requires_grad_()
t = lambda fn: triton.testing.do_bench(fn, warmup=5, rep=60)
from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as lf  # noqa: E402
comp = torch.compile(lambda a, b, tg: torch.nn.functional.cross_entropy((a @ b.t()).float(), tg))
variants = {
  "kf": lambda: kf.fused_linear_cross_entropy(xg, Wg, target),
  "liger": lambda: lf(xg, Wg, target),
  "torch (float logits)": lambda: torch.nn.functional.cross_entropy((xg @ Wg.t()).float(), target),
  "torch.compile": lambda: comp(xg, Wg, target),
}
for name, fn in variants.items():
    with torch.no_grad():
        fwd = t(fn)
    fb = t(lambda: fn().backward())
    Wg.grad = None; xg.grad = None
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    fn().backward(); torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    Wg.grad = None; xg.grad = None
    print(f"{name:22s} fwd (no grad) {fwd:7.2f} ms   fwd+bwd {fb:7.2f} ms   peak above inputs {peak:7.0f} MiB", flush=True)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        kf.fused_linear_cross_entropy(xg, Wg, target).backward()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
