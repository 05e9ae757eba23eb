"""Cross-entropy over class logits in plain PyTorch: the definition every backend must match.

For a row of logits x (C classes) with target class t:

    lse  = log(sum_c exp(x_c))
    loss = (1 - eps) * (lse - x_t) + eps * (lse - mean_c x_c)      (eps: label smoothing)

which is torch.nn.functional.cross_entropy's per-row loss, label smoothing included. A row whose
target is `ignore_index` has loss 0 and gradient 0. A row whose target is neither ignore_index nor
a class in [0, C) has loss NaN and a NaN gradient: every backend marks it the same way, where a
GPU kernel could not raise without a host sync (torch raises on the CPU and asserts on the GPU).

The gradient of row loss i, scaled by g_i:  g_i * (softmax(x)_c - (1 - eps) * [c == t] - eps / C).

Accumulates in float32 (float64 for float64 logits); losses and lse are float32 (float64), the
gradient is rounded once to the logits' dtype. This is also the CPU implementation and, on
float64 inputs, the test oracle.
"""
from __future__ import annotations

import torch

from kernelforge.reference._accumulation import accumulation_dtype as _accumulation_dtype


def target_masks(target: torch.Tensor, n_classes: int, ignore_index: int):
    """(ignored rows, rows whose target is out of range, each row's target as a safe int64 index)."""
    target = target.long()  # an int32 target against an ignore_index beyond int32 must not wrap it
    ignored = target == ignore_index
    bad = ~ignored & ((target < 0) | (target >= n_classes))
    return ignored, bad, torch.where(ignored | bad, 0, target).long()  # a safe index for gather


# Row launchers: the interface every backend of the cross_entropy op implements. logits2d is
# (rows, classes) with unit column stride, target (rows,) int32/int64.
def cross_entropy_forward_rows(logits2d: torch.Tensor, target: torch.Tensor, ignore_index: int,
                               label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row loss, per-row lse), both (rows,) in the accumulation dtype."""
    x = logits2d.to(_accumulation_dtype(logits2d.dtype))
    n_classes = x.shape[1]
    lse = torch.logsumexp(x, dim=1)
    ignored, bad, safe = target_masks(target, n_classes, ignore_index)
    loss = lse - x.gather(1, safe[:, None])[:, 0]
    if label_smoothing:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - x.mean(dim=1))
    loss = torch.where(ignored, 0.0, loss).masked_fill_(bad, float("nan"))
    return loss, lse


def cross_entropy_backward_rows(grad_loss: torch.Tensor, logits2d: torch.Tensor, target: torch.Tensor,
                                lse: torch.Tensor, ignore_index: int, label_smoothing: float) -> torch.Tensor:
    """d(sum_i grad_loss_i * loss_i) / d logits: (rows, classes) in the logits' dtype."""
    acc = _accumulation_dtype(logits2d.dtype)
    x = logits2d.to(acc)
    n_classes = x.shape[1]
    ignored, bad, safe = target_masks(target, n_classes, ignore_index)
    grad = torch.exp(x - lse.to(acc)[:, None]) - label_smoothing / n_classes
    grad.scatter_add_(1, safe[:, None], torch.full_like(grad[:, :1], -(1 - label_smoothing)))
    scale = torch.where(ignored, 0.0, grad_loss.to(acc)).masked_fill_(bad, float("nan"))
    return (grad * scale[:, None]).to(logits2d.dtype)
