"""gated_mlp: a transformer's gated MLP, down(act(x Wg^T) * (x Wu^T)) (SwiGLU with silu, GeGLU
with gelu), whose backward computes the gated activation again instead of keeping it.

Registered ops (kernelforge.ops._opdef.define_op; each with a fake):
    kernelforge::gated_mlp(Tensor x, Tensor gate_weight, Tensor up_weight, Tensor down_weight, str kind,
        Tensor? residual=None) -> (Tensor out, Tensor gate, Tensor up)   gate and up: what the backward keeps
    kernelforge::gated_mlp_backward(Tensor grad_out, Tensor x, Tensor gate, Tensor up,
        Tensor gate_weight, Tensor up_weight, Tensor down_weight, str kind) -> (Tensor, Tensor, Tensor, Tensor)

Why: as three Linear layers and an activation, the MLP keeps x, gate, up (for the activation's
backward) and h = act(gate) * up (for the down projection's weight gradient): h is as large as
gate, about a fifth of what a Llama layer keeps. Here the backward makes h again from gate
and up, in the activation's backward kernel, which reads them anyway (one more write of rows x
intermediate elements, against the 2 x rows x hidden x intermediate FLOPs of each of the MLP's six
GEMMs), so a train step holds one tensor of (tokens x intermediate) less per layer: 128 MiB a layer
of Llama-3.2-1B at 4 x 2048 tokens. The grad_down GEMM then waits for that kernel: it runs after
grad_out @ down_weight, not before.

The GEMMs are torch's (cuBLAS: the same products as the unpatched model's Linear layers), the
gated activation and its gradient kernelforge's (kernelforge.ops.gated_activations: Triton on a
GPU, the reference on a CPU). Under torch.compile the op decomposes into both (Inductor launches
the Triton kernels) and its backward still recomputes h.
FLOPs: forward 6 T H I (three GEMMs of T rows, hidden H, intermediate I), backward 12 T H I, and
the activation in the forward and, with its gradient and the product again, in the backward.
A residual (a transformer layer's x + mlp(x)) is added by the down projection's GEMM (cuBLAS's
C = A B + C): one read of rows x out elements in its epilogue in place of an add kernel's two reads
and a write (33 us a layer of Llama-3.2-1B at 8192 tokens on an H200), and no launch.
"""
from __future__ import annotations

from typing import Optional

import torch

from kernelforge.ops._common import FLOAT_DTYPES, check_floating, check_same, follows_autocast, require
from kernelforge.ops._opdef import define_op
from kernelforge.ops.gated_activations import gated_activation_backward_and_product_op, gated_activation_op

NAME = "gated_mlp"
ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_tanh"}  # public name -> gated kind


def _check(name: str, x, gate_weight, up_weight, down_weight, kind: str, residual=None) -> None:
    if kind not in ACTIVATIONS.values():
        raise ValueError(f"kernelforge.{name}: activation must be one of {tuple(ACTIVATIONS)}, got {kind!r}")
    check_floating(name, "x", x, FLOAT_DTYPES)
    names = ("x", "gate_weight", "up_weight", "down_weight")
    tensors = (x, gate_weight, up_weight, down_weight)
    check_same(name, "dtype", names, tuple(t.dtype for t in tensors))
    check_same(name, "device", names, tuple(t.device for t in tensors))
    require(x.dim() >= 1, lambda: f"kernelforge.{name}: x must be (..., hidden), got a 0-d tensor")
    hidden = x.shape[-1]
    for arg, w in (("gate_weight", gate_weight), ("up_weight", up_weight)):
        require(w.dim() == 2 and w.shape[1] == hidden,
                lambda: f"kernelforge.{name}: {arg} must be (intermediate, {hidden}) for x of hidden size {hidden}, "
                        f"got {tuple(w.shape)}")
    require(tuple(up_weight.shape) == tuple(gate_weight.shape),
            lambda: f"kernelforge.{name}: up_weight must have gate_weight's shape {tuple(gate_weight.shape)}, got "
                    f"{tuple(up_weight.shape)}")
    require(down_weight.dim() == 2 and down_weight.shape[1] == gate_weight.shape[0],
            lambda: f"kernelforge.{name}: down_weight must be (out, {gate_weight.shape[0]}) for an intermediate "
                    f"size of {gate_weight.shape[0]}, got {tuple(down_weight.shape)}")
    if residual is not None:
        out_shape = (*x.shape[:-1], down_weight.shape[0])
        check_same(name, "dtype", ("x", "residual"), (x.dtype, residual.dtype))
        check_same(name, "device", ("x", "residual"), (x.device, residual.device))
        require(tuple(residual.shape) == out_shape,
                lambda: f"kernelforge.{name}: residual must have the output's shape {out_shape}, got "
                        f"{tuple(residual.shape)}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _forward(x, gate_weight, up_weight, down_weight, kind: str, residual=None):
    _check(NAME, x, gate_weight, up_weight, down_weight, kind, residual)
    gate = torch.matmul(x, gate_weight.t())
    up = torch.matmul(x, up_weight.t())
    h = gated_activation_op(gate, up, kind)
    if residual is None:
        return torch.matmul(h, down_weight.t()), gate, up
    out = torch.addmm(_rows(residual), _rows(h), down_weight.t())
    return out.view(residual.shape), gate, up


def _backward(grad_out, x, gate, up, gate_weight, up_weight, down_weight, kind: str):
    _check(f"{NAME}_backward", x, gate_weight, up_weight, down_weight, kind)
    # h = act(gate) * up again (the forward did not keep it), made by the activation's backward
    # kernel as it reads gate and up anyway: one write more there instead of a pass of its own
    grad_gate, grad_up, h = gated_activation_backward_and_product_op(
        torch.matmul(grad_out, down_weight), gate, up, kind)
    grad_down = _rows(grad_out).t() @ _rows(h)
    del h
    grad_x = (_rows(grad_gate) @ gate_weight).addmm_(_rows(grad_up), up_weight).view(x.shape)
    x2 = _rows(x)
    return grad_x, _rows(grad_gate).t() @ x2, _rows(grad_up).t() @ x2, grad_down


def _fake_forward(x, gate_weight, up_weight, down_weight, kind, residual=None):
    _check(NAME, x, gate_weight, up_weight, down_weight, kind, residual)
    inner = x.new_empty((*x.shape[:-1], gate_weight.shape[0]))
    return x.new_empty((*x.shape[:-1], down_weight.shape[0])), inner, torch.empty_like(inner)


def _fake_backward(grad_out, x, gate, up, gate_weight, up_weight, down_weight, kind):
    _check(f"{NAME}_backward", x, gate_weight, up_weight, down_weight, kind)
    return (torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(gate_weight),
            torch.empty_like(up_weight), torch.empty_like(down_weight))


def _save(ctx, inputs, output):
    x, gate_weight, up_weight, down_weight, kind, residual = inputs
    ctx.save_for_backward(x, output[1], output[2], gate_weight, up_weight, down_weight)
    ctx.mark_non_differentiable(output[1], output[2])  # gate and up: the backward's, not results
    ctx.kind = kind
    ctx.residual_given = residual is not None


def _gradient(ctx, grad_out, _grad_gate, _grad_up):
    x, gate, up, gate_weight, up_weight, down_weight = ctx.saved_tensors
    grads = gated_mlp_backward_op(grad_out, x, gate, up, gate_weight, up_weight, down_weight, ctx.kind)
    return (*grads, None, grad_out if ctx.residual_given else None)  # the residual's: the output's own


gated_mlp_backward_op = define_op(
    "kernelforge::gated_mlp_backward(Tensor grad_out, Tensor x, Tensor gate, Tensor up, Tensor gate_weight, "
    "Tensor up_weight, Tensor down_weight, str kind) -> (Tensor, Tensor, Tensor, Tensor)",
    impl=_backward, fake=_fake_backward)

gated_mlp_op = define_op(
    "kernelforge::gated_mlp(Tensor x, Tensor gate_weight, Tensor up_weight, Tensor down_weight, str kind, "
    "Tensor? residual=None) -> (Tensor, Tensor, Tensor)",
    impl=_forward, fake=_fake_forward, setup_context=_save, backward=_gradient, helper_outputs=(1, 2))


# every product, as three F.linear's; the residual too (added in the down projection's product)
@follows_autocast("x", "gate_weight", "up_weight", "down_weight", "residual")
def gated_mlp(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor,
              activation: str = "silu", residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """down(act(x @ gate_weight.T) * (x @ up_weight.T)): a Llama-style MLP (gate_proj, up_proj,
    down_proj without biases; activation "silu" for SwiGLU, "gelu" / "gelu_tanh" for GeGLU) whose
    backward recomputes the gated activation instead of keeping it (one (..., intermediate) tensor
    less held for the backward). x (..., hidden); gate_weight and up_weight (intermediate, hidden);
    down_weight (out, intermediate), as nn.Linear keeps them; one float dtype, one device.
    residual (..., out), optional: residual + the MLP's output, the add done by the down projection's
    GEMM (a transformer layer's x + mlp(norm(x)) in one op; under torch.autocast in autocast's dtype,
    as the products). Differentiable in x, the three weights and the residual."""
    for arg, t in (("x", x), ("gate_weight", gate_weight), ("up_weight", up_weight), ("down_weight", down_weight),
                   ("residual", residual)):
        if not isinstance(t, torch.Tensor) and not (arg == "residual" and t is None):
            raise TypeError(f"kernelforge.{NAME}: {arg} must be a tensor, got {type(t).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"kernelforge.{NAME}: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    return gated_mlp_op(x, gate_weight, up_weight, down_weight, ACTIVATIONS[activation], residual)[0]


__all__ = ["gated_mlp"]
