"""BlockMask: construction (mask functions, dense masks, patterns), its tile lists and their
transpose, and block-sparse flash_attention on every backend against the float64 oracle."""
import dataclasses
import math

import pytest
import torch

import kernelforge as kf
from kernelforge.block_mask import EMPTY, FULL
from tests.attention_oracle import gradient_term_scales, naive_attention, visible
from tests.conftest import backend_cases
from tests.numerics import assert_matches_oracle


def test_dense_round_trip_and_tile_kinds():
    dense = torch.rand(2, 3, 70, 90) > 0.6
    dense[:, :, :32, :32] = True  # one full tile
    dense[:, :, 32:64, 32:64] = False  # one empty tile
    bm = kf.BlockMask.from_dense(dense, block_q=32, block_k=32)
    assert bm.shape == (2, 3, 70, 90)
    assert torch.equal(bm.to_dense(), dense)
    kinds = bm.kinds()
    assert kinds.shape == (2, 3, 3, 3)
    assert torch.all(kinds[:, :, 0, 0] == FULL) and torch.all(kinds[:, :, 1, 1] == EMPTY)
    assert torch.equal(bm.element_mask(10, 50, 20, 77), dense[:, :, 10:50, 20:77])


@pytest.mark.parametrize("block_k", [16, 64, 256])
def test_partial_words_pack_the_partial_bits(block_k):
    """partial_words holds partial_masks 64 columns a word, bit c of word w = column 64 w + c
    (bit 63 included: the words are read as signed int64), zero past block_k."""
    bm = kf.BlockMask.from_dense(torch.rand(2, 1, 100, 2 * block_k + 5) > 0.4, block_q=32, block_k=block_k)
    P = bm.partial_masks.shape[0]
    words = bm.partial_words
    assert P > 0 and words.shape == (P, 32, -(-block_k // 64)) and words.dtype == torch.int64
    cols = torch.arange(words.shape[-1] * 64)
    bits = (words[:, :, cols // 64] >> (cols % 64)) & 1
    assert torch.equal(bits[..., :block_k].to(torch.uint8), bm.partial_masks)
    assert not bits[..., block_k:].any()
    # the transpose: 64 query rows a word for each key (block_q = 32: one word, bits 32-63 zero)
    words_t = bm.partial_words_t
    assert words_t.shape == (P, block_k, 1) and words_t.dtype == torch.int64
    rows = torch.arange(64)
    bits_t = (words_t[:, :, rows // 64] >> (rows % 64)) & 1
    assert torch.equal(bits_t[..., :32].to(torch.uint8), bm.partial_masks.transpose(1, 2))
    assert not bits_t[..., 32:].any()


def _expected_list(kinds_row):
    """Full tiles ascending, then partial ones ascending: the order the kernels walk."""
    full = [c for c, kind in enumerate(kinds_row) if kind == FULL]
    return full + [c for c, kind in enumerate(kinds_row) if kind >= 0], len(full)


def test_lists_put_full_tiles_first_and_the_transpose_agrees():
    bm = kf.local_global_block_mask(300, 260, 20, 7, block_q=32, block_k=16)
    kinds = bm.kinds()
    assert (kinds == FULL).any() and (kinds >= 0).any()
    for qb in range(kinds.shape[2]):
        expected, n_full = _expected_list(kinds[0, 0, qb].tolist())
        n = bm.kv_counts[0, 0, qb].item()
        assert bm.kv_blocks[0, 0, qb, :n].tolist() == expected and bm.kv_full[0, 0, qb].item() == n_full
        assert bm.kv_partial[0, 0, qb, :n].tolist() == [kinds[0, 0, qb, kb].item() for kb in expected]
    for kb in range(kinds.shape[3]):
        expected, n_full = _expected_list(kinds[0, 0, :, kb].tolist())
        n = bm.q_counts[0, 0, kb].item()
        assert bm.q_blocks[0, 0, kb, :n].tolist() == expected and bm.q_full[0, 0, kb].item() == n_full
        assert bm.q_partial[0, 0, kb, :n].tolist() == [kinds[0, 0, qb, kb].item() for qb in expected]


def test_tiles_at_the_tails_are_never_full():
    """The kernels' full-tile loop checks no bounds: a tile crossing Sq or Sk must be partial."""
    bm = kf.BlockMask.from_dense(torch.ones(70, 90, dtype=torch.bool), block_q=32, block_k=32)
    kinds = bm.kinds()[0, 0]
    assert torch.all(kinds[:2, :2] == FULL) and torch.all(kinds[2, :] >= 0) and torch.all(kinds[:, 2] >= 0)


@pytest.mark.parametrize("Sq,Sk", [(256, 256), (100, 300), (300, 77)])
def test_patterns_match_their_definitions(Sq, Sk):
    i = torch.arange(Sq).view(-1, 1) + Sk - Sq
    j = torch.arange(Sk).view(1, -1)
    d = i - j
    got = kf.sliding_window_block_mask(Sq, Sk, 40, block_q=32, block_k=64).to_dense()[0, 0]
    assert torch.equal(got, (d >= 0) & (d <= 40))
    got = kf.sliding_window_block_mask(Sq, Sk, 40, causal=False, block_q=32, block_k=64).to_dense()[0, 0]
    assert torch.equal(got, d.abs() <= 40)
    got = kf.local_global_block_mask(Sq, Sk, 16, 5, block_q=16, block_k=16).to_dense()[0, 0]
    assert torch.equal(got, (d.abs() <= 16) | (j < 5) | (i < 5))
    got = kf.dilated_block_mask(Sq, Sk, 60, 4, block_q=16, block_k=32).to_dense()[0, 0]
    assert torch.equal(got, (d >= 0) & (d <= 60) & (d % 4 == 0))


def test_sparsity_skips_tiles():
    bm = kf.sliding_window_block_mask(4096, 4096, 256, block_q=128, block_k=128)
    assert bm.density() < 0.1
    assert bm.partial_masks.shape[0] <= 2 * 4096 // 128
    assert "density" in repr(bm)


def test_bad_construction_is_named():
    with pytest.raises(ValueError, match="block_q must be a power of two"):
        kf.BlockMask.from_dense(torch.ones(4, 4, dtype=torch.bool), block_q=24)
    with pytest.raises(TypeError, match="bool"):
        kf.BlockMask.from_dense(torch.ones(4, 4))
    with pytest.raises(ValueError, match="dilation"):
        kf.dilated_block_mask(8, 8, 4, 0)
    bm = kf.sliding_window_block_mask(64, 64, 8, block_q=16, block_k=16)
    q = torch.randn(1, 2, 32, 8)
    with pytest.raises(ValueError, match="block_mask covers"):
        kf.flash_attention(q, q, q, block_mask=bm)
    # lists past 32-bit offsets are refused before any kernel runs (an expanded stand-in: no 8 GB allocated)
    bm = kf.sliding_window_block_mask(32, 32, 8, block_q=16, block_k=16)
    huge = dataclasses.replace(bm, kv_blocks=torch.zeros(1, dtype=torch.int32).expand(2 ** 31))
    with pytest.raises(ValueError, match="block_mask.kv_blocks has 2147483648 entries"):
        kf.flash_attention(torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8),
                           block_mask=huge)


def _check_block_sparse(backend, device, dtype, bm, H, Hkv, D, causal=False, window=None):
    B, Sq, Sk = bm.shape[0], bm.q_len, bm.kv_len
    bm = bm.to(device)
    q = torch.randn(B, H, Sq, D, device=device, dtype=dtype)
    k, v = (torch.randn(B, Hkv, Sk, D, device=device, dtype=dtype) for _ in range(2))
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    what = f"{backend} {dtype} {bm} H{H}/{Hkv} D{D} causal={causal} window={window}"
    with kf.use_backend(backend):
        out = kf.flash_attention(*mine, block_mask=bm, causal=causal, window=window)
    opts = dict(block_mask=bm, causal=causal, window=window)
    out_theirs, _ = naive_attention(*theirs, **opts)
    out_exact, _ = naive_attention(*exact, **opts)
    assert_matches_oracle(out, out_theirs, out_exact, f"{what} out", reduced=Sk)
    grad = torch.randn_like(out)
    with kf.use_backend(backend):
        grads = torch.autograd.grad(out, mine, grad)
    g_theirs = torch.autograd.grad(out_theirs, theirs, grad)
    g_exact = torch.autograd.grad(out_exact, exact, grad.double())
    scales = gradient_term_scales(q, k, v, grad, **opts)
    for name, a, b, c, t in zip(("dq", "dk", "dv"), grads, g_theirs, g_exact, scales):
        assert_matches_oracle(a, b, c, f"{what} {name}", reduced=max(Sq, Sk) * H // Hkv, terms_scale=t)


def _masks():
    return [
        ("window", lambda: kf.sliding_window_block_mask(150, 150, 40, block_q=32, block_k=32)),
        ("local_global", lambda: kf.local_global_block_mask(100, 130, 10, 5, block_q=64, block_k=32)),
        ("dilated", lambda: kf.dilated_block_mask(130, 130, 50, 3, block_q=32, block_k=64)),
        ("random_per_batch", lambda: kf.BlockMask.from_dense(torch.rand(2, 1, 70, 96) > 0.7, block_q=32, block_k=32)),
    ]


@pytest.mark.parametrize("name,make", _masks(), ids=[m[0] for m in _masks()])
@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_block_sparse_matches_oracle(backend, device, name, make):
    for dtype in ([torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32]):
        _check_block_sparse(backend, device, dtype, make(), H=4, Hkv=2, D=32)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_block_mask_combines_with_causal_and_window(backend, device):
    bm = kf.local_global_block_mask(96, 96, 30, 4, block_q=32, block_k=32)
    _check_block_sparse(backend, device, torch.float32, bm, H=2, Hkv=1, D=16, causal=True, window=(20, None))


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_block_mask_equals_the_same_dense_mask(backend, device):
    """The block-sparse path and the dense-mask path compute the same attention."""
    Sq = Sk = 200
    dense = visible(Sq, Sk, causal=True, window=(64, None))
    bm = kf.BlockMask.from_dense(dense, block_q=64, block_k=64).to(device)
    q, k, v = (torch.randn(1, 2, Sq, 32, device=device) for _ in range(3))
    with kf.use_backend(backend):
        a = kf.flash_attention(q, k, v, block_mask=bm)
        b = kf.flash_attention(q, k, v, attn_mask=dense.to(device))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not math.isnan(a.sum().item())
