"""The Gluon forward for a sliding window or a BlockMask (kernelforge/triton/attention_gluon.py)
and the Gluon backward for every call without a mask (attention_gluon_backward.py).

On an sm_90 GPU: output, lse and gradients (windows and unmasked calls through the Gluon
backward, a BlockMask's through the Triton one) against the float64 oracle at odd lengths,
grouped heads, Sq != Sk, both head dims, both dtypes, strided storage and keyless rows; block
masks of every pattern, tile size and broadcast, alone and with a band, with query tiles that
list nothing; each with a check that the Gluon kernels really ran. Everywhere: the kernels compile for sm_90
under the pinned Triton within the budget that lets two programs share an SM, and each
`takes` sends its kernels exactly the calls they support."""
import math

import pytest
import torch

import kernelforge as kf
from kernelforge.reference.attention import Visibility
from tests.attention_oracle import naive_attention
from tests.conftest import HAS_CUDA
from tests.ops.test_attention import check
from tests.ops.test_block_mask import _check_block_sparse

# these tests spy on or swap the launchers' Python, which a replayed eager plan does not run
pytestmark = pytest.mark.usefixtures("no_eager_plans")

gluon = pytest.importorskip("kernelforge.triton.attention_gluon")
gluon_backward = pytest.importorskip("kernelforge.triton.attention_gluon_backward")

ON_HOPPER = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU (wgmma)")


def _counted(monkeypatch, module, name: str, shape_of: int) -> list:
    """Replace module.<name> with a wrapper that records the shape of its argument `shape_of`
    at each call; return the record."""
    calls = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args[shape_of].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.fixture
def gluon_calls(monkeypatch):
    """The query shapes the Gluon forward ran on."""
    return _counted(monkeypatch, gluon, "forward", 0)


@pytest.fixture
def gluon_backward_calls(monkeypatch):
    """The query shapes the Gluon backward ran on."""
    return _counted(monkeypatch, gluon_backward, "backward", 1)


# (B, H, Hkv, Sq, Sk, D, causal, window): the band at odd lengths and its corners
CASES = [
    (1, 4, 4, 4097, 4097, 128, True, (512, None)),    # the benchmarked window, odd length
    (1, 4, 1, 1000, 1000, 64, True, (100, None)),     # MQA, head dim 64
    (1, 8, 2, 17, 1000, 128, True, (300, None)),      # Sq < Sk: bottom-right causal, GQA
    (2, 2, 2, 1000, 300, 64, True, (64, None)),       # Sq > Sk: the first 700 rows see no key
    (1, 2, 2, 1, 17, 128, False, (3, None)),          # one query, left bound only
    (1, 2, 1, 199, 199, 64, False, (37, 21)),         # two-sided band, unaligned to the tiles
    (1, 2, 2, 333, 333, 128, False, (0, 0)),          # the diagonal only
    (1, 2, 2, 200, 4097, 64, False, (5000, None)),    # a reach past the start: every key seen
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
@pytest.mark.gpu
@needs_hopper
def test_matches_oracle(case, dtype, gluon_calls, gluon_backward_calls):
    B, H, Hkv, Sq, Sk, D, causal, window = case
    check("triton", "cuda", dtype, B, H, Hkv, Sq, Sk, D, None, causal, window, None)
    assert gluon_calls, "the Gluon forward did not run"
    assert gluon_backward_calls, "the Gluon backward did not run"


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=["mqa", "gqa-short-queries"])
def test_strided_bshd_storage(case, gluon_calls, gluon_backward_calls):
    # (batch, seq, heads, dim) storage seen through a transpose: 4-D TMA descriptors read it in place
    B, H, Hkv, Sq, Sk, D, causal, window = case
    check("triton", "cuda", torch.bfloat16, B, H, Hkv, Sq, Sk, D, None, causal, window, None, layout="bshd")
    assert gluon_calls and gluon_backward_calls


def _gluon_and_triton_gradients(monkeypatch, switch: str, H: int, **attention):
    """Gradients of one bf16 flash_attention call (2 x H x 2048, d128) from the Gluon backward
    (gluon.ENABLED[switch] on) and from the Triton one (off), on the same graph; they sum the
    same bf16 products in fp32 in another order: a few bf16 ulps apart."""
    q, k, v = (torch.randn(2, H, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(2, H, 2048, 128, device="cuda", dtype=torch.bfloat16)
    grads = {}
    with kf.use_backend("triton"):
        out = kf.flash_attention(q, k, v, **attention)
        for on in (True, False):
            monkeypatch.setitem(gluon.ENABLED, switch, on)
            grads[on] = torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    for name, a, b in zip("qkv", grads[True], grads[False]):
        scale = b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= 2 ** -6 * scale, f"d{name}"


@pytest.mark.gpu
@needs_hopper
def test_backward_agrees_with_the_triton_backward(monkeypatch, gluon_backward_calls):
    _gluon_and_triton_gradients(monkeypatch, "backward", 16, causal=True, window=(512, None))
    assert len(gluon_backward_calls) == 1


@pytest.mark.gpu
@needs_hopper
def test_broadcast_gradient_takes_the_triton_backward(gluon_backward_calls):
    """A gradient with stride-0 dimensions (one row of weights for every (batch, head, row)) is
    no TMA operand: the backend's launcher leaves it to the Triton backward, which reads it in
    place, and the result matches the oracle. (Autograd densifies such a gradient before the
    op's backward, so the launcher is called directly.)"""
    from kernelforge.triton import attention as triton_attention
    q, k, v = (torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    w = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    vis = Visibility.of(True, (50, None))
    out, lse = triton_attention.flash_forward(q, k, v, 0.125, vis)
    grads = triton_attention.flash_backward(w.expand(out.shape), q, k, v, out, lse, 0.125, vis)
    assert not gluon_backward_calls
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = naive_attention(*exact, scale=0.125, causal=True, window=(50, None))
    ref_grads = torch.autograd.grad(ref, exact, w.double().expand(ref.shape))
    for name, a, b in zip("qkv", grads, ref_grads):
        assert (a.double() - b).abs().max().item() <= 2e-2 * b.abs().max().item(), f"d{name}"


# (B, H, Hkv, Sq, Sk, D, causal): the Gluon backward without a window, at odd lengths
UNBANDED_CASES = [
    (1, 4, 4, 1000, 1000, 128, True),
    (2, 4, 1, 333, 333, 64, False),     # MQA
    (1, 8, 2, 17, 1000, 128, True),     # Sq < Sk: bottom-right causal, GQA
    (1, 2, 2, 1000, 300, 64, True),     # Sq > Sk: the first 700 rows see no key, zero gradients
    (1, 2, 2, 1, 4097, 128, False),     # one query against many keys
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", UNBANDED_CASES, ids=["-".join(map(str, c)) for c in UNBANDED_CASES])
@pytest.mark.gpu
@needs_hopper
def test_backward_without_a_window_matches_oracle(case, dtype, gluon_backward_calls):
    B, H, Hkv, Sq, Sk, D, causal = case
    check("triton", "cuda", dtype, B, H, Hkv, Sq, Sk, D, None, causal, None, None)
    assert gluon_backward_calls, "the Gluon backward did not run"


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3], UNBANDED_CASES[1]],
                         ids=["window-4097", "gqa-short-queries", "keyless-rows", "mqa-unbanded"])
@pytest.mark.gpu
@needs_hopper
def test_backward_with_delta_from_its_own_launch_matches_oracle(case, monkeypatch, gluon_backward_calls):
    """FUSE_DELTA off (the library's default has the dQ launch compute delta = rowsum(O * dO)
    and run before dK/dV): delta from the Triton kernel, dK/dV before dQ."""
    monkeypatch.setattr(gluon_backward, "FUSE_DELTA", False)
    B, H, Hkv, Sq, Sk, D, causal = case[:7]
    window = case[7] if len(case) > 7 else None
    check("triton", "cuda", torch.bfloat16, B, H, Hkv, Sq, Sk, D, None, causal, window, None)
    assert gluon_backward_calls, "the Gluon backward did not run"


@pytest.mark.gpu
@needs_hopper
def test_agrees_with_the_triton_forward(monkeypatch):
    q, k, v = (torch.randn(2, 16, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with kf.use_backend("triton"):
        out, lse = kf.flash_attention(q, k, v, causal=True, window=(512, None), return_lse=True)
        monkeypatch.setitem(gluon.ENABLED, "window", False)
        ref, ref_lse = kf.flash_attention(q, k, v, causal=True, window=(512, None), return_lse=True)
    # both sum the same bf16 products in fp32 in another order: a few bf16 ulps of |out| <= ~3
    assert (out.float() - ref.float()).abs().max().item() <= 2 ** -6
    assert (lse - ref_lse).abs().max().item() <= 1e-4


@pytest.mark.gpu
@needs_hopper
def test_keyless_rows_give_zeros(gluon_calls):
    q = torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 2, 100, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    with kf.use_backend("triton"):
        out, lse = kf.flash_attention(q, k, v, causal=True, window=(10, None), return_lse=True)
    assert gluon_calls
    assert torch.all(out[:, :, :200] == 0) and torch.all(lse[:, :, :200] == -math.inf)
    assert out[:, :, 200:].isfinite().all() and lse[:, :, 200:].isfinite().all()


# (name, BlockMask maker, H, Hkv, D, causal, window): every pattern, both tile sizes the kernel
# takes (64 and 128, each side), a per-batch mask, and a band on top of a mask
BLOCK_CASES = [
    ("window-128", lambda: kf.sliding_window_block_mask(4097, 4097, 512), 4, 4, 128, False, None),
    ("window-two-sided-64x128", lambda: kf.sliding_window_block_mask(1000, 1000, 100, causal=False, block_q=64),
     4, 1, 64, False, None),
    ("local-global-128x64", lambda: kf.local_global_block_mask(333, 1000, 64, 17, block_k=64), 8, 2, 128, False,
     None),
    ("dilated-64", lambda: kf.dilated_block_mask(1000, 1000, 300, 3, block_q=64, block_k=64), 2, 2, 64, False,
     None),
    ("random-per-batch-64", lambda: kf.BlockMask.from_dense(torch.rand(2, 1, 199, 333) > 0.8, 64, 64), 2, 2, 128,
     False, None),
    ("local-global-with-causal-window", lambda: kf.local_global_block_mask(1000, 1000, 200, 64), 2, 1, 128, True,
     (150, None)),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", BLOCK_CASES, ids=[c[0] for c in BLOCK_CASES])
@pytest.mark.gpu
@needs_hopper
def test_block_sparse_matches_oracle(case, dtype, gluon_calls):
    _, make, H, Hkv, D, causal, window = case
    _check_block_sparse("triton", "cuda", dtype, make(), H, Hkv, D, causal=causal, window=window)
    assert gluon_calls, "the Gluon forward did not run"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", BLOCK_CASES, ids=[c[0] for c in BLOCK_CASES])
@pytest.mark.gpu
@needs_hopper
def test_block_sparse_gluon_backward_matches_oracle(case, dtype, gluon_backward_calls):
    """The block-sparse Gluon backward against the float64 oracle on every pattern, forward
    through the Gluon forward."""
    _, make, H, Hkv, D, causal, window = case
    _check_block_sparse("triton", "cuda", dtype, make(), H, Hkv, D, causal=causal, window=window)
    assert gluon_backward_calls, "the Gluon backward did not run"


@pytest.mark.gpu
@needs_hopper
def test_block_sparse_gluon_backward_agrees_with_the_triton_backward(monkeypatch, gluon_backward_calls):
    bm = kf.local_global_block_mask(2048, 2048, 256, 64, device="cuda")
    _gluon_and_triton_gradients(monkeypatch, "block_mask_backward", 8, block_mask=bm)
    assert len(gluon_backward_calls) == 1


@pytest.mark.gpu
@needs_hopper
def test_block_sparse_query_tiles_with_nothing_listed(gluon_calls):
    """Whole 64-row blocks see no key (nothing listed: the kernel's all-hidden stand-in tile),
    others a few keys: zeros and -inf where nothing is seen, the oracle elsewhere."""
    Sq, Sk = 300, 200
    dense = torch.rand(1, 2, Sq, Sk) > 0.5
    dense[:, :, 64:192] = False
    bm = kf.BlockMask.from_dense(dense, block_q=64, block_k=64).to("cuda")
    assert bm.kv_counts[0, 0, 1].item() == 0
    q = torch.randn(1, 2, Sq, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, Sk, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with kf.use_backend("triton"):
        out, lse = kf.flash_attention(q, k, v, block_mask=bm, return_lse=True)
    assert gluon_calls
    assert torch.all(out[:, :, 64:192] == 0) and torch.all(lse[:, :, 64:192] == -math.inf)
    _check_block_sparse("triton", "cuda", torch.bfloat16, kf.BlockMask.from_dense(dense, 64, 64), 2, 2, 64)


@pytest.mark.gpu
@needs_hopper
def test_block_sparse_agrees_with_the_triton_forward(monkeypatch):
    q, k, v = (torch.randn(2, 8, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    bm = kf.sliding_window_block_mask(2048, 2048, 512, device="cuda")
    with kf.use_backend("triton"):
        out, lse = kf.flash_attention(q, k, v, block_mask=bm, return_lse=True)
        monkeypatch.setitem(gluon.ENABLED, "block_mask", False)
        ref, ref_lse = kf.flash_attention(q, k, v, block_mask=bm, return_lse=True)
    assert (out.float() - ref.float()).abs().max().item() <= 2 ** -6
    assert (lse - ref_lse).abs().max().item() <= 1e-4


def _inputs(dtype=torch.bfloat16, D=128, device="cpu"):
    return [torch.zeros(1, 2, 40, D, dtype=dtype, device=device) for _ in range(3)]


def test_takes_only_what_it_supports():
    q, k, v = _inputs()
    window = Visibility.of(True, (64, None))
    assert gluon.takes(q, k, v, window, (9, 0))
    assert not gluon.takes(q, k, v, window, (10, 0)), "wgmma is sm_90 only"
    assert not gluon.takes(q, k, v, window, (8, 0))
    assert not gluon.takes(q, k, v, Visibility.of(True, None), (9, 0)), "no left bound: the Triton forward"
    assert not gluon.takes(*_inputs(torch.float32), window, (9, 0))
    assert not gluon.takes(*_inputs(D=96), window, (9, 0))
    assert not gluon.takes(*_inputs(D=256), window, (9, 0))
    mask = torch.ones(40, 40, dtype=torch.bool)
    assert not gluon.takes(q, k, v, Visibility.of(True, (64, None), attn_mask=mask), (9, 0))
    odd = torch.zeros(1, 2, 40, 129, dtype=torch.bfloat16)[..., :128]  # rows of 258 bytes: no TMA
    assert not gluon.takes(odd, k, v, window, (9, 0))
    assert not gluon.takes(q, k[:, :, :0], v[:, :, :0], window, (9, 0)), "no keys"
    shared = torch.zeros(1, 1, 40, 128, dtype=torch.bfloat16).expand(1, 2, 40, 128)
    assert not gluon.takes(q, shared, shared, window, (9, 0)), "a stride-0 head dimension: no TMA"


def test_backward_takes_only_what_it_supports():
    q, k, v = _inputs()
    grad = torch.zeros_like(q)
    window = Visibility.of(True, (64, None))
    assert gluon_backward.takes(grad, q, k, v, window, (9, 0))
    assert gluon_backward.takes(grad, q, k, v, Visibility.of(False, (64, 30)), (9, 0)), "two-sided band"
    assert gluon_backward.takes(grad, q, k, v, Visibility.of(True, None), (9, 0)), "causal"
    assert gluon_backward.takes(grad, q, k, v, Visibility.of(False, None), (9, 0)), "every key"
    assert not gluon_backward.takes(grad, q, k, v, window, (8, 0)), "wgmma is sm_90 only"
    mask = torch.ones(40, 40, dtype=torch.bool)
    assert not gluon_backward.takes(grad, q, k, v, Visibility.of(True, (64, None), attn_mask=mask), (9, 0))
    assert not gluon_backward.takes(*_inputs(torch.float32)[:1], *_inputs(torch.float32), window, (9, 0))
    assert not gluon_backward.takes(*_inputs(D=96)[:1], *_inputs(D=96), window, (9, 0))
    assert not gluon_backward.takes(grad.half(), q, k, v, window, (9, 0)), "a gradient of another dtype"
    assert not gluon_backward.takes(torch.zeros(128, dtype=torch.bfloat16).expand(q.shape), q, k, v, window,
                                    (9, 0)), "a broadcast gradient: no TMA"


def test_backward_takes_block_masks_it_supports(monkeypatch):
    q, k, v = _inputs()
    grad = torch.zeros_like(q)
    bm = kf.sliding_window_block_mask(40, 40, 8)
    masked = Visibility.of(False, None, block_mask=bm)
    assert gluon_backward.takes(grad, q, k, v, masked, (9, 0))
    monkeypatch.setitem(gluon.ENABLED, "block_mask_backward", False)
    assert not gluon_backward.takes(grad, q, k, v, masked, (9, 0)), "switched off"
    monkeypatch.setitem(gluon.ENABLED, "block_mask_backward", True)
    assert gluon_backward.takes(grad, q, k, v, Visibility.of(True, (16, None), block_mask=bm), (9, 0)), "with a band"
    for block_q, block_k in ((128, 64), (64, 128), (128, 128)):
        bm = kf.sliding_window_block_mask(40, 40, 8, block_q=block_q, block_k=block_k)
        assert gluon_backward.takes(grad, q, k, v, Visibility.of(False, None, block_mask=bm), (9, 0))
    for block_q, block_k in ((32, 64), (64, 32)):  # smaller than a kernel tile: the Triton backward
        bm = kf.sliding_window_block_mask(40, 40, 8, block_q=block_q, block_k=block_k)
        assert not gluon_backward.takes(grad, q, k, v, Visibility.of(False, None, block_mask=bm), (9, 0))
    # one list per kv head in dK/dV: a mask that differs by head takes the Triton backward under GQA
    per_head = kf.BlockMask.from_dense(torch.rand(1, 4, 40, 40) > 0.5)
    q4 = torch.zeros(1, 4, 40, 128, dtype=torch.bfloat16)
    kv2 = torch.zeros(1, 2, 40, 128, dtype=torch.bfloat16)
    vis = Visibility.of(False, None, block_mask=per_head)
    assert not gluon_backward.takes(torch.zeros_like(q4), q4, kv2, kv2, vis, (9, 0))
    kv4 = torch.zeros(1, 4, 40, 128, dtype=torch.bfloat16)
    assert gluon_backward.takes(torch.zeros_like(q4), q4, kv4, kv4, vis, (9, 0)), "one q head a kv head"


def test_takes_block_masks_in_whole_kernel_tiles():
    q, k, v = _inputs()
    for block_q, block_k in ((128, 128), (64, 128), (128, 64), (64, 64), (256, 128)):
        bm = kf.sliding_window_block_mask(40, 40, 8, block_q=block_q, block_k=block_k)
        assert gluon.takes(q, k, v, Visibility.of(False, None, block_mask=bm), (9, 0)), (block_q, block_k)
        assert gluon.takes(q, k, v, Visibility.of(True, (16, None), block_mask=bm), (9, 0)), "with a band"
        assert not gluon.takes(q, k, v, Visibility.of(False, None, block_mask=bm), (8, 0))
    for block_q, block_k in ((32, 128), (128, 32), (16, 16)):  # smaller than a kernel tile: the Triton forward
        bm = kf.sliding_window_block_mask(40, 40, 8, block_q=block_q, block_k=block_k)
        assert not gluon.takes(q, k, v, Visibility.of(False, None, block_mask=bm), (9, 0)), (block_q, block_k)
    bm = kf.sliding_window_block_mask(40, 40, 8)
    mask = torch.ones(40, 40, dtype=torch.bool)
    assert not gluon.takes(q, k, v, Visibility.of(False, None, attn_mask=mask, block_mask=bm), (9, 0))
    assert not gluon.takes(*_inputs(torch.float32), Visibility.of(False, None, block_mask=bm), (9, 0))


@pytest.fixture(scope="module")
def sm90_builds():
    """compile_for_sm90 for each (head dim, right bound), in a process without TRITON_INTERPRET
    (the CPU suite's interpreter replaces jit functions, so nothing compiles in this one)."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, torch\n"
            "from kernelforge.triton.attention_gluon import compile_for_sm90\n"
            "from kernelforge.triton import attention_gluon_backward as b\n"
            "builds = {f'{d}-{r}-{s}': compile_for_sm90(d, torch.bfloat16, r, s)\n"
            "          for d in (64, 128) for r in (False, True) for s in (False, True)}\n"
            "for d in (64, 128):\n"
            "    for r in (False, True):\n"
            "        for s in (False, True):\n"
            "            kernels = ('dkdv', 'dq', 'dq_fuse_delta')\n"
            "            for kernel, usage in b.compile_for_sm90(d, torch.bfloat16, r, kernels, s).items():\n"
            "                builds[f'{kernel}-{d}-{r}-{s}'] = usage\n"
            "print(json.dumps(builds))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("has_right", [False, True])
@pytest.mark.parametrize("block_sparse", [False, True], ids=["band", "block-mask"])
def test_compiles_for_sm90_within_its_programs_an_sm(D, has_right, block_sparse, sm90_builds):
    """The kernel builds for sm_90a with this Triton (no GPU needed: ptxas ships with Triton),
    without spills, in registers and shared memory that let two programs share an SM, three at
    d128 without a BlockMask (a one-stage ring: gluon.ring_stages)."""
    usage = sm90_builds[f"{D}-{has_right}-{block_sparse}"]
    programs = 3 if D == 128 and not block_sparse else 2
    assert usage["spills"] == 0, usage
    assert usage["registers"] * 128 * programs <= 65536, usage
    assert programs * (usage["shared"] + 1024) <= 228 * 1024, usage


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("has_right", [False, True])
@pytest.mark.parametrize("kernel", ["dkdv", "dq", "dq_fuse_delta"])
@pytest.mark.parametrize("block_sparse", [False, True], ids=["band", "block-mask"])
def test_backward_compiles_for_sm90_within_its_programs_an_sm(D, has_right, kernel, block_sparse, sm90_builds):
    """The backward kernels build for sm_90a without spills, within two programs an SM, and
    dQ at d128 without a BlockMask (one ring stage: gluon_backward._dq_stages) within three."""
    usage = sm90_builds[f"{kernel}-{D}-{has_right}-{block_sparse}"]
    programs = 3 if kernel.startswith("dq") and D == 128 and not block_sparse else 2
    assert usage["spills"] == 0, usage
    assert usage["registers"] * 128 * programs <= 65536, usage
    assert programs * (usage["shared"] + 1024) <= 228 * 1024, usage
