"""A small training run of the language model on the text shipped with the package (no
downloads): byte-level tokens (vocabulary 256), next-token cross-entropy, AdamW.

The convergence check trains the same initial weights on the same batches at two levels and
compares the loss curves (tests/models/test_training.py; fp32 on a CPU, bf16 on a GPU).

    losses = train_language_model("native", TrainConfig(steps=300))
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kernelforge.models.language_model import LanguageModel

CORPUS = Path(__file__).with_name("data") / "tiny_corpus.txt"


def load_corpus() -> torch.Tensor:
    """The shipped text as int64 byte values (N,)."""
    return torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()


@dataclass
class TrainConfig:
    steps: int = 300
    batch: int = 8
    seq_len: int = 32
    lr: float = 3e-3
    seed: int = 0
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 2


def train_language_model(level: str = "native", config: TrainConfig = TrainConfig(), device="cpu",
                         dtype: torch.dtype = torch.float32) -> list[float]:
    """Trains a fresh LanguageModel (weights from config.seed) at `level`; returns the loss of
    every step. Same config, same initial weights and batches at every level."""
    data = load_corpus()
    torch.manual_seed(config.seed)
    model = LanguageModel(vocab_size=256, dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads,
                          max_seq_len=config.seq_len).to(device, dtype).set_level(level)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    batches = torch.Generator().manual_seed(config.seed)
    windows = torch.arange(config.seq_len + 1)
    losses = []
    for _ in range(config.steps):
        starts = torch.randint(0, len(data) - config.seq_len - 1, (config.batch, 1), generator=batches)
        tokens = data[starts + windows].to(device)  # (batch, seq_len + 1)
        with model.kernel_scope():
            loss = model.loss(tokens)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


__all__ = ["CORPUS", "TrainConfig", "load_corpus", "train_language_model"]
