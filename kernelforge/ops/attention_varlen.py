"""flash_attention_varlen: packed variable-length sequences (FlashAttention's varlen API).

Registered ops (kernelforge.ops._opdef.define_op: each with its fake and gradient, and a lean
eager call that skips the dispatcher):
    kernelforge::flash_attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q,
        Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float scale, int window_left,
        int window_right) -> (Tensor out, Tensor lse)
    kernelforge::flash_attention_varlen_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v,
        Tensor out, Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q,
        int max_seqlen_k, float scale, int window_left, int window_right) -> (Tensor dq, Tensor dk, Tensor dv)
q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv); out (total_q, H, Dv) in q's dtype,
lse (total_q, H) float32 (float64 for float64), not differentiable; every output dense.
causal and window travel as one band of key offsets, as in kernelforge::flash_attention
(window_left / window_right, -1 unbounded; causal bounds the right at 0).

Every backend implements `varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, scale, vis)` and `varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens_q,
cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, vis)`, vis a kernelforge.reference.attention.Visibility.

Under torch.compile:
  - triton: traceable (plain @triton.jit kernels through kernelforge.triton._launch.launch),
    except under the CPU interpreter;
  - reference: opaque. Its loop over sequences reads cu_seqlens on the host
    (kernelforge/reference/attention_varlen.py), which a graph cannot hold without a break, so
    the call stays one custom op (its fake at trace time): fullgraph=True works, the reference
    runs eagerly inside the compiled graph.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from kernelforge import backends
from kernelforge.ops._common import FLOAT_DTYPES, GPU_FLOAT_DTYPES, as_float, check_floating, check_same
from kernelforge.ops._opdef import define_op
from kernelforge.reference.attention import Visibility

OP = "attention_varlen"
NAME = "flash_attention_varlen"
SEQLEN_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------- dispatch
def _why_not_triton(q, k, v, backward=False):
    from kernelforge.triton import why_unavailable

    if q.dtype not in GPU_FLOAT_DTYPES:
        return f"Triton kernels take float32/float16/bfloat16, got {q.dtype}"
    from kernelforge.triton.attention_varlen import why_not

    return why_not(q, k, v) or why_unavailable(q.device)


def _why_not_reference(q, k, v, backward=False):
    return None


def _preference(q, k, v, backward=False):
    if q.device.type != "cuda":
        return ("reference",), "the reference is the CPU implementation"
    return ("triton", "reference"), "the Triton kernels read the sequence offsets on the device (no host sync)"


def _choice_key(q, k, v, backward=False):
    return q.device.type, q.dtype, k.dtype, v.dtype, q.shape[-1], v.shape[-1], backward


backends.register(OP, "triton", "kernelforge.triton.attention_varlen", _why_not_triton)
backends.register(OP, "reference", "kernelforge.reference.attention_varlen", _why_not_reference, traceable=False)
backends.register_alias(NAME, OP)
backends.set_preference(OP, _preference, _choice_key)


def _choose(q, k, v, backward: bool = False) -> backends.Choice:
    return backends.select(OP, q, k, v, backward=backward)


# ----------------------------------------------------------------------------- checks
def _fail(what: str) -> None:
    raise ValueError(f"kernelforge.{NAME}: {what}")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    names = ("q", "k", "v")
    for name, t in zip(names, (q, k, v)):
        check_floating(NAME, name, t, FLOAT_DTYPES)
        if t.dim() != 3:
            _fail(f"{name} must be 3-D (total_tokens, heads, head_dim), got shape {tuple(t.shape)}")
    check_same(NAME, "dtype", names, (q.dtype, k.dtype, v.dtype))
    check_same(NAME, "device", names, (q.device, k.device, v.device))
    H, D = q.shape[1], q.shape[2]
    if k.shape[:2] != v.shape[:2]:
        _fail(f"k and v must agree in (total_k, kv_heads), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[2] != D:
        _fail(f"q and k must have the same head_dim, got {D} and {k.shape[2]}")
    if D == 0:
        _fail(f"q and k must have a head_dim of at least 1, got q of shape {tuple(q.shape)}")
    if k.shape[1] == 0 or H % k.shape[1] != 0:
        _fail(f"the heads of k and v ({k.shape[1]}) must divide the heads of q ({H}) (grouped-query attention)")


def _check_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q: torch.Tensor) -> None:
    """Metadata only: the offsets' values stay on the device (no host sync), trusted as in FlashAttention."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"kernelforge.{NAME}: {name} must be a tensor of int32 or int64 offsets of shape "
                            f"(batch + 1,), got {type(cu).__name__}")
        if cu.dtype not in SEQLEN_DTYPES:
            raise TypeError(f"kernelforge.{NAME}: {name} must have dtype int32 or int64, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            _fail(f"{name} must have shape (batch + 1,), got {tuple(cu.shape)}")
        if cu.device != q.device:
            _fail(f"{name} must be on q's device {q.device}, got {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        _fail(f"cu_seqlens_q and cu_seqlens_k must have the same shape (batch + 1,), got "
              f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        # torch.compile passes a symbolic int once it sees the value change (automatic dynamic shapes)
        if isinstance(m, bool) or not isinstance(m, (int, torch.SymInt)) or (isinstance(m, int) and m < 0):
            _fail(f"{name} must be an int >= 0, got {m!r}")


def _check_window(window) -> tuple[int, int]:
    if window is None:
        return -1, -1
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        _fail(f"window must be a pair (left, right) of key counts, got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window):
        w = -1 if w is None else w
        if isinstance(w, bool) or not isinstance(w, int) or w < -1:
            _fail(f"window {side} must be an int >= 0, or -1 / None for unbounded, got {w!r}")
        out.append(w)
    return out[0], out[1]


def _band(causal: bool, window) -> tuple[int, int]:
    """(window_left, window_right) of the schema: -1 unbounded; causal bounds the right at 0."""
    left, right = _check_window(window)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _visibility(window_left: int, window_right: int) -> Visibility:
    return Visibility(None if window_left < 0 else window_left, None if window_right < 0 else window_right)


# ----------------------------------------------------------------------------- implementation
def _acc_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _no_work(q, k, v, cu_seqlens_q) -> bool:
    return q.numel() == 0 or k.shape[0] == 0 or v.shape[-1] == 0 or cu_seqlens_q.shape[0] < 2


def _no_kernel() -> backends.Choice:
    return backends.Choice(backends.implementations(OP)["reference"],
                           "no work: the outputs are zeros and -inf, made by torch ops")


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left, window_right):
    _check_qkv(q, k, v)
    _check_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q)
    if _no_work(q, k, v, cu_seqlens_q):
        lse = torch.full(q.shape[:2], -math.inf, dtype=_acc_dtype(q), device=q.device)
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1]), lse
    return _choose(q, k, v).implementation.launchers().varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
        _visibility(window_left, window_right))


def _choose_forward(q, k, v, cu_seqlens_q, *args) -> backends.Choice:
    return _no_kernel() if _no_work(q, k, v, cu_seqlens_q) else _choose(q, k, v)


def _fake_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left,
                  window_right):
    _check_qkv(q, k, v)
    _check_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q)
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1]), q.new_empty(q.shape[:2], dtype=_acc_dtype(q))


def _backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
              window_left, window_right):
    check_same(f"{NAME}_backward", "shape", ("grad_out", "out"), (tuple(grad_out.shape), tuple(out.shape)))
    if _no_work(q, k, v, cu_seqlens_q):
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    return _choose(q, k, v, backward=True).implementation.launchers().varlen_backward(
        grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
        _visibility(window_left, window_right))


def _choose_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, *args) -> backends.Choice:
    return _no_kernel() if _no_work(q, k, v, cu_seqlens_q) else _choose(q, k, v, backward=True)


def _fake_backward(grad_out, q, k, v, *args):
    check_same(f"{NAME}_backward", "shape", ("grad_out", "out"), (tuple(grad_out.shape), tuple(args[0].shape)))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ----------------------------------------------------------------------------- definitions
flash_attention_varlen_backward_op = define_op(
    "kernelforge::flash_attention_varlen_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
    "Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float scale, "
    "int window_left, int window_right) -> (Tensor, Tensor, Tensor)",
    impl=_backward, fake=_fake_backward, choose=_choose_backward)


def _save(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.mark_non_differentiable(lse)  # documented: lse carries no gradient
    ctx.set_materialize_grads(False)  # lse's gradient stays None, no zero fill
    ctx.args = tuple(rest)  # max_seqlen_q, max_seqlen_k, scale, window_left, window_right


def _gradient(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = flash_attention_varlen_backward_op(grad_out.contiguous(), q, k, v, out, lse, cu_seqlens_q,
                                                    cu_seqlens_k, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


flash_attention_varlen_op = define_op(
    "kernelforge::flash_attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    "int max_seqlen_q, int max_seqlen_k, float scale, int window_left, int window_right) -> (Tensor, Tensor)",
    impl=_forward, fake=_fake_forward, choose=_choose_forward, setup_context=_save, backward=_gradient)


# ----------------------------------------------------------------------------- public API
def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                           causal: bool = False, window: Optional[tuple[Optional[int], Optional[int]]] = None,
                           scale: Optional[float] = None, return_lse: bool = False):
    """Attention over packed variable-length sequences (flash_attn_varlen_func's convention).

    q: (total_q, heads, head_dim); k: (total_k, kv_heads, head_dim); v: (total_k, kv_heads,
    head_dim_v), kv_heads dividing heads (grouped-query attention). Any strides.
    cu_seqlens_q / cu_seqlens_k: (batch + 1,) int32 or int64 on q's device, cumulative offsets
        starting at 0: sequence b is q rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] and k / v rows
        cu_seqlens_k[b]:cu_seqlens_k[b + 1], and attends to its own keys only. Lengths may be 0.
    max_seqlen_q / max_seqlen_k: Python ints at least every sequence's length (the kernels'
        grid). As in FlashAttention they are trusted: the GPU path never reads cu_seqlens on
        the host (no sync; a call can be captured in a CUDA graph), so a max_seqlen below a
        length is not detected there and the rows past it are left as zeros. The CPU
        reference reads the offsets anyway and raises on it (and on malformed offsets).
    causal: query i of a sequence sees its keys j <= i + Lk - Lq (bottom-right aligned per
        sequence, as kernelforge.flash_attention and FlashAttention-2).
    window: (left, right): query i sees keys i + off - left ... i + off + right (off = Lk - Lq
        of its sequence); None or -1 leaves a side unbounded. Combines with causal.
    scale: multiplies q.k; default 1 / sqrt(head_dim).
    return_lse: also return the natural-log log-sum-exp (total_q, heads), float32 (float64 for
        float64 inputs); not differentiable.

    A row with no visible key (Lk = 0, or causal with Lq > Lk) gives zeros and lse -inf, and its
    gradient is zero; so do rows of q past cu_seqlens_q[-1], and keys past cu_seqlens_k[-1] get
    zero gradients. The backward is deterministic (no atomics).
    Returns out (total_q, heads, head_dim_v) in q's dtype [, lse].
    """
    _check_qkv(q, k, v)
    _check_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q)
    scale = float(q.shape[-1] ** -0.5) if scale is None else as_float(NAME, "scale", scale)
    left, right = _band(causal, window)
    out, lse = flash_attention_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                         left, right)
    return (out, lse) if return_lse else out


__all__ = ["flash_attention_varlen", "flash_attention_varlen_backward_op", "flash_attention_varlen_op"]
