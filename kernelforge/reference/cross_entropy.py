"""Cross-entropy over class logits in plain PyTorch: the definition every backend must match.

For a row of logits x (C classes) with target class t:

    lse  = log(sum_c exp(x_c))
    loss = (1 - eps) * (lse - x_t) + eps * (lse - mean_c x_c)      (eps: label smoothing)

which is torch.nn.functional.cross_entropy's per-row loss, label smoothing included. A row whose
target is `ignore_index` has loss 0 and gradient 0. A row whose target is neither ignore_index nor
a class in [0, C) has loss NaN and a NaN gradient: every backend marks it the same way, where a
GPU kernel could not raise without a host sync (torch raises on the CPU and asserts on the GPU).

The gradient of row loss i, scaled by g_i:  g_i * (softmax(x)_c - (1 - eps) * [c == t] - eps / C)
(with a z-loss, softmax(x)_c (1 + 2 z_loss lse); with a softcap, times the cap's 1 - tanh^2).

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


def _capped(x: torch.Tensor, softcap: float):
    """(the logits as the loss sees them, tanh(x / softcap) or None)."""
    if not softcap:
        return x, None
    t = torch.tanh(x / softcap)
    return softcap * t, t


def _log_sum_exp(x: torch.Tensor) -> torch.Tensor:
    """log(sum_c exp(x_c)) per row as torch's log_softmax takes it (max + log(sum(exp(x - max))):
    a +inf logit gives NaN (inf - inf), as torch's cross-entropy and the kernels give, where
    torch.logsumexp returns +inf and the loss would be a finite-looking inf."""
    top = x.amax(dim=1, keepdim=True)
    return (top + torch.log(torch.exp(x - top).sum(dim=1, keepdim=True)))[:, 0]


# Row launchers: the interface every backend of the cross_entropy op implements. logits2d is
# (rows, classes) with unit column stride, target (rows,) int32/int64. softcap c > 0: the loss
# is of c * tanh(logits / c) (Gemma 2's logit softcapping); z_loss: z_loss * lse^2 is added to
# each row's loss (PaLM's z-loss); both for fused linear cross-entropy.
def cross_entropy_forward_rows(logits2d: torch.Tensor, target: torch.Tensor, ignore_index: int,
                               label_smoothing: float, softcap: float = 0.0,
                               z_loss: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row loss, per-row lse), both (rows,) in the accumulation dtype."""
    x, _ = _capped(logits2d.to(_accumulation_dtype(logits2d.dtype)), softcap)
    n_classes = x.shape[1]
    lse = _log_sum_exp(x)
    ignored, bad, safe = target_masks(target, n_classes, ignore_index)
    loss = lse - x.gather(1, safe[:, None])[:, 0]
    if label_smoothing:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - x.mean(dim=1))
    if z_loss:
        loss = loss + z_loss * lse * lse
    loss = torch.where(ignored, 0.0, loss).masked_fill_(bad, float("nan"))
    return loss, lse


def _slice_gradient(grad_loss, logits, target, lse, first_class: int, n_classes: int, ignore_index: int,
                    label_smoothing: float, softcap: float, z_loss: float) -> torch.Tensor:
    """d(sum_i grad_loss_i * loss_i) / d logits over classes [first_class, first_class + width)."""
    acc = _accumulation_dtype(logits.dtype)
    x, t = _capped(logits.to(acc), softcap)
    lse = lse.to(acc)[:, None]
    p = torch.exp(x - lse)
    grad = (p * (1 + 2 * z_loss * lse) if z_loss else p) - label_smoothing / n_classes
    ignored, bad, safe = target_masks(target, n_classes, ignore_index)
    local = safe - first_class
    here = (local >= 0) & (local < x.shape[1]) & ~ignored & ~bad
    hit = torch.zeros_like(grad[:, :1]).masked_fill_(here[:, None], -(1 - label_smoothing))
    grad.scatter_add_(1, local.clamp(0, max(x.shape[1] - 1, 0))[:, None], hit)
    scale = torch.where(ignored, 0.0, grad_loss.to(acc)).masked_fill_(bad, float("nan"))
    grad = grad * scale[:, None]
    return grad * (1 - t * t) if softcap else grad


def cross_entropy_backward_rows(grad_loss: torch.Tensor, logits2d: torch.Tensor, target: torch.Tensor,
                                lse: torch.Tensor, ignore_index: int, label_smoothing: float) -> torch.Tensor:
    """d(sum_i grad_loss_i * loss_i) / d logits: (rows, classes) in the logits' dtype."""
    return _slice_gradient(grad_loss, logits2d, target, lse, 0, logits2d.shape[1], ignore_index, label_smoothing,
                           0.0, 0.0).to(logits2d.dtype)


def cross_entropy_slice_backward_(grad_loss: torch.Tensor, logits_slice: torch.Tensor, target: torch.Tensor,
                                  lse: torch.Tensor, first_class: int, n_classes: int, ignore_index: int,
                                  label_smoothing: float, softcap: float = 0.0, z_loss: float = 0.0) -> torch.Tensor:
    """The gradient over classes [first_class, first_class + width) of (rows, width) logits of rows
    of n_classes whose lse (of the capped logits) is known, written over logits_slice in place."""
    if logits_slice.numel():
        logits_slice.copy_(_slice_gradient(grad_loss, logits_slice, target, lse, first_class, n_classes,
                                           ignore_index, label_smoothing, softcap, z_loss))
    return logits_slice
