"""Probe: the attention's q / k / v projections forward + backward, device time a layer: one GEMM over the
concatenated weights (the old _ConcatenatedLinear, split views, v copied), three Linear's (eager), _Projections."""
import torch, triton
import torch.nn.functional as F
from kernelforge.transformers.decoders import _Projections

class Concatenated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *weights):
        ctx.save_for_backward(x, *weights)
        return F.linear(x, torch.cat(weights))
    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        grad_x = grad @ torch.cat(weights)
        rows = grad.reshape(-1, grad.shape[-1])
        return (grad_x, *(rows.t() @ x.reshape(-1, x.shape[-1])).split([w.shape[0] for w in weights]))

def old(x, ws):
    q, k, v = Concatenated.apply(x, *ws).split([w.shape[0] for w in ws], -1)
    return q, k, v.contiguous()
def eager(x, ws): return tuple(F.linear(x, w) for w in ws)
def new(x, ws): return _Projections.apply(x, 3, *ws)

for name, (hidden, q, kv) in {"llama-1b": (2048, 2048, 512), "qwen3-1.7b": (2048, 2048, 1024), "llama-8b": (4096, 4096, 1024)}.items():
    x = torch.randn(4, 2048, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ws = [torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True) * 0.02 for n in (q, kv, kv)]
    ws = [w.detach().requires_grad_() for w in ws]
    grads = [torch.randn(4, 2048, n, device="cuda", dtype=torch.bfloat16) for n in (q, kv, kv)]
    res = {}
    for label, fn in (("one GEMM (old)", old), ("three Linear (eager)", eager), ("_Projections", new)):
        def step():
            outs = fn(x, ws)
            torch.autograd.backward(outs, grads)
        fwd = triton.testing.do_bench(lambda: fn(x, ws), warmup=20, rep=200)
        both = triton.testing.do_bench(step, warmup=20, rep=200, grad_to_none=[x, *ws])
        res[label] = both
        print(f"{name:10} {label:22} fwd {fwd*1e3:7.1f} us  fwd+bwd {both*1e3:7.1f} us", flush=True)
    print(f"{name:10} _Projections fwd+bwd: {res['one GEMM (old)']/res['_Projections']:.3f}x old, {res['three Linear (eager)']/res['_Projections']:.3f}x eager", flush=True)
