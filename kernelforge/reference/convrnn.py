"""ConvRNN in plain PyTorch: the definition every backend must match.

    h_0 = hidden;  h_t = tanh(x[:, t-1] + conv1d(h_{t-1}, kernel, padding=K // 2)),  t = 1..T

x is (batch, time, features), kernel (1, 1, K) with K odd (one channel: the same K taps slide
along the features, zero-padded at both ends), hidden (batch, features). The result is
(out, h_T) with out (batch, time, features) holding h_1..h_T.

The state is carried in float32 (float64 for float64 input) and each h_t is rounded once to
the input dtype on its way into `out`, as the fused kernels do. This is also the CPU
implementation, and on float64 inputs the test oracle.

Backward through time, with a_t = x[:, t-1] + conv(h_{t-1}) and g_t = dL/dh_t:
    g_T = grad_h_T + grad_out[:, T-1];  da_t = g_t * (1 - h_t^2);  dx[:, t-1] = da_t
    g_{t-1} = grad_out[:, t-2] + conv_transpose(da_t)   (the kernel flipped: a correlation)
    dkernel[j] = sum_t sum_(b, f) da_t[b, f] * h_{t-1}[b, f + j - K // 2]
    dhidden = g_0 = conv_transpose(da_1)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernelforge.reference._accumulation import accumulation_dtype as _state_dtype


def convrnn_forward(x: torch.Tensor, kernel: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, h_T): the loop over time with F.conv1d."""
    acc = _state_dtype(x.dtype)
    w = kernel.to(acc).reshape(1, 1, -1)
    pad = w.shape[-1] // 2
    h = hidden.to(acc, copy=True)  # a new tensor even when T = 0: outputs never alias inputs
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for t in range(x.shape[1] if x.shape[2] else 0):  # no features: nothing to compute (conv1d refuses it)
        h = torch.tanh(x[:, t].to(acc) + F.conv1d(h.unsqueeze(1), w, padding=pad).squeeze(1))
        out[:, t] = h
    return out, h.to(x.dtype)


def convrnn_backward(grad_out: torch.Tensor, grad_h: torch.Tensor, kernel: torch.Tensor, hidden: torch.Tensor,
                     out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dkernel, dhidden) from the gradients of (out, h_T) and the forward's out (h_1..h_T)."""
    acc = _state_dtype(out.dtype)
    w = kernel.to(acc).reshape(1, 1, -1)
    pad = w.shape[-1] // 2
    T = out.shape[1] if out.shape[0] and out.shape[2] else 0  # no rows or features: no terms (dkernel 0)
    dx = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    dw = torch.zeros(w.shape[-1], dtype=acc, device=out.device)
    g = grad_h.to(acc, copy=True)
    for t in range(T, 0, -1):  # t indexes h_t; out[:, t-1] is h_t
        h_t = out[:, t - 1].to(acc)
        h_prev = (out[:, t - 2] if t > 1 else hidden).to(acc)
        da = (g + grad_out[:, t - 1].to(acc)) * (1 - h_t * h_t)
        dx[:, t - 1] = da
        # dw[j] = sum_(b, f) da[b, f] h_prev[b, f + j - pad]: a correlation of h_prev with da
        # (one group per batch row: a (1, B, F + 2 pad) input against B filters of length F)
        dw += F.conv1d(F.pad(h_prev, (pad, pad)).unsqueeze(0), da.unsqueeze(1), groups=da.shape[0]).sum(dim=(0, 1))
        g = F.conv_transpose1d(da.unsqueeze(1), w, padding=pad).squeeze(1)
    return dx, dw.reshape(kernel.shape).to(kernel.dtype), g.to(hidden.dtype)
