"""kernelforge.cross_entropy's logits gradient against torch's float32 recipe on the GPU, element by
element (bf16 logits: how many elements differ and by how many ulps), at the training test's shape
and the demo's, and the LM's parameter gradients with either loss from the same weights.

    python benchmarks/cross_entropy_grad_probe.py
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernelforge as kf
from kernelforge.models import LanguageModel


def logits_gradients(rows: int, classes: int) -> None:
    logits = (torch.randn(rows, classes, device="cuda") * 2).bfloat16()
    target = torch.randint(0, classes, (rows,), device="cuda")
    grads = {}
    for name, loss_fn in (("torch", lambda x: F.cross_entropy(x.float(), target)),
                          ("kernelforge", lambda x: kf.cross_entropy(x, target))):
        x = logits.clone().requires_grad_()
        loss = loss_fn(x)
        loss.backward()
        grads[name] = (loss.item(), x.grad)
    (lt, gt), (lk, gk) = grads["torch"], grads["kernelforge"]
    diff = (gt.float() - gk.float()).abs()
    ulp = gt.float().abs().clamp(min=1e-30) * 2 ** -7
    print(f"{rows}x{classes}: loss {lt:.6f} vs {lk:.6f}; gradient elements differing {(diff > 0).sum().item()} of "
          f"{diff.numel()}, max {(diff / ulp).max().item():.2f} ulp; sums of the gradient {gt.float().sum():.3e} vs "
          f"{gk.float().sum():.3e}; target column mean {gt.float().gather(1, target[:, None]).mean():.4e} vs "
          f"{gk.float().gather(1, target[:, None]).mean():.4e}")


def model_gradients() -> None:
    torch.manual_seed(0)
    model = LanguageModel(vocab_size=256, dim=128, n_layers=2, n_heads=4, max_seq_len=64).cuda().bfloat16()
    ids = torch.randint(0, 256, (16, 65), device="cuda")
    grads = {}
    for name, loss_fn in (("torch", lambda lg, t: F.cross_entropy(lg.float(), t)),
                          ("kernelforge", lambda lg, t: kf.cross_entropy(lg, t))):
        model.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1])
        loss_fn(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        grads[name] = [p.grad.float().clone() for p in model.parameters()]
    for (pname, _), a, b in zip(model.named_parameters(), grads["torch"], grads["kernelforge"]):
        print(f"  {pname}: relative difference {((a - b).norm() / a.norm()).item():.2e}")


if __name__ == "__main__":
    for shape in ((1008, 256), (16384, 32000), (199, 1000)):
        logits_gradients(*shape)
    model_gradients()
