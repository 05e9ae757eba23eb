"""LayerNorm and RMSNorm modules with torch.nn's parameters and state_dict keys (weight,
bias), so they load checkpoints written with torch.nn.LayerNorm / torch.nn.RMSNorm."""
from __future__ import annotations

import numbers
from typing import Optional, Sequence, Union

import torch

from kernelforge.backends import use_backend
from kernelforge.ops.norms import layer_norm, rms_norm

ShapeLike = Union[int, Sequence[int]]


def _as_shape(normalized_shape: ShapeLike) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(s) for s in normalized_shape)


class LayerNorm(torch.nn.Module):
    """torch.nn.LayerNorm on kernelforge's layer_norm (same arguments and parameters)."""

    def __init__(self, normalized_shape: ShapeLike, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.ones(self.normalized_shape, **factory))
            self.bias = torch.nn.Parameter(torch.zeros(self.normalized_shape, **factory)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, normalized_shape=self.normalized_shape)

    extra_repr = torch.nn.LayerNorm.extra_repr  # torch's own text, whichever torch this is


class TritonLayerNorm(LayerNorm):
    """LayerNorm whose forward runs on the Triton backend (or raises if Triton cannot take
    the input); `dim` is the normalized size (as nn.LayerNorm's normalized_shape). The
    backward op picks its backend when autograd runs it: Triton by default on CUDA tensors."""

    def __init__(self, dim: ShapeLike, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        super().__init__(dim, eps, elementwise_affine, bias, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with use_backend("triton"):
            return super().forward(x)


class RMSNorm(torch.nn.Module):
    """torch.nn.RMSNorm on kernelforge's rms_norm (same arguments and parameters), plus
    `offset`: offset=1.0 computes x * (1 + weight) (Gemma; its checkpoints store w, not 1 + w)."""

    def __init__(self, normalized_shape: ShapeLike, eps: Optional[float] = None, elementwise_affine: bool = True,
                 device=None, dtype=None, offset: float = 0.0):
        super().__init__()
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.offset = offset
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
            self.reset_parameters()
        else:
            self.register_parameter("weight", None)

    def reset_parameters(self) -> None:
        # The identity map: weight + offset == 1.
        if self.weight is not None:
            torch.nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset, normalized_shape=self.normalized_shape)

    def extra_repr(self) -> str:
        offset = f", offset={self.offset}" if self.offset else ""
        return torch.nn.RMSNorm.extra_repr(self) + offset
