"""Activations in plain PyTorch: the definition every backend must match.

    gelu       x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2))                   (exact, erf form)
    gelu_tanh  0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)    (torch's approximate="tanh")
    silu       x * sigmoid(x)
    relu       max(x, 0)

and the two fused forms built on them:

    bias + activation   y = act(x + bias)         bias (n,) along the last dim
    gated (GLU)         y = act(gate) * up        swiglu: act = silu, geglu: act = gelu

Accumulates in float32 (float64 for float64 input) and rounds once to the output dtype, as
a fused kernel does (x + bias is not rounded on the way). This is the CPU implementation
and, on float64 inputs, the test oracle.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from kernelforge.reference._accumulation import accumulation_dtype as _accumulation_dtype

KINDS = ("gelu", "gelu_tanh", "silu", "relu")

_SQRT1_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TANH_SCALE = math.sqrt(2.0 / math.pi)  # c in u = c (x + a x^3)
_TANH_CUBIC = 0.044715  # a


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown activation kind {kind!r}; expected one of {KINDS}")


# ----------------------------------------------------------------------------- the functions
# Each takes z in the accumulation dtype and returns act(z), act'(z) or act''(z) in it.
def activation_value(z: torch.Tensor, kind: str) -> torch.Tensor:
    _check_kind(kind)
    if kind == "gelu":
        return 0.5 * z * (1.0 + torch.erf(z * _SQRT1_2))
    if kind == "gelu_tanh":
        u = _TANH_SCALE * (z + _TANH_CUBIC * z * z * z)
        return 0.5 * z * (1.0 + torch.tanh(u))
    if kind == "silu":
        return z * torch.sigmoid(z)
    return torch.where(z < 0, torch.zeros_like(z), z)  # NaN stays NaN, as in torch.relu


def activation_derivative(z: torch.Tensor, kind: str) -> torch.Tensor:
    """act'(z):
    gelu       Phi(z) + z phi(z),  phi(z) = exp(-z^2/2) / sqrt(2 pi)
    gelu_tanh  0.5 (1 + t) + 0.5 z (1 - t^2) u',  t = tanh(u), u' = c (1 + 3a z^2)
    silu       s (1 + z (1 - s)),  s = sigmoid(z)
    relu       0 where z <= 0, else 1: 0 at z = 0 and 1 at NaN, as torch (its backward tests
               relu(z) <= 0, false for NaN, so the incoming gradient passes)
    """
    _check_kind(kind)
    if kind == "gelu":
        return 0.5 * (1.0 + torch.erf(z * _SQRT1_2)) + z * _INV_SQRT_2PI * torch.exp(-0.5 * z * z)
    if kind == "gelu_tanh":
        t = torch.tanh(_TANH_SCALE * (z + _TANH_CUBIC * z * z * z))
        du = _TANH_SCALE * (1.0 + 3.0 * _TANH_CUBIC * z * z)
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * du
    if kind == "silu":
        s = torch.sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    return (~(z <= 0)).to(z.dtype)


def activation_second_derivative(z: torch.Tensor, kind: str) -> torch.Tensor:
    """act''(z), for the double backward:
    gelu       phi(z) (2 - z^2)
    gelu_tanh  (1 - t^2) (u' - z t u'^2 + 0.5 z u''),  u'' = 6 c a z
    silu       s (1 - s) (2 + z (1 - 2s))
    relu       0
    """
    _check_kind(kind)
    if kind == "gelu":
        return _INV_SQRT_2PI * torch.exp(-0.5 * z * z) * (2.0 - z * z)
    if kind == "gelu_tanh":
        t = torch.tanh(_TANH_SCALE * (z + _TANH_CUBIC * z * z * z))
        du = _TANH_SCALE * (1.0 + 3.0 * _TANH_CUBIC * z * z)
        d2u = 6.0 * _TANH_SCALE * _TANH_CUBIC * z
        return (1.0 - t * t) * (du - z * t * du * du + 0.5 * z * d2u)
    if kind == "silu":
        s = torch.sigmoid(z)
        return s * (1.0 - s) * (2.0 + z * (1.0 - 2.0 * s))
    return torch.zeros_like(z)


def _preactivation(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """z = x + bias in the accumulation dtype (not rounded to x's dtype on the way)."""
    acc = _accumulation_dtype(x.dtype)
    z = x.to(acc)
    return z if bias is None else z + bias.to(acc)


# ----------------------------------------------------------------------------- public forms
def activation(x: torch.Tensor, kind: str, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """act(x + bias), bias None or broadcastable along x's last dim; x's dtype."""
    return activation_value(_preactivation(x, bias), kind).to(x.dtype)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return activation(x, "gelu_tanh" if approximate == "tanh" else "gelu")


def silu(x: torch.Tensor) -> torch.Tensor:
    return activation(x, "silu")


def relu(x: torch.Tensor) -> torch.Tensor:
    return activation(x, "relu")


def activation_backward(
    grad_output: torch.Tensor, x: torch.Tensor, kind: str, bias: Optional[torch.Tensor] = None,
    need_bias_grad: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gradients of y = act(x + bias) (bias along the last dim), recomputed from x:

        grad_x    = grad_y * act'(x + bias)                   x's dtype
        grad_bias = sum of grad_x over every dim but the last  bias's dtype, from unrounded grad_x
    """
    z = _preactivation(x, bias)
    grad_x = grad_output.to(z.dtype) * activation_derivative(z, kind)
    grad_bias = None
    if bias is not None and need_bias_grad:
        grad_bias = grad_x.reshape(-1, grad_x.shape[-1]).sum(0).to(bias.dtype)
    return grad_x.to(x.dtype), grad_bias


def glu(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    """Gated activation act(gate) * up (swiglu: kind "silu"; geglu: "gelu" or "gelu_tanh")."""
    acc = _accumulation_dtype(gate.dtype)
    return (activation_value(gate.to(acc), kind) * up.to(acc)).to(gate.dtype)


def glu_backward(
    grad_output: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of y = act(gate) * up:

        grad_gate = grad_y * up * act'(gate)
        grad_up   = grad_y * act(gate)
    """
    acc = _accumulation_dtype(gate.dtype)
    g, a = grad_output.to(acc), gate.to(acc)
    grad_gate = g * up.to(acc) * activation_derivative(a, kind)
    grad_up = g * activation_value(a, kind)
    return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return glu(gate, up, "silu")


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return glu(gate, up, "gelu_tanh" if approximate == "tanh" else "gelu")


# ----------------------------------------------------------------------------- row launchers
# The interface every backend of the activation ops implements. 2-D arguments are
# (rows, n) views with unit column stride; results are new dense (rows, n) tensors.
def act_forward_rows(x2d: torch.Tensor, bias: Optional[torch.Tensor], kind: str) -> torch.Tensor:
    return activation(x2d, kind, bias).contiguous()


def act_backward_rows(
    grad2d: torch.Tensor, x2d: torch.Tensor, bias: Optional[torch.Tensor], kind: str, need_bias_grad: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    grad_x, grad_bias = activation_backward(grad2d, x2d, kind, bias, need_bias_grad)
    return grad_x.contiguous(), grad_bias


def glu_forward_rows(gate2d: torch.Tensor, up2d: torch.Tensor, kind: str) -> torch.Tensor:
    return glu(gate2d, up2d, kind).contiguous()


def glu_backward_rows(
    grad2d: torch.Tensor, gate2d: torch.Tensor, up2d: torch.Tensor, kind: str,
    out: Optional[tuple[torch.Tensor, torch.Tensor]] = None, with_product: bool = False,
) -> tuple[torch.Tensor, ...]:
    """`out`, if given, is a (grad_gate2d, grad_up2d) pair of (rows, n) views to write into
    (the packed form's two halves of one gradient buffer); they are returned. with_product: also
    act(gate) * up, as glu_forward_rows gives it."""
    grad_gate, grad_up = glu_backward(grad2d, gate2d, up2d, kind)
    product = (glu_forward_rows(gate2d, up2d, kind),) if with_product else ()
    if out is None:
        return grad_gate.contiguous(), grad_up.contiguous(), *product
    out[0].copy_(grad_gate)
    out[1].copy_(grad_up)
    return (*out, *product)
