from __future__ import annotations

import torch

from kernelforge.ops.softmax import log_softmax, softmax


class Softmax(torch.nn.Module):
    """torch.nn.Softmax on kernelforge's op. dim defaults to -1 (torch.nn.Softmax's
    implicit-dim guessing is deprecated, so it is not copied)."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softmax(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LogSoftmax(Softmax):
    """torch.nn.LogSoftmax on kernelforge's op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return log_softmax(x, self.dim)
