"""The pre-norm transformer block the example models share, written once against a kernel set
(kernelforge/models/levels.py), so every level runs the same parameters.

    x -> norm1 -> self-attention -> (+ x) -> norm2 -> MLP -> (+)
On the kernelforge levels the QKV projection and the MLP's first layer are GEMMs with the bias
(and activation) fused, the residual add is fused into norm2, and attention is flash attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from kernelforge.models.levels import Component, LevelledModel

NORMS = ("rms", "layer")
MLPS = ("gelu", "swiglu")


@dataclass
class BlockConfig:
    dim: int
    num_heads: int
    mlp_ratio: float = 4.0
    norm: str = "layer"  # "rms" | "layer"
    mlp: str = "gelu"  # "gelu" (Linear + GELU + Linear) | "swiglu" (LLaMA's gated MLP)
    causal: bool = False
    bias: bool = True
    eps: float = 1e-5

    def __post_init__(self):
        if self.dim <= 0 or self.num_heads <= 0 or self.dim % self.num_heads:
            raise ValueError(f"dim ({self.dim}) must be a positive multiple of num_heads ({self.num_heads})")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.mlp not in MLPS:
            raise ValueError(f"mlp must be one of {MLPS}, got {self.mlp!r}")
        if self.mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be positive, got {self.mlp_ratio}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def hidden_dim(self) -> int:
        if self.mlp == "swiglu":  # 2/3 of the GELU MLP's width keeps its parameter count (LLaMA)
            return max(32, 32 * math.ceil(2 * self.mlp_ratio * self.dim / 3 / 32))
        return int(self.mlp_ratio * self.dim)


def _linear_params(module: torch.nn.Module, in_dim: int, out_dim: int, bias: bool) -> None:
    """weight (out, in) and bias as torch.nn.Linear holds and initializes them."""
    layer = torch.nn.Linear(in_dim, out_dim, bias=bias)
    module.weight, module.bias = layer.weight, layer.bias


class Linear(Component):
    def __init__(self, in_dim: int, out_dim: int, bias: bool = True, activation: Optional[str] = None):
        super().__init__()
        _linear_params(self, in_dim, out_dim, bias)
        self.activation = activation

    def forward(self, x):  # (..., in) -> (..., out)
        return self.kernels.ops.linear(x, self.weight, self.bias, self.activation)


class Norm(Component):
    def __init__(self, dim: int, kind: str, eps: float, bias: bool):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.bias = torch.nn.Parameter(torch.zeros(dim)) if bias and kind == "layer" else None

    def forward(self, x):
        return self.kernels.ops.norm(x, self.weight, self.bias, self.eps, self.kind)

    def add(self, x, residual):
        """(norm(x + residual), x + residual) in one kernel on the kernelforge levels."""
        return self.kernels.ops.add_norm(x, residual, self.weight, self.bias, self.eps, self.kind)


class SelfAttention(Component):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.num_heads, self.head_dim, self.causal = cfg.num_heads, cfg.head_dim, cfg.causal
        self.qkv = Linear(cfg.dim, 3 * cfg.dim, cfg.bias)
        self.proj = Linear(cfg.dim, cfg.dim, cfg.bias)

    def _heads(self, x):
        """(B, T, C) -> q, k, v each (B, H, T, D): strided views of the one QKV GEMM's output.
        unbind, not qkv[0], qkv[1], qkv[2]: the backward of three selects is three zero-filled
        (B, T, 3C) buffers, a copy into each and two adds of them; unbind's is one stack of the three
        gradients (one kernel, reading each gradient once)."""
        b, t, _ = x.shape
        return self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def _merge(self, y):  # (B, H, T, D) -> (B, T, C) -> output projection
        b, _, t, _ = y.shape
        return self.proj(y.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))

    def forward(self, x):
        q, k, v = self._heads(x)
        return self._merge(self.kernels.ops.attention(q, k, v, self.causal))

    def forward_cached(self, x, positions, cache_k, cache_v, seqlens):
        """x (B, T, C) at `positions` ((T,), on the device); cache_k / cache_v (B, H, S, D) are written
        at those positions, then the queries attend over the cache (`seqlens`: the kernel set's
        cache_seqlens). The writes index with the device positions, so a step's shapes and its CUDA
        graph do not depend on where it writes; cache_k and cache_v are whole tensors, not views of a
        larger one: under torch.compile a write into a view becomes a copy of the whole base."""
        q, k, v = self._heads(x)
        cache_k.index_copy_(2, positions, k)
        cache_v.index_copy_(2, positions, v)
        return self._merge(self.kernels.ops.cached_attention(q, cache_k, cache_v, positions, seqlens))


class MLP(Component):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.kind = cfg.mlp
        if cfg.mlp == "swiglu":  # [gate | up] in one GEMM, then silu(gate) * up
            self.fc1 = Linear(cfg.dim, 2 * cfg.hidden_dim, bias=False)
        else:  # GELU fused into the first GEMM's epilogue on the kernelforge levels
            self.fc1 = Linear(cfg.dim, cfg.hidden_dim, cfg.bias, activation="gelu")
        self.fc2 = Linear(cfg.hidden_dim, cfg.dim, cfg.bias and cfg.mlp != "swiglu")

    def forward(self, x):
        h = self.fc1(x)
        if self.kind == "swiglu":
            h = self.kernels.ops.swiglu(h)
        return self.fc2(h)


class TransformerLayer(Component):
    """One pre-norm block, as the models stack it (they call compute / compute_cached)."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.norm1 = Norm(cfg.dim, cfg.norm, cfg.eps, cfg.bias)
        self.attn = SelfAttention(cfg)
        self.norm2 = Norm(cfg.dim, cfg.norm, cfg.eps, cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):  # (B, T, C) -> (B, T, C)
        normed, h = self.norm2.add(self.attn(self.norm1(x)), x)
        return h + self.mlp(normed)

    def forward_cached(self, x, positions, cache_k, cache_v, seqlens):
        normed, h = self.norm2.add(self.attn.forward_cached(self.norm1(x), positions, cache_k, cache_v, seqlens), x)
        return h + self.mlp(normed)


class OptimizedTransformerBlock(LevelledModel):
    """A pre-norm transformer block at one of the five levels.

        block = OptimizedTransformerBlock(dim=512, num_heads=8)
        y = block(torch.randn(4, 128, 512))   # (batch, seq, dim) -> same shape

    norm: "rms" or "layer"; mlp: "gelu" or "swiglu"; causal: each token attends to itself and
    earlier tokens only. level: see kernelforge.models.LEVELS.
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, norm: str = "layer", causal: bool = False,
                 *, mlp: str = "gelu", bias: bool = True, eps: float = 1e-5, level: str = "native"):
        super().__init__()
        self.config = BlockConfig(dim, num_heads, mlp_ratio, norm, mlp, causal, bias, eps)
        self.layer = TransformerLayer(self.config)
        self._init_level(level)

    def compute(self, x):
        if x.dim() != 3 or x.shape[-1] != self.config.dim:
            raise ValueError(f"OptimizedTransformerBlock: x must be (batch, seq, {self.config.dim}), "
                             f"got shape {tuple(x.shape)}")
        return self.layer(x)


__all__ = ["BlockConfig", "OptimizedTransformerBlock", "TransformerLayer"]
