"""flash_attention on a paged KV cache (block_table into page pools): a contiguous cache scattered
into shuffled pages of a pool whose spare pages are NaN, against the float64 oracle of the filled
keys read back from the pages one by one (a plain-torch gather, tests/attention_oracle's softmax)
and against the same call on the contiguous cache; page sizes 1, 7, 16 and 64 (one table entry a
key tile in Triton, or one a key row), ragged batches with empty and full sequences, grouped
heads, causal and window; a FlashAttention-layout pool read in place; the registered op (opcheck),
torch.compile, the errors; on a GPU, bf16 and a CUDA graph replayed after the lengths and the
table change in place."""
import math

import pytest
import torch

import kernelforge as kf
from tests.conftest import backend_cases, capture_cuda_graph, needs_cuda
from tests.ops.test_attention_kvcache import assert_matches_kv_cache_oracle, kv_dtypes


def paged_inputs(B, H, Hkv, Sq, page, max_blocks, D, lengths, device, dtype, fa_layout=False, spare=3):
    """(q, contiguous k, v (NaN past each length), the pools k, v, the lengths, the block table).
    The pages of all sequences are shuffled through a pool of B * max_blocks + spare pages; spare
    pages are NaN, and a table entry of a page wholly past its sequence's length is -1 or past the
    pool's end at random (padding: never to be used). fa_layout: the pools are stored
    (num_blocks, page, Hkv, D), as FlashAttention keeps them, and passed as a transposed view."""
    capacity = page * max_blocks
    q = torch.randn(B, H, Sq, D, device=device, dtype=dtype)
    k, v = (torch.randn(B, Hkv, capacity, D, device=device, dtype=dtype) for _ in range(2))
    for b, length in enumerate(lengths):
        k[b, :, length:] = math.nan
        v[b, :, length:] = math.nan
    num_blocks = B * max_blocks + spare
    table = torch.randperm(num_blocks)[:B * max_blocks].view(B, max_blocks).to(torch.int32)
    pools = []
    for cache in (k, v):
        pool = torch.full((num_blocks, Hkv, page, D), math.nan, device=device, dtype=dtype)
        pool[table.flatten().long()] = cache.view(B, Hkv, max_blocks, page, D).transpose(1, 2).reshape(-1, Hkv, page, D)
        if fa_layout:
            pool = pool.transpose(1, 2).contiguous().transpose(1, 2)
            assert pool.stride(2) == Hkv * D and pool.stride(1) == D
        pools.append(pool)
    for b, length in enumerate(lengths):
        for m in range(math.ceil(length / page), max_blocks):
            table[b, m] = -1 if torch.rand(()) < 0.5 else num_blocks + 7
    seqlens = torch.tensor(lengths, device=device, dtype=torch.int32)
    return q, k, v, pools[0], pools[1], seqlens, table.to(device)


def gather_by_hand(pool, table, lengths, capacity):
    """The contiguous cache (B, Hkv, capacity, D) of a pool, key by key: page table[b, j // page],
    slot j % page for j below the length, NaN past it (an unfilled cache, which must not be read)."""
    page = pool.shape[2]
    out = torch.full((table.shape[0], pool.shape[1], capacity, pool.shape[3]), math.nan, dtype=pool.dtype,
                     device=pool.device)
    for b, length in enumerate(lengths):
        for j in range(length):
            out[b, :, j] = pool[int(table[b, j // page]), :, j % page]
    return out


def check_paged(backend, q, k, v, kp, vp, seqlens, table, causal=False, window=None):
    lengths = seqlens.tolist()
    what = (f"{backend} {q.dtype} q{tuple(q.shape)} pool{tuple(kp.shape)} table{tuple(table.shape)} "
            f"lengths {lengths} causal={causal} window={window}")
    with kf.use_backend(backend):
        out, lse = kf.flash_attention(q, kp, vp, causal=causal, window=window, cache_seqlens=seqlens,
                                      block_table=table, return_lse=True)
        contiguous, contiguous_lse = kf.flash_attention(q, k, v, causal=causal, window=window,
                                                        cache_seqlens=seqlens, return_lse=True)
    assert out.shape == q.shape[:3] + vp.shape[-1:] and out.dtype == q.dtype and lse.shape == q.shape[:3]
    assert not out.isnan().any(), f"{what}: a NaN of an unread page reached the output"
    capacity = table.shape[1] * kp.shape[2]
    table_host = table.cpu()
    kg, vg = (gather_by_hand(p, table_host, lengths, capacity) for p in (kp, vp))
    assert torch.equal(kg.isnan(), k.isnan()) and torch.equal(kg.nan_to_num(), k.nan_to_num()), what
    assert_matches_kv_cache_oracle(out, q, kg, vg, seqlens, what, causal, window, lse=lse)
    # the same keys in the same order: the paged call is the contiguous one up to the kernels' rounding
    # (the contiguous call may take another kernel: a short cache the query-tiled forward)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}.get(q.dtype, 1e-5)
    tol = dict(atol=tol, rtol=tol)
    torch.testing.assert_close(out, contiguous, **tol, msg=lambda m: f"{what}: paged != contiguous: {m}")
    torch.testing.assert_close(lse, contiguous_lse, atol=1e-4, rtol=1e-4)


# (heads, Sq, page, max_blocks, lengths): Triton's decode kernel walks 64-key tiles, so page 64
# takes one table entry a tile (its whole-page path) and pages 1, 7 and 16 one a key row; each batch
# holds an empty sequence and a full one, and page-unaligned lengths
PAGED_CASES = [
    pytest.param((4, 2), 1, 1, 70, [0, 70, 33], id="gqa-Sq1-page1"),
    pytest.param((4, 2), 3, 16, 9, [144, 0, 17, 100, 64], id="gqa-Sq3-page16"),
    pytest.param((4, 1), 1, 64, 4, [256, 65, 0, 128], id="mqa-Sq1-page64"),
    pytest.param((6, 3), 4, 7, 12, [0, 84, 50], id="gqa-Sq4-page7"),
    pytest.param((2, 2), 2, 64, 2, [90], id="mha-Sq2-page64-batch1"),
]


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
@pytest.mark.parametrize("heads,Sq,page,max_blocks,lengths", PAGED_CASES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_paged_matches_oracle_and_contiguous_cache(backend, device, heads, Sq, page, max_blocks, lengths, causal):
    H, Hkv = heads
    for dtype in kv_dtypes(backend):
        inputs = paged_inputs(len(lengths), H, Hkv, Sq, page, max_blocks, 32, lengths, device, dtype)
        check_paged(backend, *inputs, causal=causal)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
@pytest.mark.parametrize("page", [7, 64])
def test_paged_window_aligns_to_each_length(backend, device, page):
    inputs = paged_inputs(3, 4, 2, 3, page, 130 // page + 1, 16, [0, 40, 130], device, torch.float32)
    check_paged(backend, *inputs, causal=True, window=(20, None))
    check_paged(backend, *inputs, window=(25, 2))


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_flash_attention_layout_pool_is_read_in_place(backend, device, monkeypatch):
    from kernelforge.triton import attention_decode

    seen = []
    decode_forward = attention_decode.decode_forward

    def spy(q, k, v, *args):
        seen.append((k.data_ptr(), k.stride(), v.data_ptr(), v.stride()))
        return decode_forward(q, k, v, *args)

    monkeypatch.setattr(attention_decode, "decode_forward", spy)
    q, k, v, kp, vp, seqlens, table = paged_inputs(3, 4, 2, 1, 16, 6, 32, [96, 5, 0], device, torch.float16,
                                                   fa_layout=True)
    check_paged(backend, q, k, v, kp, vp, seqlens, table, causal=True)
    if backend == "triton":  # the decode kernel took the pools as they are: no copy
        assert (kp.data_ptr(), kp.stride(), vp.data_ptr(), vp.stride()) in seen
    else:
        assert not seen


@pytest.mark.parametrize("backend,device", backend_cases(("triton",)))
def test_decode_kernel_reads_pages_and_long_chunks_gather_them(backend, device, monkeypatch):
    # a short paged cache still decodes from its pages (a copy would cost more); 80 query rows a kv
    # head (past attention_decode.MAX_ROWS) take the query-tiled forward on a gathered copy
    from kernelforge.triton import attention_decode

    calls = []
    decode_forward = attention_decode.decode_forward
    monkeypatch.setattr(attention_decode, "decode_forward", lambda *a: calls.append(1) or decode_forward(*a))
    check_paged(backend, *paged_inputs(2, 4, 2, 2, 8, 5, 16, [40, 11], device, torch.float32), causal=True)
    assert calls == [1]  # the paged call (the 40-key contiguous one takes the query-tiled kernel)
    assert attention_decode.MAX_ROWS < 4 * 20
    check_paged(backend, *paged_inputs(2, 4, 1, 20, 8, 5, 16, [40, 25], device, torch.float32), causal=True)
    assert calls == [1]


def test_int64_table_empty_capacity_and_no_grad():
    q, k, v, kp, vp, seqlens, table = paged_inputs(2, 4, 2, 1, 4, 3, 8, [5, 12], "cpu", torch.float32)
    expected = kf.flash_attention(q, k, v, cache_seqlens=seqlens)
    torch.testing.assert_close(kf.flash_attention(q, kp, vp, cache_seqlens=seqlens, block_table=table.long()),
                               expected)
    empty = torch.empty(2, 0, dtype=torch.int32)  # a table of no pages: every row sees nothing
    out, lse = kf.flash_attention(q, kp, vp, cache_seqlens=seqlens, block_table=empty, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)
    with torch.no_grad():
        out = kf.flash_attention(q.requires_grad_(), kp, vp, cache_seqlens=seqlens, block_table=table)
    torch.testing.assert_close(out, expected)
    with pytest.raises(NotImplementedError, match="gradients with cache_seqlens are not computed"):
        kf.flash_attention(q, kp, vp, cache_seqlens=seqlens, block_table=table)
    with pytest.raises(NotImplementedError, match="gradients with cache_seqlens are not computed"):
        torch.ops.kernelforge.flash_attention(q, kp, vp, 0.3, -1, 0, None, [], 0, 0, seqlens, table)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_opcheck_with_block_table(backend, device):
    q, _, _, kp, vp, seqlens, table = paged_inputs(3, 4, 2, 2, 16, 4, 32, [0, 64, 23], device, torch.float32)
    kp, vp = kp.nan_to_num(), vp.nan_to_num()  # opcheck compares runs with NaN-unaware checks
    table = table.clamp(0, kp.shape[0] - 1)
    with kf.use_backend(backend):
        torch.library.opcheck(torch.ops.kernelforge.flash_attention.default,
                              (q, kp, vp, 0.2, 5, 0, None, [], 0, 0, seqlens, table))


def test_paged_decode_under_torch_compile_cpu():
    # the reference (its gather included) is traced into the graph; new lengths and a new table
    # written into the same tensors reuse it
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    q, k, v, kp, vp, seqlens, table = paged_inputs(3, 4, 2, 1, 8, 5, 16, [3, 17, 40], "cpu", torch.float32)

    def decode(q, k, v, seqlens, table):
        return kf.flash_attention(q, k, v, causal=True, cache_seqlens=seqlens, block_table=table) * 2

    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(decode, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(q, kp, vp, seqlens, table), decode(q, kp, vp, seqlens, table))
    seqlens.copy_(torch.tensor([0, 9, 33]))
    # sequences 1 and 2 both read sequence 2's pages (shared, as a common prefix is), listed the other way
    # round: other keys at each position
    table[1:] = table[2].flip(0)
    out = compiled(q, kp, vp, seqlens, table)
    lengths = seqlens.tolist()
    kg, vg = (gather_by_hand(p, table, lengths, 40) for p in (kp, vp))
    assert_matches_kv_cache_oracle(out / 2, q, kg, vg, seqlens, "compiled", causal=True)
    assert len(backend.fw_graphs) == 1
    code = backend.fw_graphs[0].code
    assert "kernelforge" not in code and "aten" in code


def _bad(**changes):
    q = torch.randn(2, 4, 1, 8)
    kp, vp = torch.randn(6, 2, 4, 8), torch.randn(6, 2, 4, 8)
    args = dict(q=q, k=kp, v=vp, cache_seqlens=torch.tensor([3, 5], dtype=torch.int32),
                block_table=torch.zeros(2, 3, dtype=torch.int32))
    args.update(changes)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    return kf.flash_attention(q, k, v, **args)


@pytest.mark.parametrize("changes,error,match", [
    (dict(block_table=torch.zeros(2, 3)), TypeError,
     r"block_table must have dtype int32 \(or int64\), got torch.float32"),
    (dict(block_table=[[0, 1, 2], [3, 4, 5]]), TypeError, "block_table must be a tensor of int32 page indices"),
    (dict(block_table=torch.zeros(2, dtype=torch.int32)), ValueError,
     r"block_table must have shape \(batch, max_blocks_per_seq\) with batch = 2 \(q's\), got \(2,\)"),
    (dict(block_table=torch.zeros(3, 3, dtype=torch.int32)), ValueError,
     r"block_table must have shape \(batch, max_blocks_per_seq\) with batch = 2 \(q's\), got \(3, 3\)"),
    (dict(block_table=torch.zeros(2, 3, dtype=torch.int32, device="meta")), ValueError,
     "block_table must be on q's device cpu, got meta"),
    (dict(cache_seqlens=None), ValueError, "block_table needs cache_seqlens .*, got None"),
    (dict(k=torch.randn(6, 2, 0, 8), v=torch.randn(6, 2, 0, 8)), ValueError,
     r"the page size .* must be positive, got k of shape \(6, 2, 0, 8\)"),
    (dict(k=torch.randn(0, 2, 4, 8), v=torch.randn(0, 2, 4, 8)), ValueError,
     r"the k and v pools have no pages \(num_blocks = 0\) for a block_table of shape \(2, 3\)"),
    (dict(k=torch.randn(6, 2, 4, 8), v=torch.randn(6, 2, 5, 8)), ValueError,
     r"k and v must agree in \(num_blocks, kv_heads, page_size\) as page pools, got k \(6, 2, 4, 8\) and "
     r"v \(6, 2, 5, 8\)"),
    (dict(k=torch.randn(6, 2, 8), v=torch.randn(6, 2, 8)), ValueError,
     r"k must be 4-D \(num_blocks, kv_heads, page_size, head_dim\) with block_table, got shape \(6, 2, 8\)"),
    (dict(attn_mask=torch.ones(1, 12, dtype=torch.bool)), ValueError,
     "block_table takes causal and window only, not attn_mask or block_mask"),
])
def test_bad_paged_input_is_named(changes, error, match):
    with pytest.raises(error, match=match):
        _bad(**changes)


def test_registered_op_checks_the_table_too():
    q, kp, vp = torch.randn(2, 4, 1, 8), torch.randn(6, 2, 4, 8), torch.randn(6, 2, 4, 8)
    with pytest.raises(ValueError, match="block_table needs cache_seqlens"):
        torch.ops.kernelforge.flash_attention(q, kp, vp, 0.3, -1, 0, None, [], 0, 0, None,
                                              torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="not attn_mask or block_mask"):
        torch.ops.kernelforge.flash_attention(q, kp, vp, 0.3, -1, 0, torch.ones(2, 4, 1, 12, dtype=torch.bool), [],
                                              0, 0, torch.tensor([1, 2]), torch.zeros(2, 3, dtype=torch.int32))


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("Sq", [1, 4])
def test_paged_decode_bf16_on_cuda(page, Sq, monkeypatch):
    from kernelforge.triton import attention_decode

    calls = []
    decode_forward = attention_decode.decode_forward
    monkeypatch.setattr(attention_decode, "decode_forward", lambda *a: calls.append(1) or decode_forward(*a))
    inputs = paged_inputs(4, 16, 4, Sq, page, 4096 // page, 128, [1, 1000, 4096, 0], "cuda", torch.bfloat16,
                          fa_layout=page == 16)
    check_paged("triton", *inputs, causal=True)
    assert calls, "the flash-decoding kernels did not run"


@pytest.mark.gpu
@needs_cuda
def test_cuda_backend_refuses_block_table():
    from kernelforge.ops.attention import _why_not_cuda
    from kernelforge.reference.attention import Visibility

    q, _, _, kp, vp, seqlens, table = paged_inputs(1, 4, 2, 1, 16, 2, 64, [20], "cuda", torch.float16)
    reason = _why_not_cuda(q, kp, vp, Visibility.of(True, None, seqlens=seqlens, block_table=table))
    assert "block_table" in reason


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replays_paged_decode_with_new_lengths_and_table():
    q, k, v, kp, vp, seqlens, table = paged_inputs(4, 16, 4, 1, 16, 64, 128, [7, 300, 1024, 500], "cuda",
                                                   torch.bfloat16)

    def step():
        return kf.flash_attention(q, kp, vp, causal=True, cache_seqlens=seqlens, block_table=table)

    graph, out = capture_cuda_graph(step)  # warmed up outside the capture, replayed once

    def check(what):
        lengths = seqlens.tolist()
        kg, vg = (gather_by_hand(p, table.cpu(), lengths, 1024) for p in (kp, vp))
        assert_matches_kv_cache_oracle(out, q, kg, vg, seqlens, what, causal=True)

    check("first replay")
    # the next step: sequence 0's page moves to a spare page with new keys, 1 grows by a token (slot
    # 12 of its 19th page), 2 is emptied; written in place, as a serving engine does
    spare = sorted(set(range(kp.shape[0])) - set(table.flatten().tolist()))[0]
    for pool in (kp, vp):
        pool[spare] = torch.randn_like(pool[spare])
        pool[spare, :, 7:] = math.nan  # past the length: never read
    table[0, 0] = spare
    last = int(table[1, 300 // 16])
    kp[last, :, 300 % 16] = torch.randn_like(kp[last, :, 0])
    vp[last, :, 300 % 16] = torch.randn_like(vp[last, :, 0])
    seqlens.copy_(torch.tensor([7, 301, 0, 500], dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    check("replay with a new table and lengths")


@pytest.mark.gpu
@needs_cuda
def test_compiled_paged_decode_launches_the_triton_kernels():
    # traceable: Inductor launches the decode kernels itself, the table read in them (no gather)
    from tests.op_paths import assert_inductor_launches

    torch._dynamo.reset()
    q, _, _, kp, vp, seqlens, table = paged_inputs(2, 8, 2, 1, 64, 32, 64, [100, 2048], "cuda", torch.float16)

    def decode(q, k, v, seqlens, table):
        return kf.flash_attention(q, k, v, causal=True, cache_seqlens=seqlens, block_table=table) * 2

    out = assert_inductor_launches(decode, (q, kp, vp, seqlens, table), ["decode_split_kernel",
                                                                        "decode_merge_kernel"])
    torch.testing.assert_close(out, decode(q, kp, vp, seqlens, table))
