"""Why two levels' bf16 loss curves part (tests/models/test_training.py): the GPU test's training
run at native and triton, each with its own loss and with the other level's loss swapped in, on
several seeds, so the loss kernel's part in a gap shows apart from the rest of the model's kernels
and from the spread between seeds. Prints the mean loss of the last 50 steps per run, and seed 0's
curves every 25 steps.

    python benchmarks/training_curve_probe.py [--steps 300] [--seeds 0,1,2,3] [--lr 3e-3]
"""
from __future__ import annotations

import argparse

import torch

from kernelforge.models import levels
from kernelforge.models.training import TrainConfig, train_language_model

RUNS = (("native", "torch"), ("native", "kernelforge"), ("triton", "torch"), ("triton", "kernelforge"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0,1,2,3")
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    args = parser.parse_args()
    losses = {"torch": levels.TorchKernels.cross_entropy, "kernelforge": levels.KernelforgeKernels.cross_entropy}
    print("| seed | " + " | ".join(f"{lv}, {ls} loss" for lv, ls in RUNS) + " |\n|---|" + "---|" * len(RUNS))
    for seed in map(int, args.seeds.split(",")):
        config = TrainConfig(steps=args.steps, batch=16, seq_len=64, dim=128, n_layers=2, n_heads=4, lr=args.lr,
                             seed=seed)
        curves = {}
        for level, loss_name in RUNS:
            levels.TorchKernels.cross_entropy = levels.KernelforgeKernels.cross_entropy = losses[loss_name]
            try:
                curves[level, loss_name] = torch.tensor(train_language_model(level, config, "cuda", torch.bfloat16))
            finally:
                levels.TorchKernels.cross_entropy, levels.KernelforgeKernels.cross_entropy = losses.values()
        print(f"| {seed} | " + " | ".join(f"{c[-50:].mean():.4f}" for c in curves.values()) + " |", flush=True)
        if seed == 0:
            steps = list(range(0, args.steps, 25)) + [args.steps - 1]
            seed0 = {key: [round(c[s].item(), 3) for s in steps] for key, c in curves.items()}
    print(f"\nseed 0, loss at steps {steps}:")
    for key, values in seed0.items():
        print(f"  {key}: {values}")


if __name__ == "__main__":
    main()
