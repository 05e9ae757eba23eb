"""Why two levels' bf16 loss curves part (tests/models/test_training.py): the GPU test's training
run at native and triton, each with its own loss and with the other level's loss swapped in, so the
loss kernel's part in the gap shows apart from the rest of the model's kernels.

    python benchmarks/training_curve_probe.py [--steps 300]
"""
from __future__ import annotations

import argparse

import torch

from kernelforge.models import levels
from kernelforge.models.training import TrainConfig, train_language_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    config = TrainConfig(steps=args.steps, batch=16, seq_len=64, dim=128, n_layers=2, n_heads=4)
    torch_loss, kf_loss = levels.TorchKernels.cross_entropy, levels.KernelforgeKernels.cross_entropy
    runs = {}
    for level in ("native", "triton"):
        for loss_name, loss in (("torch loss", torch_loss), ("kernelforge loss", kf_loss)):
            levels.TorchKernels.cross_entropy = levels.KernelforgeKernels.cross_entropy = loss
            try:
                runs[f"{level}, {loss_name}"] = torch.tensor(train_language_model(level, config, "cuda",
                                                                                  torch.bfloat16))
            finally:
                levels.TorchKernels.cross_entropy, levels.KernelforgeKernels.cross_entropy = torch_loss, kf_loss
    base = runs["native, torch loss"]
    print("| run | first loss | max gap, first 20 | mean of last 50 | gap of that mean |")
    print("|---|---|---|---|---|")
    for name, curve in runs.items():
        print(f"| {name} | {curve[0]:.4f} | {(curve[:20] - base[:20]).abs().max():.4f} | {curve[-50:].mean():.4f} "
              f"| {curve[-50:].mean() - base[-50:].mean():+.4f} |")
    seeds = []
    for seed in range(1, 4):  # the native level against itself on other weights: the spread of the test's gap
        cfg = TrainConfig(**{**config.__dict__, "seed": seed})
        a = torch.tensor(train_language_model("native", cfg, "cuda", torch.bfloat16))
        b = torch.tensor(train_language_model("triton", cfg, "cuda", torch.bfloat16))
        seeds.append(f"seed {seed}: last-50 gap triton - native {b[-50:].mean() - a[-50:].mean():+.4f}")
    print("\n".join(seeds))


if __name__ == "__main__":
    main()
