from __future__ import annotations

import torch

from kernelforge.ops.cross_entropy import REDUCTIONS, cross_entropy


class CrossEntropyLoss(torch.nn.Module):
    """torch.nn.CrossEntropyLoss with class-index targets on kernelforge's op (no class weights,
    no probability targets). The loss is float32 whatever the logits' dtype (see
    kernelforge.cross_entropy)."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"CrossEntropyLoss: reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"CrossEntropyLoss: label_smoothing must be in [0, 1], got {label_smoothing}")
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, target, ignore_index=self.ignore_index, reduction=self.reduction,
                             label_smoothing=self.label_smoothing)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}"
