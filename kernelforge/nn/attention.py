"""Multi-head attention on kernelforge.flash_attention with a fused QKV projection, drop-in
where torch.nn.MultiheadAttention(batch_first=True) or an SDPA call is used.

Differences from torch.nn.MultiheadAttention, each of which raises rather than differ silently:
  - inputs are batch first (batch, seq, embed_dim), or unbatched (seq, embed_dim);
  - need_weights=True raises: flash attention never forms the attention weights (the
    default here is False; torch's is True, so `out, _ = mha(x, x, x)` works unchanged);
  - dropout > 0 raises in training mode: flash_attention has no dropout (eval mode is fine);
  - kdim/vdim != embed_dim, add_bias_kv and add_zero_attn are not supported.
One difference that does not raise: a query whose keys are all masked gives zeros, not NaN.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kernelforge.nn.norms import RMSNorm
from kernelforge.ops.attention import flash_attention

NAME = "kernelforge.nn.Attention"


def _mask_to_float(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MHA bool (True = hidden) -> additive (0 / -inf); a float mask is cast to dtype."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


class Attention(torch.nn.Module):
    """Multi-head (or grouped-query) self- and cross-attention.

    Parameters (state_dict keys): in_proj.weight ((num_heads + 2 * num_kv_heads) * head_dim,
    embed_dim), rows [q | k | v] as in MultiheadAttention's in_proj_weight; in_proj.bias;
    out_proj.weight / out_proj.bias; with qk_norm, q_norm.weight and k_norm.weight (head_dim).
    A MultiheadAttention state_dict (in_proj_weight / in_proj_bias) loads as it is.
    causal: every call is causal (forward's is_causal=True adds causality to one call).
    window: (left, right) sliding window of keys, as kernelforge.flash_attention takes it.
    qk_norm: RMSNorm over head_dim on q and k before attention (Qwen3 / OLMo-2 style).
    """

    # Attributes that code written for torch.nn.MultiheadAttention reads (nn.TransformerEncoderLayer's
    # checks); _qkv_same_embed_dim=False keeps torch's native fast path, which would bypass this
    # module's attention, away in eval mode.
    batch_first = True
    _qkv_same_embed_dim = False
    in_proj_weight = property(lambda self: self.in_proj.weight)
    in_proj_bias = property(lambda self: self.in_proj.bias)

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: Optional[int] = None, bias: bool = True,
                 causal: bool = False, dropout: float = 0.0, kdim: Optional[int] = None, vdim: Optional[int] = None,
                 qk_norm: bool = False, device=None, dtype=None, window=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or embed_dim % num_heads != 0:
            raise ValueError(f"{NAME}: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(f"{NAME}: num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads}) "
                             "(grouped-query attention)")
        for name, d in (("kdim", kdim), ("vdim", vdim)):
            if d is not None and d != embed_dim:
                raise ValueError(f"{NAME}: {name}={d} != embed_dim={embed_dim} is not supported: keys and values "
                                 "must have embed_dim features (the fused projection takes one input size)")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"{NAME}: dropout must be in [0, 1), got {dropout}")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.causal, self.dropout, self.window = causal, dropout, window
        factory = {"device": device, "dtype": dtype}
        self.in_proj = torch.nn.Linear(embed_dim, (num_heads + 2 * num_kv_heads) * self.head_dim, bias, **factory)
        self.out_proj = torch.nn.Linear(embed_dim, embed_dim, bias, **factory)
        self.q_norm = RMSNorm(self.head_dim, **factory) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, **factory) if qk_norm else None
        self._reset_parameters()
        self._register_load_state_dict_pre_hook(self._load_mha_keys)

    def _reset_parameters(self) -> None:
        # MultiheadAttention's initialization: xavier in-projection, zero biases.
        torch.nn.init.xavier_uniform_(self.in_proj.weight)
        for b in (self.in_proj.bias, self.out_proj.bias):
            if b is not None:
                torch.nn.init.zeros_(b)

    @staticmethod
    def _load_mha_keys(state_dict, prefix, *args) -> None:
        # torch.nn.MultiheadAttention checkpoints name the fused projection in_proj_weight / _bias.
        for old, new in (("in_proj_weight", "in_proj.weight"), ("in_proj_bias", "in_proj.bias")):
            if prefix + old in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)

    @classmethod
    def from_torch(cls, mha: torch.nn.MultiheadAttention) -> "Attention":
        """An Attention computing what `mha` computes (its weights copied, same device and dtype)."""
        unsupported = {"batch_first=False (this module takes (batch, seq, embed_dim) inputs: build the "
                       "MultiheadAttention with batch_first=True, or transpose its inputs)": not mha.batch_first,
                       "kdim/vdim != embed_dim": not mha._qkv_same_embed_dim,
                       "add_bias_kv=True": mha.bias_k is not None, "add_zero_attn=True": mha.add_zero_attn}
        for what, bad in unsupported.items():
            if bad:
                raise ValueError(f"{NAME}.from_torch: {what} is not supported")
        w = mha.in_proj_weight
        mine = cls(mha.embed_dim, mha.num_heads, bias=mha.in_proj_bias is not None, dropout=mha.dropout,
                   device=w.device, dtype=w.dtype)
        mine.load_state_dict(mha.state_dict())
        return mine.train(mha.training)

    def _project(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, self_attn: bool, shared_kv: bool):
        """(q (B, L, H*D), k (B, S, Hkv*D), v (B, S, Hkv*D))."""
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        w, b = self.in_proj.weight, self.in_proj.bias
        if self_attn:  # one GEMM
            return self.in_proj(query).split([nq, nkv, nkv], dim=-1)
        bq, bkv = (None, None) if b is None else (b[:nq], b[nq:])
        q = F.linear(query, w[:nq], bq)
        if shared_kv:  # one GEMM for k and v
            k, v = F.linear(key, w[nq:], bkv).split([nkv, nkv], dim=-1)
        else:
            bk, bv = (None, None) if bkv is None else bkv.split([nkv, nkv])
            k, v = F.linear(key, w[nq:nq + nkv], bk), F.linear(value, w[nq + nkv:], bv)
        return q, k, v

    def _mask(self, attn_mask, key_padding_mask, B: int, L: int, S: int, dtype) -> Optional[torch.Tensor]:
        """MHA's masks (True = hidden, float = added) -> flash_attention's (True = attend, float
        = added), broadcastable to (B, H, L, S)."""
        masks = []
        if attn_mask is not None:
            H = self.num_heads
            if attn_mask.dim() == 2 and attn_mask.shape == (L, S):
                masks.append(attn_mask)  # (L, S)
            elif attn_mask.dim() == 3 and attn_mask.shape == (B * H, L, S):
                masks.append(attn_mask.reshape(B, H, L, S))  # (B*H, L, S) -> (B, H, L, S), batch-major as MHA
            else:
                raise ValueError(f"{NAME}: attn_mask must have shape (L, S) = {(L, S)} or (batch * num_heads, L, S) "
                                 f"= {(B * H, L, S)}, got {tuple(attn_mask.shape)}")
        if key_padding_mask is not None:
            if key_padding_mask.shape != (B, S):
                raise ValueError(f"{NAME}: key_padding_mask must have shape (batch, S) = {(B, S)}, "
                                 f"got {tuple(key_padding_mask.shape)}")
            masks.append(key_padding_mask.reshape(B, 1, 1, S))  # (B, S) -> (B, 1, 1, S)
        for m in masks:
            if m.dtype != torch.bool and not m.is_floating_point():
                raise TypeError(f"{NAME}: attn_mask and key_padding_mask must be bool (True = masked out, as in "
                                f"torch.nn.MultiheadAttention) or float (added to the scores), got {m.dtype}")
        if not masks:
            return None
        if all(m.dtype == torch.bool for m in masks):
            hidden = masks[0] if len(masks) == 1 else masks[0] | masks[1]
            return ~hidden  # True = attend
        total = _mask_to_float(masks[0], dtype)
        return total if len(masks) == 1 else total + _mask_to_float(masks[1], dtype)

    def forward(self, query: torch.Tensor, key: Optional[torch.Tensor] = None, value: Optional[torch.Tensor] = None,
                *, attn_mask: Optional[torch.Tensor] = None, key_padding_mask: Optional[torch.Tensor] = None,
                need_weights: bool = False, is_causal: Optional[bool] = None, average_attn_weights: bool = True):
        """query (B, L, E), key / value (B, S, E) -> (out (B, L, E), None); unbatched (L, E) works too.

        key = value = None (or both `query` itself) is self-attention through the fused projection.
        attn_mask: (L, S) or (B * num_heads, L, S); key_padding_mask: (B, S). Bool masks: True =
        masked out (torch.nn.MultiheadAttention's convention); float masks are added to the scores.
        is_causal=True makes this call causal (False / None keep the module's `causal`); causal
        aligns to the bottom right when L != S (see kernelforge.flash_attention).
        average_attn_weights is accepted for signature compatibility and has no effect.
        """
        if need_weights:
            raise NotImplementedError(f"{NAME}: need_weights=True is not supported: flash attention never forms the "
                                      "attention weights; pass need_weights=False (torch.nn.MultiheadAttention's "
                                      "default is True)")
        if self.training and self.dropout > 0:
            raise NotImplementedError(f"{NAME}: dropout={self.dropout} in training mode is not supported: "
                                      "kernelforge.flash_attention has no dropout on the attention weights; build "
                                      "the module with dropout=0.0 (or use it in eval mode, where dropout is off)")
        if (key is None) != (value is None):
            raise ValueError(f"{NAME}: pass both key and value (cross-attention) or neither (self-attention)")
        key = query if key is None else key
        value = query if value is None else value
        self_attn, shared_kv = key is query and value is query, key is value  # before unsqueeze makes new objects
        unbatched = query.dim() == 2
        if unbatched:  # (L, E) -> (1, L, E)
            query, key, value = (t.unsqueeze(0) if t.dim() == 2 else t for t in (query, key, value))
            if key_padding_mask is not None and key_padding_mask.dim() == 1:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 3 or t.shape[-1] != self.embed_dim:
                raise ValueError(f"{NAME}: {name} must be (batch, seq, embed_dim={self.embed_dim}) or unbatched "
                                 f"(seq, embed_dim), got shape {tuple(t.shape)}")
        if key.shape[:2] != value.shape[:2] or key.shape[0] != query.shape[0]:
            raise ValueError(f"{NAME}: query, key and value must share the batch size and key and value the "
                             f"sequence length, got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        B, L, _ = query.shape
        S = key.shape[1]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim

        q, k, v = self._project(query, key, value, self_attn, shared_kv)  # (B, L, H*D), (B, S, Hkv*D), (B, S, Hkv*D)
        q = q.view(B, L, H, D)  # (B, L, H, D)
        k = k.view(B, S, Hkv, D)  # (B, S, Hkv, D)
        v = v.view(B, S, Hkv, D)  # (B, S, Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # RMSNorm over D
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, L, D), (B, Hkv, S, D), (B, Hkv, S, D)

        mask = self._mask(attn_mask, key_padding_mask, B, L, S, q.dtype)  # broadcasts to (B, H, L, S)
        y = flash_attention(q, k, v, causal=self.causal or bool(is_causal), attn_mask=mask,
                            window=self.window)  # (B, H, L, D)
        y = y.transpose(1, 2).reshape(B, L, self.embed_dim)  # (B, L, H*D)
        y = self.out_proj(y)  # (B, L, E)
        return (y.squeeze(0) if unbatched else y), None

    def extra_repr(self) -> str:
        extra = [f"num_kv_heads={self.num_kv_heads}"] if self.num_kv_heads != self.num_heads else []
        extra += [f"{k}={v!r}" for k, v in (("causal", self.causal), ("dropout", self.dropout),
                                            ("window", self.window)) if v]
        return ", ".join([f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}"] + extra)
