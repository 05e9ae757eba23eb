"""A decoder-only language model (LLaMA-style: RMS norm, SwiGLU MLP, learned positions, tied
embeddings) at the five levels, with KV-cache generation.

    model = LanguageModel(vocab_size=256, dim=128, n_layers=2, n_heads=4, max_seq_len=256)
    logits = model(ids)                                  # (B, T) -> (B, T, vocab)
    out = model.generate(ids, max_new_tokens=32, temperature=0.8, top_k=40)   # (B, T + 32)

Generation keeps each layer's keys and values in a static cache (B, H, rows, D), rows bucketed
(kernelforge.models.decoding), and decodes one token a step in a CUDA graph on a GPU. The torch
levels (and the fastest) attend over the whole cache under a mask computed on the device; the
kernelforge levels attend over the filled rows only (flash_attention's cache_seqlens), where
flash-decoding splits the keys across the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kernelforge.models.decoding import Decoder, cache_rows, decoder_key, sample
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

    WHOLE_GRAPH_METHODS = ("compute_step",)  # the decode step: compiled whole, in CUDA graphs, at compile too

    def __init__(self, vocab_size: int, dim: int = 512, n_layers: int = 6, n_heads: int = 8,
                 max_seq_len: int = 1024, *, mlp_ratio: float = 4.0, norm: str = "rms", level: str = "native",
                 activation_checkpointing: bool = False):
        super().__init__()
        # keep each layer's input only and run the layer again in the backward (LevelledModel.layer_call)
        self.activation_checkpointing = activation_checkpointing
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
        """ids (B, T) -> logits (B, T, vocab). With activation_checkpointing (and a gradient to
        compute) each layer keeps only its input for the backward, which runs the layer again
        (LevelledModel.layer_call): what a layer holds from the forward to the backward (its normed
        inputs, q / k / v, the attention's output, the MLP's gate, up and product: over ten times
        dim elements a token) shrinks to its input, dim a token, for one more forward of every layer
        a step (about a third more compute)."""
        self._check_ids(ids)
        x = self._embed(ids, torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = self.layer_call(layer, x)
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

    def compute_cached(self, ids, positions, cache, last=None):
        """ids (B, T) at `positions` (T,) (consecutive, on ids' device) -> the logits (B, vocab) of the
        token at index `last` ((1,) on the device; default the last token); writes the layers' keys and
        values at those positions into `cache` (new_cache's pairs)."""
        x = self._embed(ids, positions)
        seqlens = self.kernels.ops.cache_seqlens(positions, ids.shape[0])  # once for every layer
        for layer, (cache_k, cache_v) in zip(self.layers, cache):
            x = layer.forward_cached(x, positions, cache_k, cache_v, seqlens)
        x = x[:, -1:] if last is None else x.index_select(1, last)  # only one token's logits are needed
        return self.head(self.norm(x))[:, 0]

    def compute_step(self, ids, position, cache):
        """One decode step: ids (B, 1) at position (1,) -> logits (B, vocab), the cache written there.
        compute_cached under its own name, so that the compile level compiles it whole and in CUDA
        graphs (WHOLE_GRAPH_METHODS) and the prefill apart."""
        return self.compute_cached(ids, position, cache)

    def new_cache(self, batch: int, length: int, dtype: torch.dtype, device) -> tuple:
        """A KV cache of `length` rows: a (keys, values) pair per layer, each (B, H, length, D). Separate
        tensors: under torch.compile a write into a view of one larger tensor becomes a copy of all of it.
        Zeros: rows past the position enter attention's weighted sum with weight 0, and 0 * nan is nan.
        H is each layer's attention's own head count: under tensor parallelism (kernelforge.distributed.plans)
        a rank attends over, and caches, its heads only."""
        shapes = [(batch, layer.attn.num_heads, length, layer.attn.head_dim) for layer in self.layers]
        return tuple((torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                     for shape in shapes)

    def decoder(self, batch: int, total: int, ids_dtype: torch.dtype = torch.int64, device=None) -> Decoder:
        """The decoding state (kernelforge.models.decoding.Decoder) for `batch` sequences of up to `total`
        positions: the model keeps one and reuses it, with its cache and graphs, while the level, batch,
        bucketed length (cache_rows), dtypes, device and parameters stay the same."""
        if not 1 <= total <= self.config.max_seq_len:
            raise ValueError(f"LanguageModel.decoder: total must be in 1..max_seq_len ({self.config.max_seq_len}), "
                             f"got {total}")
        device = torch.device(device) if device is not None else self.tok_emb.weight.device
        rows = cache_rows(total, self.config.max_seq_len)
        key = decoder_key(self, batch, rows, ids_dtype, device)
        if self._decoder is None or self._decoder.key != key:
            self._decoder = None  # the old cache and graph go before the new ones are allocated
            self._decoder = Decoder(self, batch, rows, ids_dtype, device, key)
        return self._decoder

    @property
    def decoding(self) -> Optional[Decoder]:
        """The decoder the last generate call used (None before any)."""
        return self._decoder

    def set_level(self, level: str) -> "LanguageModel":
        self._decoder = None  # its graphs and compiled step belong to the previous level
        return super().set_level(level)

    def __getstate__(self):
        # the decoder's graphs hold this model's memory: a copy starts without one
        return {**super().__getstate__(), "_decoder": None}

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Appends max_new_tokens sampled tokens to ids (B, T): softmax(logits / temperature)
        restricted to the top_k tokens; temperature 0 takes the most likely token. The prompt is
        prefilled once, then each token is one step of a static-cache decoder (kernelforge.models.decoding),
        graphed on a GPU; the tokens stay on the device until the end."""
        if max_new_tokens < 0:
            raise ValueError(f"LanguageModel.generate: max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"LanguageModel.generate: temperature must be >= 0, got {temperature}")
        if top_k is not None and not 1 <= top_k <= self.config.vocab_size:
            raise ValueError(f"LanguageModel.generate: top_k must be in 1..{self.config.vocab_size}, got {top_k}")
        self._check_ids(ids, start=max_new_tokens)
        if max_new_tokens == 0:
            return ids
        if ids.shape[1] == 0:
            raise ValueError("LanguageModel.generate: ids must hold at least one token per sequence, got shape "
                             f"{tuple(ids.shape)}")
        decoder = self.decoder(ids.shape[0], ids.shape[1] + max_new_tokens, ids.dtype, ids.device)
        logits = decoder.prefill(ids)
        tokens = []
        for step in range(max_new_tokens):
            tokens.append(sample(logits, temperature, top_k, generator))
            if step + 1 < max_new_tokens:
                logits = decoder.step(tokens[-1])
        return torch.cat([ids, *tokens], dim=1)


__all__ = ["LanguageModel", "LanguageModelConfig"]
