"""flash_attention with KV cache lengths (cache_seqlens) against the float64 oracle of each
sequence's filled cache (tests/attention_oracle.kv_cache_attention): ragged lengths, an empty
cache, grouped heads, causal / window / attn_mask aligned to each length, the flash-decoding and
query-tiled kernels; torch.compile (the reference traced on the CPU, Inductor launching the Triton
kernels on a GPU), a CUDA graph replayed with new lengths, and which calls stay opaque. Bad
input: tests/ops/test_attention.py::test_bad_input_is_named."""
import math

import pytest
import torch

import kernelforge as kf
from tests.attention_oracle import kv_cache_attention
from tests.conftest import backend_cases, capture_cuda_graph, needs_cuda
from tests.numerics import assert_matches_oracle
from tests.op_paths import assert_inductor_launches, compiled_code


def kv_cache_inputs(B, H, Hkv, Sq, Sk, D, lengths, device, dtype):
    """q, a cache k, v of capacity Sk filled to `lengths` (NaN past them: an unfilled cache may hold
    anything, and must not be read), and the lengths as an int32 tensor on `device`."""
    q = torch.randn(B, H, Sq, D, device=device, dtype=dtype)
    k, v = (torch.randn(B, Hkv, Sk, D, device=device, dtype=dtype) for _ in range(2))
    for b, length in enumerate(lengths):
        k[b, :, length:] = math.nan
        v[b, :, length:] = math.nan
    return q, k, v, torch.tensor(lengths, device=device, dtype=torch.int32)


def assert_matches_kv_cache_oracle(out, q, k, v, seqlens, what, causal=False, window=None, attn_mask=None, lse=None):
    opts = dict(causal=causal, window=window, attn_mask=attn_mask)
    out_theirs, _ = kv_cache_attention(q, k, v, seqlens, **opts)
    out_exact, lse_exact = kv_cache_attention(q.double(), k.double(), v.double(), seqlens, **opts)
    assert_matches_oracle(out, out_theirs, out_exact, f"{what} out", reduced=k.shape[2])
    for b, length in enumerate(seqlens.tolist()):
        if length == 0:  # an empty cache: every row sees nothing, as a fully masked row
            assert torch.all(out[b] == 0), what
            assert lse is None or torch.all(lse[b] == -math.inf), what
    if lse is None:
        return
    finite = lse_exact.isfinite().cpu()
    assert torch.equal(lse.isfinite().cpu(), finite), f"{what}: lse -inf rows differ"
    if finite.any():
        tol = 1e-4 * (1 + lse_exact.cpu()[finite].abs().max().item())
        assert (lse.double().cpu() - lse_exact.cpu())[finite].abs().max().item() <= tol, what


def check_kv_cache(backend, q, k, v, seqlens, causal=False, window=None, attn_mask=None):
    what = (f"{backend} {q.dtype} q{tuple(q.shape)} k{tuple(k.shape)} lengths {seqlens.tolist()} causal={causal} "
            f"window={window} mask={attn_mask is not None}")
    with kf.use_backend(backend):
        out, lse = kf.flash_attention(q, k, v, causal=causal, window=window, attn_mask=attn_mask,
                                      cache_seqlens=seqlens, return_lse=True)
    assert out.shape == q.shape[:3] + v.shape[-1:] and out.dtype == q.dtype and lse.shape == q.shape[:3]
    assert_matches_kv_cache_oracle(out, q, k, v, seqlens, what, causal, window, attn_mask, lse)


def kv_dtypes(backend):
    if backend == "triton":
        return [torch.float32, torch.float16]  # the interpreter's bfloat16 dot is wrong: GPU suite
    return [torch.float32, torch.float16, torch.bfloat16, torch.float64]


# (Sq, Sk, lengths): one and five queries against a 600-key cache take Triton's flash-decoding
# kernels (with one kv head cut into two key ranges on the interpreter's 4 "SMs", so one range lies
# past the 250-key cache); 64 queries the query-tiled forward, where a 45-key cache leaves the
# first causal rows nothing to see. Each: an empty cache, a ragged one, a nearly full one.
# The query-tiled kernel runs one multi-query case in the slow suite (the interpreter is slow there).
KV_CASES = [pytest.param((4, Hkv), Sq, Sk, lengths, id=f"{'gqa' if Hkv > 1 else 'mqa'}-Sq{Sq}",
                         marks=[pytest.mark.slow] if Sq == 64 and Hkv == 1 else [])
            for Sq, Sk, lengths in [(1, 600, [0, 250, 557]), (5, 600, [0, 250, 557]), (64, 150, [0, 45, 141])]
            for Hkv in (1, 2)]


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
@pytest.mark.parametrize("heads,Sq,Sk,lengths", KV_CASES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cache_seqlens_matches_oracle(backend, device, heads, Sq, Sk, lengths, causal):
    H, Hkv = heads
    for dtype in kv_dtypes(backend):
        q, k, v, seqlens = kv_cache_inputs(3, H, Hkv, Sq, Sk, 32, lengths, device, dtype)
        check_kv_cache(backend, q, k, v, seqlens, causal=causal)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
@pytest.mark.parametrize("Sq,Sk", [(5, 600), (64, 200)])
def test_cache_seqlens_with_window_and_mask_matches_oracle(backend, device, Sq, Sk):
    # the band aligns to each filled length; attn_mask and the lengths hide keys together
    q, k, v, seqlens = kv_cache_inputs(2, 4, 2, Sq, Sk, 32, [70, Sk - 9], device, torch.float32)
    check_kv_cache(backend, q, k, v, seqlens, causal=True, window=(40, None))
    mask = torch.rand(2, 1, Sq, Sk, device=device) > 0.3
    check_kv_cache(backend, q, k, v, seqlens, window=(100, 3), attn_mask=mask)


def test_full_lengths_are_plain_attention_and_no_grad_is_allowed():
    q, k, v = torch.randn(2, 4, 3, 16, requires_grad=True), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    with torch.no_grad():  # inputs that require grad are fine where no gradient is recorded
        out = kf.flash_attention(q, k, v, causal=True, cache_seqlens=torch.tensor([9, 9]))
    torch.testing.assert_close(out, kf.flash_attention(q.detach(), k, v, causal=True))
    # int64 lengths; a length above the capacity is the caller's error, clamped to it
    out = kf.flash_attention(q.detach(), k, v, cache_seqlens=torch.tensor([12, 9], dtype=torch.int64))
    torch.testing.assert_close(out, kf.flash_attention(q.detach(), k, v))


def test_registered_op_refuses_gradients_with_cache_seqlens():
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(NotImplementedError, match="gradients with cache_seqlens are not computed"):
        torch.ops.kernelforge.flash_attention(q, k, v, 0.3, -1, 0, None, [], 0, 0, torch.tensor([4]))


def test_cache_seqlens_under_torch_compile_cpu():
    # the reference is traced into the graph (no kernelforge op left); the lengths are data, so new
    # values written into the same tensor reuse the graph
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    q, k, v, seqlens = kv_cache_inputs(3, 4, 2, 2, 40, 16, [3, 17, 40], "cpu", torch.float32)

    def decode(q, k, v, seqlens):
        return kf.flash_attention(q, k, v, causal=True, cache_seqlens=seqlens) * 2

    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(decode, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(q, k, v, seqlens), decode(q, k, v, seqlens))
    seqlens.copy_(torch.tensor([0, 9, 33]))  # within what is filled
    out = compiled(q, k, v, seqlens)
    assert_matches_kv_cache_oracle(out / 2, q, k, v, seqlens, "compiled", causal=True)
    assert len(backend.fw_graphs) == 1
    code = backend.fw_graphs[0].code
    assert "kernelforge" not in code and "aten" in code


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Sq", [1, 5])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_decode_kernel_with_cache_seqlens_matches_oracle(D, Sq, causal, monkeypatch):
    from kernelforge.triton import attention_decode

    decoded = []
    decode_forward = attention_decode.decode_forward

    def spy(*args):
        decoded.append(args[0].shape)
        return decode_forward(*args)

    monkeypatch.setattr(attention_decode, "decode_forward", spy)
    q, k, v, seqlens = kv_cache_inputs(4, 16, 4, Sq, 4096, D, [1, 1000, 4095, 2049], "cuda", torch.bfloat16)
    check_kv_cache("triton", q, k, v, seqlens, causal=causal)
    assert decoded, "the flash-decoding kernels did not run"


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replays_decode_with_new_lengths():
    q, k, v, seqlens = kv_cache_inputs(4, 16, 4, 1, 4096, 128, [7, 300, 4096, 1500], "cuda", torch.bfloat16)

    def step():
        return kf.flash_attention(q, k, v, causal=True, cache_seqlens=seqlens)

    graph, out = capture_cuda_graph(step)  # warmed up outside the capture, replayed once
    assert_matches_kv_cache_oracle(out, q, k, v, seqlens, "first replay", causal=True)
    # the next step: a token written at each sequence's end, new lengths (one cache emptied), a new query
    new_lengths = [8, 301, 4096, 0]
    q.copy_(torch.randn_like(q))
    for b, length in enumerate(new_lengths):
        if length:
            k[b, :, length - 1] = torch.randn_like(k[b, :, length - 1])
            v[b, :, length - 1] = torch.randn_like(v[b, :, length - 1])
    seqlens.copy_(torch.tensor(new_lengths, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_kv_cache_oracle(out, q, k, v, seqlens, "replay with new lengths", causal=True)


@pytest.mark.gpu
@needs_cuda
def test_compiled_forward_launches_the_triton_kernels():
    # traceable calls: Inductor launches the Triton kernels itself and equals the eager call
    torch._dynamo.reset()
    q, k, v, seqlens = kv_cache_inputs(2, 8, 2, 1, 2048, 64, [100, 2048], "cuda", torch.float16)
    decode = lambda q, k, v, s: kf.flash_attention(q, k, v, causal=True, cache_seqlens=s) * 2  # noqa: E731
    out = assert_inductor_launches(decode, (q, k, v, seqlens), ["decode_split_kernel", "decode_merge_kernel"])
    torch.testing.assert_close(out, decode(q, k, v, seqlens))
    # a 64-token chunk into the cache: the query-tiled forward
    prefill = lambda q, k, v, s: kf.flash_attention(q, k, v, causal=True, cache_seqlens=s) * 2  # noqa: E731
    q64 = torch.randn(2, 8, 64, 64, device="cuda", dtype=torch.float16)
    out = assert_inductor_launches(prefill, (q64, k, v, seqlens), ["flash_forward_kernel"])
    torch.testing.assert_close(out, prefill(q64, k, v, seqlens))
    plain = lambda q, k, v: kf.flash_attention(q, k, v, causal=True) + 1  # noqa: E731
    qs, ks, vs = (torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out = assert_inductor_launches(plain, (qs, ks, vs), ["flash_forward_kernel"])
    torch.testing.assert_close(out, plain(qs, ks, vs))


@pytest.mark.gpu
@needs_cuda
def test_compiled_backward_launches_the_triton_kernels():
    # float32: the Triton JIT backward on every GPU (the Gluon backward takes fp16 / bf16 only)
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 4, 200, 64, device="cuda", requires_grad=True) for _ in range(3))
    loss = lambda q, k, v: kf.flash_attention(q, k, v, causal=True).square().sum()  # noqa: E731
    out = assert_inductor_launches(loss, (q, k, v), ["flash_forward_kernel", "backward_delta_kernel",
                                                     "flash_backward_dkdv_kernel", "flash_backward_dq_kernel"],
                                   backward=True)
    for a, b in zip(torch.autograd.grad(out, (q, k, v)), torch.autograd.grad(loss(q, k, v), (q, k, v))):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@needs_cuda
def test_calls_the_gluon_kernels_may_run_stay_opaque():
    from kernelforge.ops.attention import _choose
    from kernelforge.reference.attention import Visibility
    from kernelforge.triton import attention as triton_attention
    from kernelforge.triton._launch import device_capability, gluon_module

    q, k, v = (torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    window = Visibility.of(True, (64, None))
    hopper = device_capability(q.device) == (9, 0) and gluon_module("attention_gluon") is not None
    assert triton_attention.traceable(q, k, v, window) == (not hopper)
    assert _choose(q, k, v, window).traceable == (not hopper)
    assert _choose(q, k, v, window).backend == "triton"
    lengths = torch.tensor([3], device="cuda")
    assert triton_attention.traceable(q, k, v, Visibility.of(True, (64, None), seqlens=lengths))
    assert triton_attention.traceable(q.float(), k.float(), v.float(), window, backward=True)
    if not hopper:
        pytest.skip("the Gluon kernels run on sm_90 only")
    assert not triton_attention.traceable(q, k, v, Visibility.of(True, None), backward=True)
    fn = lambda q, k, v: kf.flash_attention(q, k, v, causal=True, window=(64, None)) + 1  # noqa: E731
    torch._dynamo.reset()
    out, code = compiled_code(fn, q, k, v)
    assert "torch.ops.kernelforge.flash_attention" in code
    torch.testing.assert_close(out, fn(q, k, v))
