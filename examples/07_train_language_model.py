"""Train the example LanguageModel on the text shipped with kernelforge, logging to TensorBoard.

Byte-level tokens (a vocabulary of 256), next-token cross-entropy, AdamW; the loss, the gradient
norm, the learning rate and the throughput go to TensorBoard every step, and a sample of
generated text at the end. The model runs at any level (kernelforge.models.LEVELS; on a CPU
"reference" runs kernelforge's ops on their PyTorch implementations). Inside
`model.kernel_scope()` the backward's ops follow the level too.

    python examples/07_train_language_model.py                     # 10 steps, a few seconds
    python examples/07_train_language_model.py --steps 500 --logdir runs/lm
    tensorboard --logdir runs/lm                                   # then open the page it prints
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter

from kernelforge.models import LanguageModel
from kernelforge.models.training import load_corpus


def batches(data: torch.Tensor, batch: int, seq_len: int, seed: int):
    """Endless random windows of seq_len + 1 bytes: the model reads the first seq_len, predicts the last seq_len."""
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch, 1), generator=generator)
        yield data[starts + offsets]


def train(model, data, writer: SummaryWriter, steps: int, batch: int, seq_len: int, lr: float, seed: int = 0) -> list:
    """AdamW with a linear warm-up over the first tenth of the steps; returns the loss of every step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    device = next(model.parameters()).device
    losses = []
    model.train()
    for step, tokens in zip(range(steps), batches(data, batch, seq_len, seed)):
        start = time.perf_counter()
        with model.kernel_scope():  # forward, loss and backward at the model's level
            loss = model.loss(tokens.to(device))
            loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        losses.append(loss.item())
        writer.add_scalar("train/loss", losses[-1], step)
        writer.add_scalar("train/grad_norm", grad_norm.item(), step)
        writer.add_scalar("train/lr", schedule.get_last_lr()[0], step)
        writer.add_scalar("train/tokens_per_s", batch * seq_len / (time.perf_counter() - start), step)
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {losses[-1]:.4f}  grad norm {grad_norm.item():.3f}")
    return losses


def sample(model, data, length: int = 64, seed: int = 0) -> str:
    """Text the model writes after a prompt taken from the corpus (top-k sampling on the static KV cache)."""
    torch.manual_seed(seed)
    model.eval()
    prompt = data[:16].view(1, -1).to(next(model.parameters()).device)
    with torch.no_grad():
        ids = model.generate(prompt, max_new_tokens=length, temperature=0.8, top_k=20)
    return bytes(ids[0].tolist()).decode("utf-8", errors="replace")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--logdir", default=None, help="TensorBoard log directory (default: a new temporary one)")
    parser.add_argument("--level", default="reference", help="the model's level (default reference)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    data = load_corpus()  # the shipped text as byte values
    model = LanguageModel(vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=max(1, args.dim // 32),
                          max_seq_len=max(args.seq_len, 128), level=args.level).to(args.device)
    print(f"{len(data)} bytes of text; a {sum(p.numel() for p in model.parameters())}-parameter model at level "
          f"{args.level!r}")
    logdir = Path(args.logdir) if args.logdir else Path(tempfile.mkdtemp(prefix="kernelforge-lm-"))
    with SummaryWriter(log_dir=str(logdir)) as writer:
        writer.add_text("config", str(vars(args)))
        losses = train(model, data, writer, args.steps, args.batch, args.seq_len, args.lr, args.seed)
        text = sample(model, data)
        writer.add_text("sample", text)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; a sample (the 16-byte prompt, then the model's bytes):\n{text!r}")
    print(f"TensorBoard logs in {logdir}  (tensorboard --logdir {logdir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
