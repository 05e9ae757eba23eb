import time, torch, collections
import kernelforge as kf
from kernelforge.ops import gemm as G
from kernelforge.triton import gemm as TG
acc = collections.defaultdict(float); cnt = collections.Counter()
def wrap(mod, name):
    f = getattr(mod, name)
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[name] += time.perf_counter() - t; cnt[name] += 1; return r
    setattr(mod, name, w)
for m, n in ((G, "_matmul"), (G, "_gemm_backward"), (TG, "_launch"), (TG, "_tma_operands"), (TG, "_take_tma"), (TG, "sm_count")):
    wrap(m, n)
a = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
step = lambda: torch.autograd.grad(kf.gemm(a, w.t()), (a, w), g)
for mt in (True, False, True):
    with torch.autograd.set_multithreading_enabled(mt):
        for _ in range(20): step()
        torch.cuda.synchronize(); acc.clear(); cnt.clear(); t = time.perf_counter()
        for _ in range(200): step()
        torch.cuda.synchronize(); total = (time.perf_counter() - t) / 200 * 1e6
        print(f"multithreading={mt}: {total:.0f} us a step; " + ", ".join(f"{k} {acc[k] / 200 * 1e6:.0f} us ({cnt[k] // 200}/step)" for k in acc), flush=True)
