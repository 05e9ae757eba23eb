"""A Vision Transformer (ViT-B/16 by default: Dosovitskiy et al.) at the five levels.

    model = VisionTransformer(image_size=224, patch_size=16, num_classes=1000)
    logits = model(images)          # (B, 3, 224, 224) -> (B, 1000)

The patch embedding is a convolution with stride = kernel = patch size, computed as one GEMM
over the flattened patches (the same weights as torch.nn.Conv2d's, viewed (dim, C * p * p)),
so it runs on kernelforge's GEMM too. A class token and learned positions precede the blocks;
the head classifies the class token after a final layer norm.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernelforge.models.levels import LevelledModel
from kernelforge.models.transformer import BlockConfig, Linear, Norm, TransformerLayer


@dataclass
class VisionTransformerConfig:
    image_size: int = 224
    patch_size: int = 16
    num_classes: int = 1000
    dim: int = 768
    depth: int = 12
    heads: int = 12
    mlp_ratio: float = 4.0
    channels: int = 3

    def __post_init__(self):
        if self.patch_size <= 0 or self.image_size % self.patch_size:
            raise ValueError(f"image_size ({self.image_size}) must be a multiple of patch_size ({self.patch_size})")
        for name in ("num_classes", "depth", "channels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class VisionTransformer(LevelledModel):
    """Image classifier; `level` as in kernelforge.models.LEVELS."""

    def __init__(self, image_size: int = 224, patch_size: int = 16, num_classes: int = 1000, dim: int = 768,
                 depth: int = 12, heads: int = 12, *, mlp_ratio: float = 4.0, channels: int = 3,
                 level: str = "native"):
        super().__init__()
        self.config = cfg = VisionTransformerConfig(image_size, patch_size, num_classes, dim, depth, heads, mlp_ratio,
                                                    channels)
        block = BlockConfig(dim, heads, mlp_ratio, norm="layer", mlp="gelu", causal=False, bias=True, eps=1e-6)
        self.patch_embed = Linear(channels * patch_size * patch_size, dim)  # a stride-p conv as a GEMM
        self.cls_token = torch.nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_emb = torch.nn.Parameter(torch.randn(1, cfg.num_patches + 1, dim) * 0.02)
        self.layers = torch.nn.ModuleList(TransformerLayer(block) for _ in range(depth))
        self.norm = Norm(dim, "layer", 1e-6, bias=True)
        self.head = Linear(dim, num_classes)
        self._init_level(level)

    def patches(self, images):
        """(B, C, H, W) -> (B, N, C * p * p), row-major patches, each flattened (c, i, j) as a
        Conv2d weight is, so patch_embed.weight.view(dim, C, p, p) is that conv's weight."""
        b, c, h, w = images.shape
        p = self.config.patch_size
        x = images.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // p) * (w // p), c * p * p)

    def compute(self, images):
        """images (B, C, H, W) -> logits (B, num_classes)."""
        cfg = self.config
        if images.dim() != 4 or tuple(images.shape[1:]) != (cfg.channels, cfg.image_size, cfg.image_size):
            raise ValueError(f"VisionTransformer: images must be (batch, {cfg.channels}, {cfg.image_size}, "
                             f"{cfg.image_size}), got shape {tuple(images.shape)}")
        x = self.patch_embed(self.patches(images))  # (B, N, C)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1) + self.pos_emb
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x[:, 0]))


__all__ = ["VisionTransformer", "VisionTransformerConfig"]
