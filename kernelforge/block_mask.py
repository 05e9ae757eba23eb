"""BlockMask: which (query tile, key tile) pairs of an attention are computed.

An attention of Sq queries and Sk keys is cut into tiles of block_q x block_k. Each tile
is one of three kinds:
  empty    no visible (query, key) pair: the kernels never load it;
  full     every pair visible: the kernels compute it without per-element masking;
  partial  some pairs visible: the kernels compute it and apply the tile's element bits.

Build one from a mask function (`BlockMask.from_mask_function`, with FlexAttention's
mask_mod signature `fn(b, h, q_idx, kv_idx) -> bool tensor`), from a dense boolean mask
(`BlockMask.from_dense`), or from a pattern: `sliding_window_block_mask`,
`local_global_block_mask`, `dilated_block_mask`. Pass it as
`kernelforge.flash_attention(q, k, v, block_mask=...)`.

How it differs from FlexAttention's BlockMask: Flex stores the same per-row lists of key
tiles (kv_num_blocks / kv_indices, with the full tiles apart) but keeps the mask function
itself, which Inductor compiles into the attention kernel and evaluates on every element of
a partial tile (and it adds score_mod). This BlockMask instead stores the element bits of
each partial tile (one byte per element, block_q * block_k bytes a partial tile), so any
Python mask function works in eager mode with no code generation, at a memory cost that
grows with the number of partial tiles (for a sliding window of S tokens: about 2*S/block_q
partial tiles, 1 MiB at S=8192 with 64x64 tiles), and the mask is evaluated once when the
BlockMask is built, not in every kernel. Flex's tiles default to 128 x 128; these default to
64 x 64, the kernels' own tile (DEFAULT_BLOCK says why).

Layout (Bm, Hm are 1 or the batch / head count, broadcast like a mask):
  kv_counts  (Bm, Hm, QB)      int32  tiles to visit for query tile qb
  kv_full    (Bm, Hm, QB)      int32  how many of them are full: they come first in the list
  kv_blocks  (Bm, Hm, QB, KB)  int32  their key-tile indices: the full tiles ascending, then
                                      the partial ones ascending (first kv_counts valid)
  kv_partial (Bm, Hm, QB, KB)  int32  for each listed tile, -1 if full, else its partial id
  q_counts, q_full, q_blocks, q_partial: the same lists per key tile (the transpose), which
      the backward's dK/dV pass walks
The kernels walk the full tiles in one loop without per-element masking or branches (so
their loads pipeline), then the partial ones. A tile is full only when it lies wholly
inside Sq x Sk: tiles at the tails are partial, so the full loop needs no bounds checks.
  partial_masks (P, block_q, block_k) uint8: element bits of partial tile p (rows past Sq
      and columns past Sk are 0)
  partial_words (P, block_q, ceil(block_k / 64)) int64: the same bits, 64 columns a word (the
      Gluon forward and dQ read a row of a 64-key tile in one load)
  partial_words_t (P, block_k, ceil(block_q / 64)) int64: the transpose's bits, 64 query rows a
      word for each key (the Gluon dK/dV kernel, whose score tiles run keys down, reads a key's
      bits over a 64-row query tile in one load)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

MaskFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
EMPTY, FULL = -2, -1  # tile kinds in the dense kind table; >= 0 is a partial id
# Mask tiles default to the Gluon forward's and the Triton backward's 64 x 64 kernel tile: a
# coarser mask tile makes the kernels walk its empty sub-tiles. Measured on an H200 (S = 8192,
# 2 x 16 heads, d128, bf16; benchmarks/results/nvidia-h200/0.1.0/attention/block-mask-experiment/),
# 64 x 64 against 128 x 128 tiles, forward and forward+backward (the backward at one stage
# then): a causal window of 512 205 against 226 us and 1.04 against 1.18 ms; local + global 319
# against 426 us and 1.76 against 2.31 ms; a dilated window (every tile partial) 401 against
# 406 us. 64 x 64 tiles also let the backward pipeline two stages (BLOCK_SPARSE_BACKWARD_STAGES
# in kernelforge/triton/attention.py). The cost: four times the list entries
# (O((Sq / 64) * (Sk / 64)) int32s each).
DEFAULT_BLOCK = 64


def _check_block(name: str, value: int) -> int:
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"BlockMask: {name} must be a power of two >= 16, got {value!r}")
    return value


@dataclass(frozen=True)
class BlockMask:
    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    kv_counts: torch.Tensor
    kv_blocks: torch.Tensor
    kv_partial: torch.Tensor
    q_counts: torch.Tensor
    q_blocks: torch.Tensor
    q_partial: torch.Tensor
    partial_masks: torch.Tensor
    kv_full: torch.Tensor
    q_full: torch.Tensor
    partial_words: torch.Tensor
    partial_words_t: torch.Tensor

    # --------------------------------------------------------------- construction
    @staticmethod
    def from_kinds(kinds: torch.Tensor, partial_masks: torch.Tensor, q_len: int, kv_len: int,
                   block_q: int, block_k: int) -> "BlockMask":
        """From a (Bm, Hm, QB, KB) table of EMPTY / FULL / partial id and the partial bits."""
        listed = kinds != EMPTY
        kv_counts, kv_blocks, kv_partial, kv_full = _lists(listed, kinds)
        q_counts, q_blocks, q_partial, q_full = _lists(listed.transpose(-1, -2), kinds.transpose(-1, -2))
        partial_masks = partial_masks.to(torch.uint8).contiguous()
        return BlockMask(q_len, kv_len, block_q, block_k, kv_counts, kv_blocks, kv_partial,
                         q_counts, q_blocks, q_partial, partial_masks, kv_full, q_full, _packed_words(partial_masks),
                         _packed_words(partial_masks.transpose(1, 2).contiguous()))

    @staticmethod
    def from_dense(mask: torch.Tensor, block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK) -> "BlockMask":
        """From a boolean mask of shape (Sq, Sk), (H, Sq, Sk) or (B, H, Sq, Sk) (B, H may be 1):
        True where the query may attend to the key."""
        if mask.dtype != torch.bool:
            raise TypeError(f"BlockMask.from_dense: mask must be a bool tensor, got {mask.dtype}")
        if not 2 <= mask.dim() <= 4:
            raise ValueError(f"BlockMask.from_dense: mask must have 2 to 4 dims (..., Sq, Sk), got shape "
                             f"{tuple(mask.shape)}")
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        Bm, Hm, Sq, Sk = mask.shape
        return BlockMask.from_mask_function(
            lambda b, h, q, k: mask[b, h, q, k], Sq, Sk, batch=Bm if Bm > 1 else None,
            heads=Hm if Hm > 1 else None, block_q=block_q, block_k=block_k, device=mask.device)

    @staticmethod
    def from_mask_function(fn: MaskFunction, q_len: int, kv_len: int, *, batch: Optional[int] = None,
                           heads: Optional[int] = None, block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK,
                           device: torch.device | str = "cpu") -> "BlockMask":
        """Evaluate fn(b, h, q_idx, kv_idx) -> bool on broadcast index tensors, one row of
        query tiles at a time (memory: block_q x Sk per batch and head), and classify tiles.
        batch / heads None: the mask does not depend on them (evaluated at b = h = 0)."""
        _check_block("block_q", block_q)
        _check_block("block_k", block_k)
        if q_len < 1 or kv_len < 1:
            raise ValueError(f"BlockMask: q_len and kv_len must be >= 1, got {q_len} and {kv_len}")
        device = torch.device(device)
        Bm, Hm = batch or 1, heads or 1
        QB, KB = -(-q_len // block_q), -(-kv_len // block_k)
        b = torch.arange(Bm, device=device).view(Bm, 1, 1, 1)
        h = torch.arange(Hm, device=device).view(1, Hm, 1, 1)
        kv = torch.arange(KB * block_k, device=device).view(1, 1, 1, -1)
        kinds = torch.full((Bm, Hm, QB, KB), EMPTY, dtype=torch.int32, device=device)
        partials = []
        n_partial = 0
        for qb in range(QB):
            q = torch.arange(qb * block_q, (qb + 1) * block_q, device=device).view(1, 1, -1, 1)
            inside = (q < q_len) & (kv < kv_len)
            bits = torch.as_tensor(fn(b, h, q.clamp(max=q_len - 1), kv.clamp(max=kv_len - 1)), device=device)
            bits = (bits.to(torch.bool) & inside).expand(Bm, Hm, block_q, KB * block_k)
            tiles = bits.reshape(Bm, Hm, block_q, KB, block_k).permute(0, 1, 3, 2, 4)  # (Bm,Hm,KB,bq,bk)
            count = tiles.sum(dim=(-1, -2))
            # full: every pair visible and the tile wholly inside Sq x Sk (tail tiles are
            # partial, their bits zero past the tails: the kernels' full loop checks no bounds)
            full = count == block_q * block_k
            partial = (count > 0) & ~full
            kind = torch.where(full, FULL, EMPTY).to(torch.int32)
            n_new = int(partial.sum())
            if n_new:
                ids = torch.cumsum(partial.flatten(), 0).view_as(partial).to(torch.int32) - 1 + n_partial
                kind = torch.where(partial, ids, kind)
                partials.append(tiles[partial])
                n_partial += n_new
            kinds[:, :, qb] = kind
        masks = torch.cat(partials) if partials else torch.zeros(0, block_q, block_k, dtype=torch.bool, device=device)
        return BlockMask.from_kinds(kinds, masks, q_len, kv_len, block_q, block_k)

    # --------------------------------------------------------------- views
    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(Bm, Hm, Sq, Sk): the element mask this describes, broadcast like an attn_mask."""
        return (self.kv_counts.shape[0], self.kv_counts.shape[1], self.q_len, self.kv_len)

    @property
    def device(self) -> torch.device:
        return self.kv_counts.device

    def kinds(self) -> torch.Tensor:
        """(Bm, Hm, QB, KB) int32: EMPTY (-2), FULL (-1) or the partial id of each tile."""
        Bm, Hm, QB = self.kv_counts.shape
        KB = self.kv_blocks.shape[-1]
        kinds = torch.full((Bm, Hm, QB, KB + 1), EMPTY, dtype=torch.int32, device=self.device)
        listed = torch.arange(KB, device=self.device) < self.kv_counts.unsqueeze(-1)
        column = torch.where(listed, self.kv_blocks, KB).long()  # unlisted slots land in a spare column
        kinds.scatter_(-1, column, torch.where(listed, self.kv_partial, EMPTY))
        return kinds[..., :KB]

    def element_mask(self, q_start: int = 0, q_end: Optional[int] = None, kv_start: int = 0,
                     kv_end: Optional[int] = None) -> torch.Tensor:
        """Bool (Bm, Hm, q_end - q_start, kv_end - kv_start): the element mask over a window
        (the whole mask by default). The reference evaluates it one key chunk at a time."""
        q_end = self.q_len if q_end is None else q_end
        kv_end = self.kv_len if kv_end is None else kv_end
        q = torch.arange(q_start, q_end, device=self.device)
        kv = torch.arange(kv_start, kv_end, device=self.device)
        kind = self.kinds()[:, :, q // self.block_q][:, :, :, kv // self.block_k]
        if self.partial_masks.shape[0] == 0:
            return kind == FULL
        bits = self.partial_masks[kind.clamp(min=0), (q % self.block_q).view(-1, 1), (kv % self.block_k).view(1, -1)]
        return (kind == FULL) | ((kind >= 0) & bits.bool())

    def to_dense(self) -> torch.Tensor:
        return self.element_mask()

    def density(self) -> float:
        """Fraction of tiles computed (full or partial)."""
        listed = self.kv_counts.sum().item()
        return listed / (self.kv_counts.numel() * self.kv_blocks.shape[-1])

    def to(self, device: torch.device | str) -> "BlockMask":
        return BlockMask(self.q_len, self.kv_len, self.block_q, self.block_k,
                         *(getattr(self, f).to(device) for f in TENSOR_FIELDS))

    def __repr__(self) -> str:
        Bm, Hm, Sq, Sk = self.shape
        n_partial = self.partial_masks.shape[0]
        return (f"BlockMask(shape=({Bm}, {Hm}, {Sq}, {Sk}), block=({self.block_q}, {self.block_k}), "
                f"density={self.density():.3f}, partial_tiles={n_partial})")


def _packed_words(partial_masks: torch.Tensor) -> torch.Tensor:
    """The partial tiles' bits packed 64 columns to a word, for kernels that read a tile row's
    bits in one load: bit c of word w holds column 64 w + c (a last word is zero-padded).
    (P, rows, ceil(columns / 64)) int64, 1/8 of the bits' bytes. Packed a byte at a time, then
    read as little-endian words (the byte order of every platform torch runs on)."""
    P, bq, bk = partial_masks.shape
    words = -(-bk // 64)
    bits = torch.nn.functional.pad(partial_masks, (0, words * 64 - bk)).view(P, bq, words * 8, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bits.device)
    return (bits * weights).sum(-1, dtype=torch.uint8).view(torch.int64).contiguous()


# The tensors of a BlockMask in its constructor's order (after q_len, kv_len, block_q, block_k): how
# the attention op's schema carries one (a Tensor[] and the two tile sizes).
TENSOR_FIELDS = ("kv_counts", "kv_blocks", "kv_partial", "q_counts", "q_blocks", "q_partial", "partial_masks",
                 "kv_full", "q_full", "partial_words", "partial_words_t")


def _lists(listed: torch.Tensor, kinds: torch.Tensor):
    """Per row of a (…, R, C) table: how many entries are listed, their column indices (the
    full ones ascending, then the partial ones ascending; padded with 0), their kinds
    (padded with EMPTY), and how many are full."""
    C = listed.shape[-1]
    counts = listed.sum(-1, dtype=torch.int32)
    full = (kinds == FULL).sum(-1, dtype=torch.int32)
    column = torch.arange(C, device=listed.device, dtype=torch.int32).expand_as(listed)
    # sort key: full tiles, then partial ones, then the unlisted, each group by column
    group = torch.where(kinds == FULL, 0, torch.where(listed, 1, 2))
    order = torch.argsort(group * C + column, dim=-1)
    blocks = torch.gather(column, -1, order)
    kept = torch.arange(C, device=listed.device) < counts.unsqueeze(-1)
    blocks = torch.where(kept, blocks, 0).to(torch.int32).contiguous()
    partial = torch.where(kept, torch.gather(kinds, -1, order), EMPTY).to(torch.int32).contiguous()
    return counts.contiguous(), blocks, partial, full.contiguous()


# ----------------------------------------------------------------------------- patterns
def sliding_window_block_mask(q_len: int, kv_len: int, window: int, *, causal: bool = True,
                              block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK,
                              device: torch.device | str = "cpu") -> BlockMask:
    """Each query sees the `window` keys before it (and itself); causal=False adds the
    `window` keys after it. Queries align to the last keys (offset Sk - Sq), as causal does."""
    off = kv_len - q_len

    def fn(b, h, q, k):
        d = q + off - k
        return (d >= 0) & (d <= window) if causal else d.abs() <= window

    return BlockMask.from_mask_function(fn, q_len, kv_len, block_q=block_q, block_k=block_k, device=device)


def local_global_block_mask(q_len: int, kv_len: int, window: int, global_tokens: int, *, causal: bool = False,
                            block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK,
                            device: torch.device | str = "cpu") -> BlockMask:
    """Longformer-style: a local band of +-`window` keys, plus `global_tokens` leading
    tokens that every query sees and that see every key (causal=True keeps only keys at
    or before the query in both)."""
    off = kv_len - q_len

    def fn(b, h, q, k):
        d = q + off - k
        seen = (d.abs() <= window) | (k < global_tokens) | (q + off < global_tokens)
        return seen & (d >= 0) if causal else seen

    return BlockMask.from_mask_function(fn, q_len, kv_len, block_q=block_q, block_k=block_k, device=device)


def dilated_block_mask(q_len: int, kv_len: int, window: int, dilation: int, *, causal: bool = True,
                       block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK,
                       device: torch.device | str = "cpu") -> BlockMask:
    """Dilated sliding window: each query sees every `dilation`-th key within `window`
    positions (window * dilation keys span), the query's own key included."""
    if dilation < 1:
        raise ValueError(f"dilated_block_mask: dilation must be >= 1, got {dilation}")
    off = kv_len - q_len

    def fn(b, h, q, k):
        d = q + off - k
        inside = (d >= 0) & (d <= window) if causal else d.abs() <= window
        return inside & (d.remainder(dilation) == 0)

    return BlockMask.from_mask_function(fn, q_len, kv_len, block_q=block_q, block_k=block_k, device=device)
