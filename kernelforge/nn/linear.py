"""kernelforge.nn.Linear: torch.nn.Linear on the fused GEMM, with an optional activation
in the same kernel (act(x W^T + b)). Same constructor, parameters, initialization and
state_dict keys as torch.nn.Linear (it is a subclass), so checkpoints load either way."""
from __future__ import annotations

from typing import Optional

import torch

from kernelforge.ops.gemm import ACTIVATIONS, PRECISIONS, gemm


class Linear(torch.nn.Linear):
    """y = act(x W^T + b) in one kernel. activation: None, "gelu", "gelu_tanh", "silu" or
    "relu"; precision: as kernelforge.gemm ("auto" follows the input dtype). The weight is
    read transposed in place (no copy)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 activation: Optional[str] = None, precision: str = "auto"):
        if activation not in ACTIVATIONS:
            raise ValueError(f"kernelforge.nn.Linear: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"kernelforge.nn.Linear: precision must be one of {PRECISIONS}, got {precision!r}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = activation
        self.precision = precision

    @classmethod
    def from_torch(cls, linear: torch.nn.Linear, activation: Optional[str] = None,
                   precision: str = "auto") -> "Linear":
        """A Linear sharing `linear`'s parameters (no copy)."""
        module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                     activation=activation, precision=precision)
        module.weight = linear.weight
        module.bias = linear.bias
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0:
            raise ValueError(f"kernelforge.nn.Linear: input must have at least 1 dim (..., {self.in_features}), "
                             "got a 0-dim tensor")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"kernelforge.nn.Linear: input's last dim must be in_features={self.in_features}, "
                             f"got shape {tuple(x.shape)}")
        rows = x.unsqueeze(0) if x.dim() == 1 else x
        y = gemm(rows, self.weight.t(), bias=self.bias, activation=self.activation, precision=self.precision)
        return y.squeeze(0) if x.dim() == 1 else y

    def extra_repr(self) -> str:
        extra = f", activation={self.activation!r}" if self.activation else ""
        if self.precision != "auto":
            extra += f", precision={self.precision!r}"
        return super().extra_repr() + extra
