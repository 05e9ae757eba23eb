"""A decoder-only language model (LLaMA-style: RMS norm, SwiGLU MLP, learned positions, tied
embeddings) at the five levels, with KV-cache generation.

    model = LanguageModel(vocab_size=256, dim=128, n_layers=2, n_heads=4, max_seq_len=256)
    logits = model(ids)                                  # (B, T) -> (B, T, vocab)
    out = model.generate(ids, max_new_tokens=32, temperature=0.8, top_k=40)   # (B, T + 32)

Generation keeps keys and values of every layer in one cache (layers, 2, B, H, T_total, D).
The native / torchscript / compile levels attend over the whole cache under a mask, so one
trace or one compiled graph serves every decode step; the kernelforge levels attend over the
filled part only, where flash-decoding splits the keys across the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kernelforge.models.levels import LevelledModel
from kernelforge.models.transformer import BlockConfig, Linear, Norm, TransformerLayer


@dataclass
class LanguageModelConfig:
    vocab_size: int
    dim: int = 512
    n_layers: int = 6
    n_heads: int = 8
    max_seq_len: int = 1024
    mlp_ratio: float = 4.0
    norm: str = "rms"
    eps: float = 1e-6

    def __post_init__(self):
        for name in ("vocab_size", "n_layers", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def block(self) -> BlockConfig:
        return BlockConfig(self.dim, self.n_heads, self.mlp_ratio, self.norm, mlp="swiglu", causal=True, bias=False,
                           eps=self.eps)


class LanguageModel(LevelledModel):
    """Causal transformer language model; `level` as in kernelforge.models.LEVELS."""

    def __init__(self, vocab_size: int, dim: int = 512, n_layers: int = 6, n_heads: int = 8,
                 max_seq_len: int = 1024, *, mlp_ratio: float = 4.0, norm: str = "rms", level: str = "native"):
        super().__init__()
        self.config = cfg = LanguageModelConfig(vocab_size, dim, n_layers, n_heads, max_seq_len, mlp_ratio, norm)
        block = cfg.block()
        self.tok_emb = torch.nn.Embedding(vocab_size, dim)
        self.pos_emb = torch.nn.Embedding(max_seq_len, dim)
        torch.nn.init.normal_(self.tok_emb.weight, std=0.02)
        torch.nn.init.normal_(self.pos_emb.weight, std=0.02)
        self.layers = torch.nn.ModuleList(TransformerLayer(block) for _ in range(n_layers))
        self.norm = Norm(dim, norm, cfg.eps, bias=False)
        self.head = Linear(dim, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied embeddings
        self._init_level(level)

    def _check_ids(self, ids: torch.Tensor, start: int = 0) -> None:
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"LanguageModel: ids must be (batch, seq) int64/int32 token ids, got shape "
                             f"{tuple(ids.shape)} of {ids.dtype}")
        if start + ids.shape[1] > self.config.max_seq_len:
            raise ValueError(f"LanguageModel: {start + ids.shape[1]} positions exceed max_seq_len "
                             f"{self.config.max_seq_len}")

    def _embed(self, ids, positions):
        return self.tok_emb(ids) + self.pos_emb(positions)  # (B, T, C)

    def compute(self, ids):
        """ids (B, T) -> logits (B, T, vocab)."""
        self._check_ids(ids)
        x = self._embed(ids, torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    def loss(self, ids):
        """Next-token cross-entropy of ids (B, T): the logits of ids[:, :-1] against ids[:, 1:], the mean
        over B * (T - 1) targets, float32 (float64 for a float64 model). The loss runs at the model's
        level with the rest: torch.compile compiles it into the model's graph, the kernelforge levels
        run kernelforge.cross_entropy on the logits in their dtype (the torch levels take torch's
        recipe, F.cross_entropy on a float32 copy of half-precision logits)."""
        return self.run("compute_loss", ids)

    def compute_loss(self, ids):
        """ids (B, T) -> the mean next-token loss (a scalar, float32 or wider)."""
        logits = self.compute(ids[:, :-1])  # (B, T - 1, vocab)
        return self.kernels.ops.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    def compute_cached(self, ids, positions, cache):
        """ids (B, T) at `positions` (T,) -> logits of the last token (B, vocab); writes the
        layers' keys and values into cache (layers, 2, B, H, S, D)."""
        x = self._embed(ids, positions)
        end = self.kernels.ops.cache_end(positions)  # a host read on the kernelforge levels only
        for i, layer in enumerate(self.layers):
            x = layer.forward_cached(x, positions, cache[i, 0], cache[i, 1], end)
        return self.head(self.norm(x[:, -1:]))[:, 0]

    def new_cache(self, batch: int, length: int, dtype: torch.dtype, device) -> torch.Tensor:
        cfg = self.config
        return torch.zeros(cfg.n_layers, 2, batch, cfg.n_heads, length, cfg.dim // cfg.n_heads, dtype=dtype,
                           device=device)

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Appends max_new_tokens sampled tokens to ids (B, T): softmax(logits / temperature)
        restricted to the top_k tokens; temperature 0 takes the most likely token."""
        if max_new_tokens < 0:
            raise ValueError(f"LanguageModel.generate: max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"LanguageModel.generate: temperature must be >= 0, got {temperature}")
        if top_k is not None and not 1 <= top_k <= self.config.vocab_size:
            raise ValueError(f"LanguageModel.generate: top_k must be in 1..{self.config.vocab_size}, got {top_k}")
        self._check_ids(ids, start=max_new_tokens)
        if max_new_tokens == 0:
            return ids
        batch, prompt = ids.shape
        cache = self.new_cache(batch, prompt + max_new_tokens, self.tok_emb.weight.dtype, ids.device)
        positions = torch.arange(prompt, device=ids.device)
        logits = self.run("compute_cached", ids, positions, cache)
        tokens = [ids]
        for step in range(max_new_tokens):
            tokens.append(_sample(logits, temperature, top_k, generator))
            if step + 1 < max_new_tokens:
                logits = self.run("compute_cached", tokens[-1], positions[-1:] + step + 1, cache)
        return torch.cat(tokens, dim=1)


def _sample(logits: torch.Tensor, temperature: float, top_k: Optional[int],
            generator: Optional[torch.Generator]) -> torch.Tensor:
    """(B, vocab) -> (B, 1) token ids."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


__all__ = ["LanguageModel", "LanguageModelConfig"]
