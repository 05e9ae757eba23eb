"""flash_attention's KV-cache arguments: the checks of cache_seqlens and of a paged cache's
block_table (kernelforge/ops/attention.py calls them from the public function, the registered op's
implementation and its fake alike).

Only metadata is read (shape, dtype, device): the lengths and the table's entries stay on the
device, so a decode step keeps no host sync and can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import Optional

import torch

NAME = "flash_attention"
SEQLEN_DTYPES = (torch.int32, torch.int64)
BLOCK_TABLE_DTYPES = (torch.int32, torch.int64)


def fail(what: str) -> None:
    raise ValueError(f"kernelforge.{NAME}: {what}")


def check_cache_seqlens(cache_seqlens: Optional[torch.Tensor], q: torch.Tensor) -> None:
    """Metadata only: the values stay on the device (a caller's length above Sk is clamped there)."""
    if cache_seqlens is None:
        return
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"kernelforge.{NAME}: cache_seqlens must be a tensor of int32 or int64 lengths of shape "
                        f"(batch,), got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype not in SEQLEN_DTYPES:
        raise TypeError(f"kernelforge.{NAME}: cache_seqlens must have dtype int32 or int64, got {cache_seqlens.dtype}")
    if cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != q.shape[0]:
        fail(f"cache_seqlens must have shape (batch,) = ({q.shape[0]},), got {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != q.device:
        fail(f"cache_seqlens must be on q's device {q.device}, got {cache_seqlens.device}")


def check_block_table(block_table: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                      cache_seqlens: Optional[torch.Tensor], masked: bool) -> None:
    """A paged cache: block_table (batch, max_blocks) int32 / int64 on q's device, k and v page
    pools (num_blocks, kv_heads, page_size, head_dim) (their agreement with each other and with q
    is the caller's _check_qkv, run with paged=True). masked: attn_mask or block_mask was given,
    which a paged call does not take (their key axis would be the table's capacity, a layout no
    caller has at hand)."""
    if block_table is None:
        return
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"kernelforge.{NAME}: block_table must be a tensor of int32 page indices of shape "
                        f"(batch, max_blocks_per_seq), got {type(block_table).__name__}")
    if block_table.dtype not in BLOCK_TABLE_DTYPES:
        raise TypeError(f"kernelforge.{NAME}: block_table must have dtype int32 (or int64), got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0]:
        fail(f"block_table must have shape (batch, max_blocks_per_seq) with batch = {q.shape[0]} (q's), "
             f"got {tuple(block_table.shape)}")
    if block_table.device != q.device:
        fail(f"block_table must be on q's device {q.device}, got {block_table.device}")
    if cache_seqlens is None:
        fail("block_table needs cache_seqlens (the filled length of each sequence in its pages), got None")
    if k.shape[2] < 1:
        fail(f"the page size (dim 2 of the k and v pools (num_blocks, kv_heads, page_size, head_dim)) must be "
             f"positive, got k of shape {tuple(k.shape)}")
    if k.shape[0] < 1 and block_table.shape[1] > 0:
        fail(f"the k and v pools have no pages (num_blocks = 0) for a block_table of shape "
             f"{tuple(block_table.shape)}")
    if masked:
        fail("block_table takes causal and window only, not attn_mask or block_mask")


def refuse_kv_cache_gradients() -> None:
    raise NotImplementedError(
        f"kernelforge.{NAME}: gradients with cache_seqlens are not computed (a KV cache is for inference, as in "
        "flash_attn_with_kvcache): call it under torch.no_grad() or torch.inference_mode(), or pass q, k and v "
        "detached")
