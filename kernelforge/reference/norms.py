"""Layer norm and RMS norm in plain PyTorch: the definition every backend must match.

Over rows h of n elements (h = x, or h = x + residual rounded to x's dtype for the
add_ variants), in float32 (float64 for float64 input):
    layer norm: mean = sum(h)/n, var = sum((h - mean)^2)/n (biased),
                rstd = 1/sqrt(var + eps),     y = (h - mean) * rstd * w + b
    RMS norm:   rstd = 1/sqrt(sum(h^2)/n + eps), y = h * rstd * (w + offset) + b
A missing weight is 1 (and offset does not apply), a missing bias 0.

Backward, with xhat = (h - mean) * rstd (layer) or h * rstd (RMS) and g = dy * w':
    dh = rstd * (g - mean(g) - xhat * mean(g * xhat))     (layer norm)
    dh = rstd * (g - xhat * mean(g * xhat))               (RMS norm)
    dw = sum over rows of dy * xhat,  db = sum over rows of dy
plus the gradient flowing into residual_out for the add_ variants.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from kernelforge.reference._accumulation import accumulation_dtype as _accumulation_dtype


def _effective_weight(weight: Optional[torch.Tensor], offset: float, acc: torch.dtype):
    return None if weight is None else weight.to(acc) + offset


def norm_statistics(h: torch.Tensor, eps: float, rms: bool):
    """(mean or None, rstd) over the last dim, in the accumulation dtype."""
    ha = h.to(_accumulation_dtype(h.dtype))
    if rms:
        return None, torch.rsqrt(ha.square().mean(-1) + eps)
    mean = ha.mean(-1)
    var = (ha - mean.unsqueeze(-1)).square().mean(-1)
    return mean, torch.rsqrt(var + eps)


def _normalized(h: torch.Tensor, mean, rstd) -> torch.Tensor:
    ha = h.to(rstd.dtype)
    centered = ha if mean is None else ha - mean.unsqueeze(-1)
    return centered * rstd.unsqueeze(-1)


def norm_forward_rows(x2d, residual2d, weight, bias, eps: float, rms: bool, offset: float):
    """(y, residual_out or None, mean or None, rstd); see the module docstring."""
    h = x2d if residual2d is None else (x2d + residual2d)  # rounded to x's dtype, as stored
    mean, rstd = norm_statistics(h, eps, rms)
    y = _normalized(h, mean, rstd)
    w = _effective_weight(weight, offset, y.dtype)
    if w is not None:
        y = y * w
    if bias is not None:
        y = y + bias.to(y.dtype)
    stats_dtype = torch.float32 if rstd.dtype != torch.float64 else torch.float64
    mean = None if mean is None else mean.to(stats_dtype).contiguous()
    residual_out = None if residual2d is None else h.contiguous()
    return y.to(x2d.dtype).contiguous(), residual_out, mean, rstd.to(stats_dtype).contiguous()


def norm_backward_rows(grad_y2d, grad_residual2d, h2d, weight, bias_dtype: Optional[torch.dtype], mean, rstd,
                       rms: bool, offset: float, need_weight_grad: bool):
    """(grad_h, grad_weight or None, grad_bias or None); see the module docstring. bias_dtype: the
    bias's dtype, None without a bias."""
    acc = _accumulation_dtype(h2d.dtype)
    dy = grad_y2d.to(acc)
    mean = None if mean is None else mean.to(acc)
    rstd = rstd.to(acc)
    xhat = _normalized(h2d, mean, rstd)
    w = _effective_weight(weight, offset, acc)
    g = dy if w is None else dy * w
    dh = g - xhat * (g * xhat).mean(-1, keepdim=True)
    if not rms:
        dh = dh - g.mean(-1, keepdim=True)
    dh = dh * rstd.unsqueeze(-1)
    if grad_residual2d is not None:
        dh = dh + grad_residual2d.to(acc)
    grad_weight = grad_bias = None
    if need_weight_grad and weight is not None:
        grad_weight = (dy * xhat).sum(0).to(weight.dtype)
    if need_weight_grad and bias_dtype is not None:
        grad_bias = dy.sum(0).to(bias_dtype)
    return dh.to(h2d.dtype).contiguous(), grad_weight, grad_bias


def differentiable_backward(grad_y, grad_residual, h, weight, normalized_shape, bias_dtype: Optional[torch.dtype],
                            eps: float, rms: bool, offset: float, weight_grads: bool):
    """norm_backward_rows on whole tensors, with the statistics recomputed from h in
    differentiable ops: autograd through it gives the backward's own gradient."""
    n = math.prod(normalized_shape)
    flat = lambda t: None if t is None else t.reshape(-1, n)  # noqa: E731
    h2d = flat(h)
    mean, rstd = norm_statistics(h2d, eps, rms)
    dh, dw, db = norm_backward_rows(flat(grad_y), flat(grad_residual), h2d,
                                    None if weight is None else weight.reshape(n), bias_dtype, mean, rstd,
                                    rms, offset, weight_grads)
    shaped = lambda t: None if t is None else t.reshape(normalized_shape)  # noqa: E731
    return dh.view(h.shape), shaped(dw), shaped(db)


# Whole-tensor forms over the trailing `normalized_ndim` dims: the readable spec, used by
# tests and by users who want the reference without the registered ops.
def layer_norm(x: torch.Tensor, weight=None, bias=None, eps: float = 1e-5, normalized_ndim: int = 1):
    return _whole(x, None, weight, bias, eps, False, 0.0, normalized_ndim)[0]


def rms_norm(x: torch.Tensor, weight=None, eps: float = 1e-6, offset: float = 0.0, normalized_ndim: int = 1):
    return _whole(x, None, weight, None, eps, True, offset, normalized_ndim)[0]


def add_layer_norm(x, residual, weight=None, bias=None, eps: float = 1e-5, normalized_ndim: int = 1):
    return _whole(x, residual, weight, bias, eps, False, 0.0, normalized_ndim)


def add_rms_norm(x, residual, weight=None, eps: float = 1e-6, offset: float = 0.0, normalized_ndim: int = 1):
    return _whole(x, residual, weight, None, eps, True, offset, normalized_ndim)


def _whole(x, residual, weight, bias, eps, rms, offset, normalized_ndim):
    n = math.prod(x.shape[x.dim() - normalized_ndim:])
    rows = lambda t: None if t is None else t.reshape(-1, n)  # noqa: E731
    flat = lambda t: None if t is None else t.reshape(n)  # noqa: E731
    y, residual_out, _, _ = norm_forward_rows(rows(x), rows(residual), flat(weight), flat(bias), eps, rms, offset)
    y = y.view(x.shape)
    return y, (None if residual_out is None else residual_out.view(x.shape))
