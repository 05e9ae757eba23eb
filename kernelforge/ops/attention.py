"""flash_attention: schema, input checks, fake implementation, autograd, dispatch.

Registered ops (each with a fake implementation):
    kernelforge::flash_attention(q, k, v, scale, window_left, window_right, attn_mask?,
        block_mask?, block_q, block_k) -> (out, lse)
    kernelforge::flash_attention_backward(grad_out, q, k, v, out, lse, scale, window_left,
        window_right, attn_mask?, block_mask?, block_q, block_k) -> (dq, dk, dv)
q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv); out (B, H, Sq, Dv) in q's dtype; lse
(B, H, Sq) float32 (float64 for float64). Every output is dense (contiguous), whatever the
inputs' strides. `causal` and `window` travel as one band of key
offsets (window_left / window_right, -1 = unbounded; causal sets window_right to at most 0).
attn_mask arrives expanded to 4-D (B or 1, H or 1, Sq, Sk). block_mask is a BlockMask's
tensors (kernelforge.block_mask._TENSOR_FIELDS order; empty for none) with its tile sizes.

Every backend implements `flash_forward(q, k, v, scale, vis)` and (Triton, reference)
`flash_backward(grad_out, q, k, v, out, lse, scale, vis)`, vis a
kernelforge.reference.attention.Visibility.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from kernelforge import backends
from kernelforge.block_mask import _TENSOR_FIELDS, BlockMask
from kernelforge.ops._common import (FLOAT_DTYPES, GPU_FLOAT_DTYPES, check_floating, check_same, not_a_view,
                                     plain_eager_call)
from kernelforge.reference.attention import Visibility

OP = "attention"
NAME = "flash_attention"


# ----------------------------------------------------------------------------- dispatch
def _why_not_triton(q, k, v, vis=None, backward=False):
    from kernelforge.triton import why_unavailable

    if q.dtype not in GPU_FLOAT_DTYPES:
        return f"Triton kernels take float32/float16/bfloat16, got {q.dtype}"
    from kernelforge.triton.attention import why_not

    return why_not(q, k, v) or why_unavailable(q.device)


def _why_not_cuda(q, k, v, vis=None, backward=False):
    from kernelforge.cuda import why_unavailable

    if q.device.type != "cuda":
        return f"the CUDA extension runs on CUDA tensors, got a {q.device.type} tensor"
    if backward:
        return "the CUDA backend has a forward kernel only (the backward runs on Triton)"
    if vis is not None and (vis.attn_mask is not None or vis.block_mask is not None):
        return "the CUDA kernel takes causal and window masks only, not attn_mask or block_mask"
    from kernelforge.cuda.attention import why_not

    return why_not(q, k, v) or why_unavailable("attention")


def _why_not_reference(q, k, v, vis=None, backward=False):
    return None


def _preference(q, k, v, vis=None, backward=False):
    if q.device.type != "cuda":
        return ("reference",), "the reference is the CPU implementation"
    return ("triton", "cuda", "reference"), "Triton's kernels have every option and a backward"


def _choice_key(q, k, v, vis=None, backward=False):
    masks = None if vis is None else (vis.attn_mask is not None, vis.block_mask is not None)
    return q.device.type, q.dtype, k.dtype, v.dtype, q.shape[-1], v.shape[-1], masks, backward


backends.register(OP, "triton", "kernelforge.triton.attention", _why_not_triton)
backends.register(OP, "cuda", "kernelforge.cuda.attention", _why_not_cuda)
backends.register(OP, "reference", "kernelforge.reference.attention", _why_not_reference)
backends.set_preference(OP, _preference, _choice_key)


# ----------------------------------------------------------------------------- checks
def _fail(what: str) -> None:
    raise ValueError(f"kernelforge.{NAME}: {what}")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    names = ("q", "k", "v")
    for name, t in zip(names, (q, k, v)):
        check_floating(NAME, name, t, FLOAT_DTYPES)
        if t.dim() != 4:
            _fail(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    check_same(NAME, "dtype", names, (q.dtype, k.dtype, v.dtype))
    check_same(NAME, "device", names, (q.device, k.device, v.device))
    B, H, Sq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        _fail(f"q, k and v must have the same batch size, got {B}, {k.shape[0]} and {v.shape[0]}")
    if k.shape[:3] != v.shape[:3]:
        _fail(f"k and v must agree in (batch, heads, seq), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[3] != D:
        _fail(f"q and k must have the same head_dim, got {D} and {k.shape[3]}")
    if k.shape[1] == 0 or H % k.shape[1] != 0:
        _fail(f"the heads of k and v ({k.shape[1]}) must divide the heads of q ({H}) "
              "(grouped-query attention)")


def _check_window(window) -> tuple[int, int]:
    if window is None:
        return -1, -1
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        _fail(f"window must be a pair (left, right) of key counts, got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window):
        if w is None:
            w = -1
        if not isinstance(w, int) or w < -1:
            _fail(f"window {side} must be an int >= 0, or -1 / None for unbounded, got {w!r}")
        out.append(w)
    return out[0], out[1]


def _check_mask(attn_mask: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor) -> Optional[torch.Tensor]:
    """attn_mask expanded to (B or 1, H or 1, Sq, Sk): a view, no copy."""
    if attn_mask is None:
        return None
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in FLOAT_DTYPES:
        raise TypeError(f"kernelforge.{NAME}: attn_mask must be bool (True = attend) or a float additive "
                        f"mask, got {attn_mask.dtype}")
    if attn_mask.device != q.device:
        _fail(f"attn_mask must be on q's device {q.device}, got {attn_mask.device}")
    if attn_mask.dim() > 4:
        _fail(f"attn_mask must broadcast to (B, H, Sq, Sk) = {(B, H, Sq, Sk)}, got shape {tuple(attn_mask.shape)}")
    shape = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
    target = (B, H, Sq, Sk)
    if any(s not in (1, t) for s, t in zip(shape, target)):
        _fail(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, Sq, Sk) = {target}")
    if attn_mask.requires_grad:
        raise NotImplementedError(f"kernelforge.{NAME}: gradients with respect to attn_mask are not computed; "
                                  "pass attn_mask.detach()")
    return attn_mask.reshape(shape).expand(shape[0], shape[1], Sq, Sk)


def _check_block_mask(block_mask, q: torch.Tensor, k: torch.Tensor) -> None:
    if block_mask is None:
        return
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"kernelforge.{NAME}: block_mask must be a kernelforge.BlockMask, got {type(block_mask)}")
    Bm, Hm, Sq, Sk = block_mask.shape
    B, H = q.shape[:2]
    if (Sq, Sk) != (q.shape[2], k.shape[2]) or Bm not in (1, B) or Hm not in (1, H):
        _fail(f"block_mask covers (B, H, Sq, Sk) = {block_mask.shape} but the inputs are "
              f"{(B, H, q.shape[2], k.shape[2])} (B and H may be 1 in the mask)")
    if block_mask.device != q.device:
        _fail(f"block_mask must be on q's device {q.device}, got {block_mask.device} (use block_mask.to(device))")
    # the kernels index the tile lists and the partial bits with 32-bit offsets
    for name in ("kv_blocks", "partial_masks"):
        if getattr(block_mask, name).numel() >= 2 ** 31:
            _fail(f"block_mask.{name} has {getattr(block_mask, name).numel()} entries, the kernels take under 2^31 "
                  f"(use larger tiles, or a mask shared across batch and heads)")


def _visibility(q, window_left, window_right, attn_mask, block_mask, block_q, block_k, k) -> Visibility:
    bm = BlockMask(q.shape[2], k.shape[2], block_q, block_k, *block_mask) if block_mask else None
    return Visibility.of(False, (window_left, window_right), attn_mask, bm)


# ----------------------------------------------------------------------------- implementation
def _launchers(q, k, v, vis, backward=False):
    return backends.select(OP, q, k, v, vis=vis, backward=backward).implementation.launchers()


def _forward(q, k, v, scale, vis):
    B, H, Sq, _ = q.shape
    if q.numel() == 0 or k.shape[2] == 0 or v.shape[-1] == 0:
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse = torch.full((B, H, Sq), -math.inf, dtype=acc, device=q.device)
        return q.new_zeros(B, H, Sq, v.shape[-1]), lse
    out, lse = _launchers(q, k, v, vis).flash_forward(q, k, v, scale, vis)
    # not a view (ops._common.not_a_view): in-place ops on it work as on torch's outputs
    return not_a_view(out), lse


def _backward(grad_out, q, k, v, out, lse, scale, vis):
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    return _launchers(q, k, v, vis, backward=True).flash_backward(grad_out, q, k, v, out, lse, scale, vis)


def _fake_forward(q, k, v):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, H, Sq, _ = q.shape
    return q.new_empty(B, H, Sq, v.shape[-1]), q.new_empty(B, H, Sq, dtype=acc)


@torch.library.custom_op("kernelforge::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, scale: float, window_left: int, window_right: int, attn_mask: Optional[torch.Tensor],
    block_mask: list[torch.Tensor], block_q: int, block_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    vis = _visibility(q, window_left, window_right, attn_mask, block_mask, block_q, block_k, k)
    return _backward(grad_out, q, k, v, out, lse, scale, vis)


@flash_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, scale, window_left, window_right, attn_mask, block_mask, block_q, block_k):
    check_same(f"{NAME}_backward", "shape", ("grad_out", "out"), (tuple(grad_out.shape), tuple(out.shape)))
    # dense whatever the inputs' layout, as every backend returns them
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.custom_op("kernelforge::flash_attention", mutates_args=())
def flash_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window_left: int, window_right: int,
    attn_mask: Optional[torch.Tensor], block_mask: list[torch.Tensor], block_q: int, block_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_qkv(q, k, v)
    vis = _visibility(q, window_left, window_right, attn_mask, block_mask, block_q, block_k, k)
    return _forward(q, k, v, scale, vis)


@flash_attention_op.register_fake
def _(q, k, v, scale, window_left, window_right, attn_mask, block_mask, block_q, block_k):
    _check_qkv(q, k, v)
    return _fake_forward(q, k, v)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, window_left, window_right, attn_mask, block_mask, block_q, block_k = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)  # documented: lse carries no gradient
    ctx.args = (scale, window_left, window_right, attn_mask, block_mask, block_q, block_k)


def _grad(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward_op(grad_out.contiguous(), q, k, v, out, lse, *ctx.args)
    no_grad_block_mask = [None] * len(ctx.args[4])  # the schema's list input wants a list back
    return dq, dk, dv, None, None, None, None, no_grad_block_mask, None, None


flash_attention_op.register_autograd(_grad, setup_context=_setup_context)


class _EagerAutograd(torch.autograd.Function):
    """The registered op's autograd without the dispatcher, for plain eager calls (the
    dispatcher and Python custom-op glue cost tens of microseconds a call)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, vis):
        out, lse = _forward(q, k, v, scale, vis)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.vis = scale, vis
        ctx.mark_non_differentiable(lse)
        # lse's gradient stays None instead of a tensor of zeros (a fill kernel a backward); out's
        # is never None here (lse is not differentiable, so only out's gradient runs this node)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(grad_out.contiguous(), q, k, v, out, lse, ctx.scale, ctx.vis)
        return dq, dk, dv, None, None


# ----------------------------------------------------------------------------- public API
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: Optional[float] = None, attn_mask: Optional[torch.Tensor] = None,
                    window: Optional[tuple[Optional[int], Optional[int]]] = None,
                    block_mask: Optional[BlockMask] = None, return_lse: bool = False):
    """Scaled dot-product attention without the Sq x Sk score matrix (FlashAttention-2).

    q: (batch, heads, Sq, head_dim); k: (batch, kv_heads, Sk, head_dim); v: (batch, kv_heads,
    Sk, head_dim_v), kv_heads dividing heads (grouped-query / multi-query attention).
    causal: query i sees keys j <= i + Sk - Sq (aligned to the bottom right, as
        FlashAttention-2 does when Sq != Sk).
    scale: multiplies q.k; default 1 / sqrt(head_dim).
    attn_mask: bool (True = attend) or float (added to the scores), broadcastable to
        (batch, heads, Sq, Sk). Not differentiated.
    window: (left, right) sliding window: query i sees keys i + off - left ... i + off + right
        (off = Sk - Sq); None or -1 leaves that side unbounded. Combines with causal.
    block_mask: a kernelforge.BlockMask: tiles it marks empty are skipped.
    return_lse: also return the natural-log log-sum-exp of each row's scores (batch, heads, Sq),
        float32 (float64 for float64 inputs); it is not differentiable.

    A row with no visible key (every key masked) gives zeros, not NaN, and its gradient is
    zero. The backward is deterministic (no atomics) and keeps O(seq) extra memory.
    Returns out (batch, heads, Sq, head_dim_v) in q's dtype [, lse].
    """
    _check_qkv(q, k, v)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    _check_block_mask(block_mask, q, k)
    vis = Visibility.of(causal, _check_window(window), _check_mask(attn_mask, q, k), block_mask)
    if plain_eager_call(q, k, v):
        if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
            out, lse = _EagerAutograd.apply(q, k, v, scale, vis)
        else:
            out, lse = _forward(q, k, v, scale, vis)
    else:
        tensors = [] if block_mask is None else [getattr(block_mask, f) for f in _TENSOR_FIELDS]
        bq, bk = (0, 0) if block_mask is None else (block_mask.block_q, block_mask.block_k)
        left, right = (-1 if w is None else w for w in (vis.left, vis.right))
        out, lse = torch.ops.kernelforge.flash_attention(q, k, v, scale, left, right, vis.attn_mask, tensors, bq, bk)
    return (out, lse) if return_lse else out
