"""Every step of the bf16 training test (tests/models/test_training.py's GPU config) driven by torch's
loss, with kernelforge's loss computed from the same state beside it: its loss and the largest relative
difference of any parameter's gradient (and of kernelforge's against itself, run twice), every 25
steps. A wrong gradient shows as O(1); bf16 rounding as ~1e-3.

    python benchmarks/cross_entropy_step_probe.py
"""
import torch
import torch.nn.functional as F

import kernelforge as kf
from kernelforge.models import LanguageModel
from kernelforge.models.training import load_corpus


def main() -> None:
    torch.manual_seed(0)
    data = load_corpus()
    model = LanguageModel(vocab_size=256, dim=128, n_layers=2, n_heads=4, max_seq_len=64).cuda().bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    windows = torch.arange(65)
    params = list(model.parameters())
    for step in range(300):
        starts = torch.randint(0, len(data) - 65, (16, 1), generator=gen)
        tokens = data[starts + windows].cuda()
        grads = {}
        for name in ("torch", "kf", "kf-second"):
            model.zero_grad(set_to_none=True)
            logits = model(tokens[:, :-1]).flatten(0, 1)
            t = tokens[:, 1:].flatten()
            loss = F.cross_entropy(logits.float(), t) if name == "torch" else kf.cross_entropy(logits, t)
            loss.backward()
            grads[name] = (loss.item(), [p.grad.float().clone() for p in params])
        if step % 25 == 0 or step == 299:
            lt, gt = grads["torch"]; lk, gk = grads["kf"]
            rel = max(((a - b).norm() / a.norm()).item() for a, b in zip(gt, gk))
            lk2, gk2 = grads["kf-second"]
            rel2 = max(((a - b).norm() / a.norm()).item() for a, b in zip(gk, gk2))
            print(f"step {step}: loss torch {lt:.4f} kf {lk:.4f}; max relative grad diff torch-kf {rel:.2e}, "
                  f"kf-kf {rel2:.2e}")
        for p, g in zip(params, grads["torch"][1]):
            p.grad = g.to(p.dtype)
        opt.step()


if __name__ == "__main__":
    main()
