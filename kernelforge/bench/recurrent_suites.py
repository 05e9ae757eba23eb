"""The ConvRNN suite: the fused kernels (all T steps in one launch) against the loop over time
that PyTorch runs step by step (kernelforge's reference, and the same loop in the input dtype,
as a user would write it), T = 16 ... 4096, features 64 ... 4096 (issue 7).

No torch.compile baseline: compiling a Python loop of thousands of steps unrolls it (minutes of
compile time for one case), and a loop of T graph launches is what eager already measures.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernelforge as kf
from kernelforge.bench.roofline import Cost
from kernelforge.bench.suite_types import Suite

# (batch, time, features, taps)
SHAPES = [(8, 16, 64, 3), (8, 16, 4096, 3), (8, 256, 1024, 3), (8, 4096, 64, 3), (8, 4096, 1024, 3),
          (8, 4096, 4096, 3)]
QUICK_SHAPES = [(2, 8, 33, 3)]
# The loops take up to ~0.1 s (forward) and ~0.5 s (forward+backward) a call at 4096 steps
MAX_REPEAT = 10


def _inputs(shape, dtype: torch.dtype, device: torch.device) -> tuple:
    B, T, Fe, K = shape
    return (torch.randn(B, T, Fe, device=device, dtype=dtype), torch.randn(1, 1, K, device=device, dtype=dtype) / K,
            torch.randn(B, Fe, device=device, dtype=dtype))


def _cost(shape, dtype: torch.dtype, direction: str) -> Cost:
    # forward: x read, out written (hidden and h_T: one row each); backward adds grad_out and out
    # read and dx written. FLOPs: 2K + ~20 (tanh) a feature a step, recorded, not a ceiling.
    B, T, Fe, K = shape
    steps = B * T * Fe
    tensors = 2 if direction == "fwd" else 5
    flops = (2 * K + 20) * steps * (1 if direction == "fwd" else 3)
    return Cost((tensors * steps + 2 * B * Fe) * dtype.itemsize, flops)


def _eager_loop(x: torch.Tensor, kernel: torch.Tensor, hidden: torch.Tensor):
    """The loop a user writes ("torch eager"): one conv1d, add and tanh a step, in the input dtype."""
    h, outs = hidden, []
    for t in range(x.shape[1]):
        h = torch.tanh(x[:, t] + F.conv1d(h.unsqueeze(1), kernel, padding=kernel.shape[-1] // 2).squeeze(1))
        outs.append(h)
    return torch.stack(outs, 1), h


def recurrent_suites() -> dict:
    return {"convrnn": Suite(
        op="convrnn", shapes=SHAPES, quick_shapes=QUICK_SHAPES, make_inputs=_inputs, cost=_cost,
        kernelforge=kf.convrnn, baselines=lambda: {"torch eager": _eager_loop},
        support_args=lambda inputs, direction: ((inputs[0], inputs[1]), {}),
        label=lambda s: f"B{s[0]} T{s[1]} F{s[2]} K{s[3]}", max_repeat=MAX_REPEAT,
    )}
