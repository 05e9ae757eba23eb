from __future__ import annotations

from typing import Optional

import torch

from kernelforge.ops.cross_entropy import REDUCTIONS, cross_entropy
from kernelforge.ops.linear_cross_entropy import fused_linear_cross_entropy


def _check_options(module: str, reduction: str, label_smoothing: float) -> None:
    """A loss module's options checked when it is built, not at its first call."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{module}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{module}: label_smoothing must be in [0, 1], got {label_smoothing}")


class CrossEntropyLoss(torch.nn.Module):
    """torch.nn.CrossEntropyLoss with class-index targets on kernelforge's op (no class weights,
    no probability targets). The loss is float32 whatever the logits' dtype (see
    kernelforge.cross_entropy)."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0):
        super().__init__()
        _check_options("CrossEntropyLoss", reduction, label_smoothing)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, target, ignore_index=self.ignore_index, reduction=self.reduction,
                             label_smoothing=self.label_smoothing)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}"


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    """A language model's head and loss in one module call without the logits
    (kernelforge.fused_linear_cross_entropy): forward(x, weight, target, bias=None) with the head's
    weight passed in (a Linear's, or tied embeddings'), as Liger-Kernel's loss module takes it."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 softcap: Optional[float] = None, z_loss: float = 0.0):
        super().__init__()
        _check_options("FusedLinearCrossEntropyLoss", reduction, label_smoothing)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.softcap, self.z_loss = softcap, z_loss

    def forward(self, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return fused_linear_cross_entropy(x, weight, target, bias, ignore_index=self.ignore_index,
                                          reduction=self.reduction, label_smoothing=self.label_smoothing,
                                          softcap=self.softcap, z_loss=self.z_loss)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, softcap={self.softcap}, z_loss={self.z_loss}")
