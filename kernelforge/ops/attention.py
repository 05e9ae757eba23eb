"""flash_attention: schemas, input checks, fake implementations, autograd, dispatch.

Registered ops (kernelforge.ops._opdef.define_op: each with its fake and gradient, and a lean
eager call that skips the dispatcher):
    kernelforge::flash_attention(Tensor q, Tensor k, Tensor v, float scale, int window_left,
        int window_right, Tensor? attn_mask, Tensor[] block_mask, int block_q, int block_k,
        Tensor? cache_seqlens=None, Tensor? block_table=None) -> (Tensor out, Tensor lse)
    kernelforge::flash_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v,
        Tensor out, Tensor lse, float scale, int window_left, int window_right, Tensor? attn_mask,
        Tensor[] block_mask, int block_q, int block_k) -> (Tensor dq, Tensor dk, Tensor dv)
q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv); out (B, H, Sq, Dv) in q's dtype; lse
(B, H, Sq) float32 (float64 for float64), not differentiable. Every output is dense
(contiguous), whatever the inputs' strides. `causal` and `window` travel as one band of key
offsets (window_left / window_right, -1 = unbounded; causal sets window_right to at most 0).
attn_mask arrives expanded to 4-D (B or 1, H or 1, Sq, Sk). block_mask is a BlockMask's
tensors (kernelforge.block_mask.TENSOR_FIELDS order; empty for none) with its tile sizes.
cache_seqlens (B,) int32 / int64: a KV cache's filled lengths, read on the device only (a
decode step can be captured in a CUDA graph); inference only, so the backward has none.
block_table (B, max_blocks) int32 / int64, with cache_seqlens only: a paged cache, k and v page
pools (num_blocks, Hkv, page_size, D / Dv) (kernelforge/ops/attention_checks.py checks both).

Every backend implements `flash_forward(q, k, v, scale, vis)` and (Triton, reference)
`flash_backward(grad_out, q, k, v, out, lse, scale, vis)`, vis a
kernelforge.reference.attention.Visibility.

Under torch.compile a call is decomposed into its implementation where the backend `_choose`
returns for it is traceable, and stays one opaque custom op (its fake at trace time, the
implementation at run time) elsewhere:
  - reference: traceable (torch ops);
  - triton: traceable only where every launch of the call is a plain @triton.jit kernel through
    kernelforge.triton._launch.launch (the query-tiled forward, the flash-decoding kernels, the
    backward's three kernels). Where a Gluon kernel may run instead (Hopper: a sliding-window
    or BlockMask forward, and the fp16 / bf16 backward at head dims 64 and 128 without
    attn_mask; they build host-side TMA descriptors), the call is opaque. The rule is
    kernelforge.triton.attention.traceable, the same test the launchers route by, decided from
    shapes, dtypes, options and the device (never a data pointer), and it errs on the opaque
    side. backends.register's flag is per backend, so `_choose` returns such a call's triton
    Choice with an opaque copy of the Implementation;
  - cuda: opaque (a C++ extension).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from kernelforge import backends, tuning
from kernelforge.block_mask import TENSOR_FIELDS, BlockMask
from kernelforge.ops._common import FLOAT_DTYPES, GPU_FLOAT_DTYPES, as_float, check_floating, check_same
from kernelforge.ops._opdef import define_op
from kernelforge.ops.attention_checks import check_block_table, check_cache_seqlens, refuse_kv_cache_gradients
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
    if vis is not None and vis.block_table is not None:  # before seqlens, which it always comes with
        return "the CUDA kernel takes no block_table (a paged KV cache)"
    if vis is not None and vis.seqlens is not None:
        return "the CUDA kernel takes no cache_seqlens (KV cache lengths)"
    from kernelforge.cuda.attention import why_not

    return why_not(q, k, v) or why_unavailable("attention")


def _why_not_reference(q, k, v, vis=None, backward=False):
    return None


def _preference(q, k, v, vis=None, backward=False):
    if q.device.type != "cuda":
        return ("reference",), "the reference is the CPU implementation"
    return ("triton", "cuda", "reference"), "Triton's kernels have every option and a backward"


def _choice_key(q, k, v, vis=None, backward=False):
    masks = None if vis is None else (vis.attn_mask is not None, vis.block_mask is not None, vis.seqlens is not None,
                                      vis.block_table is not None)
    return q.device.type, q.dtype, k.dtype, v.dtype, q.shape[-1], v.shape[-1], masks, backward


backends.register(OP, "triton", "kernelforge.triton.attention", _why_not_triton)
backends.register_alias("flash_attention", OP)
backends.register(OP, "cuda", "kernelforge.cuda.attention", _why_not_cuda)
backends.register(OP, "reference", "kernelforge.reference.attention", _why_not_reference)
backends.set_preference(OP, _preference, _choice_key)
backends.set_tuning(OP, tuning.ATTENTION)  # measured on CUDA where it pays (kernelforge.tuning)

# id(Implementation) -> (it, a copy registered opaque): the triton Choice of a call the Gluon kernels may run
_OPAQUE: dict[int, tuple] = {}


def _opaque(choice: backends.Choice) -> backends.Choice:
    impl = choice.implementation
    entry = _OPAQUE.get(id(impl))
    if entry is None or entry[0] is not impl:
        entry = _OPAQUE[id(impl)] = (impl, dataclasses.replace(impl, traceable_when=False))
    return backends.Choice(entry[1], choice.reason)


def _choose(q, k, v, vis: Visibility, backward: bool = False) -> backends.Choice:
    """The backend that runs these inputs, its traceability per call (module docstring)."""
    choice = backends.select(OP, q, k, v, vis=vis, backward=backward)
    if choice.backend == "triton" and q.is_cuda and not choice.implementation.launchers().traceable(
            q, k, v, vis, backward):
        return _opaque(choice)
    return choice


# ----------------------------------------------------------------------------- checks
def _fail(what: str) -> None:
    raise ValueError(f"kernelforge.{NAME}: {what}")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, paged: bool = False) -> None:
    """paged: k and v are page pools (num_blocks, Hkv, page_size, D), their dim 0 not the batch."""
    qs, ks, vs = q.shape, k.shape, v.shape
    dtype = q.dtype
    if (len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and dtype in FLOAT_DTYPES and k.dtype == dtype
            and v.dtype == dtype and k.device == q.device and v.device == q.device and ks[:3] == vs[:3]
            and (paged or ks[0] == qs[0]) and ks[3] == qs[3] and qs[3] != 0 and ks[1] != 0 and qs[1] % ks[1] == 0):
        return  # valid inputs in one pass (this runs twice an eager call); else find what is wrong, below
    names = ("q", "k", "v")
    for name, t in zip(names, (q, k, v)):
        check_floating(NAME, name, t, FLOAT_DTYPES)
        if t.dim() != 4:
            layout = "(num_blocks, kv_heads, page_size, head_dim) with block_table" if paged and name != "q" else \
                "(batch, heads, seq, head_dim)"
            _fail(f"{name} must be 4-D {layout}, got shape {tuple(t.shape)}")
    check_same(NAME, "dtype", names, (q.dtype, k.dtype, v.dtype))
    check_same(NAME, "device", names, (q.device, k.device, v.device))
    B, H, Sq, D = q.shape
    if not paged and (k.shape[0] != B or v.shape[0] != B):
        _fail(f"q, k and v must have the same batch size, got {B}, {k.shape[0]} and {v.shape[0]}")
    if k.shape[:3] != v.shape[:3]:
        dims = "(num_blocks, kv_heads, page_size) as page pools" if paged else "(batch, heads, seq)"
        _fail(f"k and v must agree in {dims}, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[3] != D:
        _fail(f"q and k must have the same head_dim, got {D} and {k.shape[3]}")
    if D == 0:
        _fail(f"q and k must have a head_dim of at least 1, got q of shape {tuple(q.shape)}")
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


def _band(causal: bool, window) -> tuple[int, int]:
    """(window_left, window_right) of the schema: -1 unbounded; causal bounds the right at 0."""
    left, right = _check_window(window)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _visibility(q, k, window_left, window_right, attn_mask, block_mask, block_q, block_k,
                cache_seqlens=None, block_table=None) -> Visibility:
    bm = BlockMask(q.shape[2], k.shape[2], block_q, block_k, *block_mask) if block_mask else None
    return Visibility(None if window_left < 0 else window_left, None if window_right < 0 else window_right,
                      attn_mask, bm, cache_seqlens, block_table)


# ----------------------------------------------------------------------------- implementation
def _empty_outputs(q, v):
    B, H, Sq, _ = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.full((B, H, Sq), -math.inf, dtype=acc, device=q.device)
    return q.new_zeros(B, H, Sq, v.shape[-1]), lse


def _check_cache(q, k, v, masked: bool, cache_seqlens, block_table) -> None:
    """q, k, v and the KV-cache arguments (masked: an attn_mask or a block mask is given)."""
    _check_qkv(q, k, v, paged=block_table is not None)
    check_cache_seqlens(cache_seqlens, q)
    check_block_table(block_table, q, k, cache_seqlens, masked)


def _forward_vis(q, k, v, scale, window_left, window_right, attn_mask, block_mask, block_q, block_k,
                 cache_seqlens=None, block_table=None) -> Visibility:
    _check_cache(q, k, v, attn_mask is not None or len(block_mask) > 0, cache_seqlens, block_table)
    return _visibility(q, k, window_left, window_right, attn_mask, block_mask, block_q, block_k, cache_seqlens,
                       block_table)


def _no_work(q, k, v, backward: bool = False, block_table=None) -> bool:
    if backward:
        return q.numel() == 0 or k.numel() == 0 or v.numel() == 0
    keys = k.shape[2] if block_table is None else block_table.shape[1] * k.shape[2]  # a paged cache's capacity
    return q.numel() == 0 or keys == 0 or v.shape[-1] == 0


def _no_kernel() -> backends.Choice:
    """The choice for inputs without work: zeros and -inf in torch ops, whatever is forced."""
    return backends.Choice(backends.implementations(OP)["reference"],
                           "no work: the outputs are zeros and -inf, made by torch ops")


def _forward(q, k, v, scale, window_left, window_right, attn_mask, block_mask, block_q, block_k, cache_seqlens=None,
             block_table=None):
    vis = _forward_vis(q, k, v, scale, window_left, window_right, attn_mask, block_mask, block_q, block_k,
                       cache_seqlens, block_table)
    if _no_work(q, k, v, block_table=block_table):
        return _empty_outputs(q, v)
    return _choose(q, k, v, vis).implementation.launchers().flash_forward(q, k, v, scale, vis)


def _choose_forward(*args) -> backends.Choice:
    q, k, v = args[:3]
    vis = _forward_vis(*args)
    return _no_kernel() if _no_work(q, k, v, block_table=vis.block_table) else _choose(q, k, v, vis)


def _fake_forward(q, k, v, scale, window_left, window_right, attn_mask, block_mask, block_q, block_k,
                  cache_seqlens=None, block_table=None):
    _check_cache(q, k, v, attn_mask is not None or len(block_mask) > 0, cache_seqlens, block_table)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, H, Sq, _ = q.shape
    return q.new_empty(B, H, Sq, v.shape[-1]), q.new_empty(B, H, Sq, dtype=acc)


def _check_backward(grad_out, out) -> None:
    check_same(f"{NAME}_backward", "shape", ("grad_out", "out"), (tuple(grad_out.shape), tuple(out.shape)))


def _backward(grad_out, q, k, v, out, lse, scale, window_left, window_right, attn_mask, block_mask, block_q, block_k):
    _check_backward(grad_out, out)
    if _no_work(q, k, v, backward=True):
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    vis = _visibility(q, k, window_left, window_right, attn_mask, block_mask, block_q, block_k)
    return _choose(q, k, v, vis, backward=True).implementation.launchers().flash_backward(
        grad_out, q, k, v, out, lse, scale, vis)


def _choose_backward(grad_out, q, k, v, out, lse, scale, window_left, window_right, attn_mask, block_mask,
                     block_q, block_k) -> backends.Choice:
    if _no_work(q, k, v, backward=True):
        return _no_kernel()
    vis = _visibility(q, k, window_left, window_right, attn_mask, block_mask, block_q, block_k)
    return _choose(q, k, v, vis, backward=True)


def _fake_backward(grad_out, q, k, v, out, lse, scale, window_left, window_right, attn_mask, block_mask,
                   block_q, block_k):
    _check_backward(grad_out, out)
    # dense whatever the inputs' layout, as every backend returns them
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ----------------------------------------------------------------------------- definitions
flash_attention_backward_op = define_op(
    "kernelforge::flash_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "float scale, int window_left, int window_right, Tensor? attn_mask, Tensor[] block_mask, int block_q, "
    "int block_k) -> (Tensor, Tensor, Tensor)",
    impl=_backward, fake=_fake_backward, choose=_choose_backward)


def _save(ctx, inputs, output):
    q, k, v, scale, window_left, window_right, attn_mask, block_mask, block_q, block_k, *rest = inputs
    if any(t is not None for t in rest):  # cache_seqlens, block_table
        refuse_kv_cache_gradients()
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)  # documented: lse carries no gradient
    # lse's gradient stays None instead of a tensor of zeros (a fill kernel a backward); out's is
    # never None here (lse is not differentiable, so only out's gradient runs this node)
    ctx.set_materialize_grads(False)
    ctx.args = (scale, window_left, window_right, attn_mask, block_mask, block_q, block_k)


def _gradient(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward_op(grad_out.contiguous(), q, k, v, out, lse, *ctx.args)
    no_grad_block_mask = [None] * len(ctx.args[4])  # the schema's list input wants a list back
    # one gradient an input the call gave (a call may leave cache_seqlens to its default)
    return (dq, dk, dv, None, None, None, None, no_grad_block_mask, None, None, None, None)[
        :len(ctx.needs_input_grad)]


flash_attention_op = define_op(
    "kernelforge::flash_attention(Tensor q, Tensor k, Tensor v, float scale, int window_left, int window_right, "
    "Tensor? attn_mask, Tensor[] block_mask, int block_q, int block_k, Tensor? cache_seqlens=None, "
    "Tensor? block_table=None) -> (Tensor, Tensor)",
    impl=_forward, fake=_fake_forward, choose=_choose_forward, setup_context=_save, backward=_gradient)


# ----------------------------------------------------------------------------- public API
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: Optional[float] = None, attn_mask: Optional[torch.Tensor] = None,
                    window: Optional[tuple[Optional[int], Optional[int]]] = None,
                    block_mask: Optional[BlockMask] = None, return_lse: bool = False,
                    cache_seqlens: Optional[torch.Tensor] = None, block_table: Optional[torch.Tensor] = None):
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
    cache_seqlens: (batch,) int32 or int64 on q's device: k and v are a KV cache of capacity Sk
        filled to cache_seqlens[b] for batch b (flash_attn_with_kvcache's convention). Keys from
        cache_seqlens[b] on are ignored, and causal / window align to the filled length: off =
        cache_seqlens[b] - Sq, the Sq queries being the last Sq tokens written, so under causal
        query i sees key j iff j <= i + cache_seqlens[b] - Sq. The lengths are read on the
        device only (no host sync): a decode step can be captured in a CUDA graph and replayed
        after new lengths are written into the same tensor. A length above Sk is the caller's
        error (it is clamped to Sk on the device), a length of 0 gives zeros. Inference only:
        raises if a gradient would be needed (q, k or v requiring grad with grad mode on).
    block_table: (batch, max_blocks_per_seq) int32 (or int64) on q's device, with cache_seqlens:
        a paged KV cache (flash_attn_with_kvcache's block_table, vLLM's paged attention). k and v
        are then page pools (num_blocks, kv_heads, page_size, head_dim[_v]), and key j of batch
        b is slot j % page_size of page block_table[b, j // page_size]; the capacity is
        max_blocks_per_seq * page_size, and cache_seqlens, causal and window mean what they mean
        for a contiguous cache of that capacity. Any strides with a unit last dim: a
        FlashAttention pool (num_blocks, page_size, kv_heads, D) passes as .transpose(1, 2)
        without a copy. Entries for pages past a sequence's length are never used (pad them
        with anything); entries of filled pages must lie in [0, num_blocks) (not checked: that
        would read the table on the host). Inference only; attn_mask and block_mask are
        refused. Triton decodes a few query rows from the pages in place; other calls (the
        reference, a long chunk of queries) first gather the pages into a contiguous cache (a
        copy of max_blocks_per_seq pages per sequence).

    A row with no visible key (every key masked) gives zeros, not NaN, and its gradient is
    zero. The backward is deterministic (no atomics) and keeps O(seq) extra memory.
    Returns out (batch, heads, Sq, head_dim_v) in q's dtype [, lse].
    """
    # the KV-cache arguments first: a paged cache's k is a pool, which the masks' checks would misread
    _check_cache(q, k, v, attn_mask is not None or block_mask is not None, cache_seqlens, block_table)
    if (cache_seqlens is not None or block_table is not None) and torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad):
        refuse_kv_cache_gradients()
    scale = float(q.shape[-1] ** -0.5) if scale is None else as_float(NAME, "scale", scale)
    _check_block_mask(block_mask, q, k)
    left, right = _band(causal, window)
    attn_mask = _check_mask(attn_mask, q, k)
    if block_mask is None:
        tensors, block_q, block_k = [], 0, 0
    else:
        tensors = [getattr(block_mask, f) for f in TENSOR_FIELDS]
        block_q, block_k = block_mask.block_q, block_mask.block_k
    out, lse = flash_attention_op(q, k, v, scale, left, right, attn_mask, tensors, block_q, block_k, cache_seqlens,
                                  block_table)
    return (out, lse) if return_lse else out
