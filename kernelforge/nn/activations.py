"""Activation modules on kernelforge's ops: GELU and SiLU (drop-in for torch.nn's, same
constructor arguments and repr) and SwiGLU, the gated MLP block of Llama-style models."""
from __future__ import annotations

from typing import Optional

import torch

from kernelforge.ops.activations import gelu, silu
from kernelforge.ops.gated_activations import swiglu


class GELU(torch.nn.Module):
    """torch.nn.GELU on kernelforge's op: approximate="none" (erf form) or "tanh"."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"kernelforge.nn.GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class SiLU(torch.nn.Module):
    """torch.nn.SiLU on kernelforge's op. `inplace` is accepted for signature compatibility
    but must be False: the backward recomputes silu' from the input, which an in-place
    result would overwrite (and writing the result back would save no memory)."""

    def __init__(self, inplace: bool = False):
        super().__init__()
        if inplace:
            raise ValueError(
                "kernelforge.nn.SiLU: inplace=True is not supported: the backward recomputes "
                "from the input, which an in-place result would overwrite"
            )
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu(x)

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


class SwiGLU(torch.nn.Module):
    """Gated MLP block: w2(silu(w1(x)) * w3(x)), as Llama's FeedForward.

    state_dict keys, as in Meta's Llama / Mistral checkpoints (model.layers.N.feed_forward.*):
        w1.weight  (hidden_dim, dim)   gate projection  (Hugging Face LlamaMLP: gate_proj)
        w3.weight  (hidden_dim, dim)   up projection    (up_proj)
        w2.weight  (dim, hidden_dim)   down projection  (down_proj)
    plus w1.bias / w3.bias / w2.bias when bias=True. Two input projections rather than one
    fused Linear(dim, 2 * hidden_dim) so that these checkpoints load as they are; the
    gate and up products go to the fused swiglu kernel as two tensors.
    """

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.dim, self.hidden_dim = dim, hidden_dim
        self.w1 = torch.nn.Linear(dim, hidden_dim, bias=bias, **factory)
        self.w2 = torch.nn.Linear(hidden_dim, dim, bias=bias, **factory)
        self.w3 = torch.nn.Linear(dim, hidden_dim, bias=bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden_dim={self.hidden_dim}, bias={self.w1.bias is not None}"
