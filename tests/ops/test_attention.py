"""flash_attention: every backend against the float64 oracle (output, lse, dQ, dK, dV) over
the option combinations (causal, window, bool / additive masks, grouped heads, Sq != Sk,
head dims, odd lengths), fully masked rows, strided inputs, the registered ops (opcheck),
torch.compile, determinism, NaN and infinities as torch's SDPA, and bad input. Block masks:
tests/ops/test_block_mask.py."""
import math

import pytest
import torch

import kernelforge as kf
from tests.attention_oracle import gradient_term_scales, naive_attention
from tests.conftest import HAS_CUDA, backend_cases
from tests.numerics import assert_matches_oracle
from tests.op_paths import assert_eager_path_equals_registered_op

GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def dtypes_for(backend, device):
    if device == "cpu" and backend == "triton":
        return [torch.float32, torch.float16]  # the interpreter's bfloat16 dot is wrong: GPU suite
    if backend == "cuda":
        return [torch.float16, torch.bfloat16]
    return GPU_DTYPES + ([torch.float64] if backend == "reference" else [])


def make_mask(kind, B, H, Sq, Sk, device):
    if kind is None:
        return None
    if kind == "bool":  # per-head, broadcast over batch; about a third hidden
        return torch.rand(1, H, Sq, Sk, device=device) > 0.3
    if kind == "bool_rows":  # (Sq, Sk): whole rows hidden, broadcast over batch and heads
        m = torch.rand(Sq, Sk, device=device) > 0.5
        m[::3] = False
        return m
    assert kind == "float"  # additive (B, 1, 1, Sk) bias with some -inf (padding-style)
    bias = torch.randn(B, 1, 1, Sk, device=device)
    bias[..., ::4] = -math.inf
    return bias


def check(backend, device, dtype, B, H, Hkv, Sq, Sk, D, Dv=None, causal=False, window=None, mask=None,
          backward=True, layout="dense"):
    """Output, lse and gradients of flash_attention on `backend` against the float64 oracle,
    with the same computation in `dtype` (naive, in PyTorch) as the yardstick."""
    Dv = Dv or D
    shapes = ((B, H, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv))
    if layout == "bshd":  # (batch, seq, heads, dim) storage seen through a transpose, as models do
        q, k, v = (torch.randn(s[0], s[2], s[1], s[3], device=device, dtype=dtype).transpose(1, 2) for s in shapes)
    else:
        q, k, v = (torch.randn(s, device=device, dtype=dtype) for s in shapes)
    attn_mask = make_mask(mask, B, H, Sq, Sk, device)
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.to(dtype)
    scale = 0.7 / math.sqrt(D)
    mine = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    theirs = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    exact = [t.detach().double().requires_grad_(backward) for t in (q, k, v)]
    what = f"{backend} {dtype} B{B} H{H}/{Hkv} Sq{Sq} Sk{Sk} D{D}/{Dv} causal={causal} window={window} mask={mask}"

    with kf.use_backend(backend):
        out, lse = kf.flash_attention(*mine, causal=causal, scale=scale, attn_mask=attn_mask, window=window,
                                      return_lse=True)
    opts = dict(scale=scale, causal=causal, window=window, attn_mask=attn_mask)
    out_theirs, _ = naive_attention(*theirs, **opts)
    exact_mask = attn_mask.double() if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
    out_exact, lse_exact = naive_attention(*exact, **{**opts, "attn_mask": exact_mask})
    assert out.shape == (B, H, Sq, Dv) and out.dtype == dtype and out.device == q.device
    assert_matches_oracle(out, out_theirs, out_exact, f"{what} out", reduced=Sk)
    assert lse.shape == (B, H, Sq) and not lse.requires_grad
    finite = lse_exact.isfinite()
    assert torch.equal(lse.isfinite().cpu(), finite.cpu()), f"{what}: lse -inf rows differ"
    lse_tol = 1e-5 if dtype == torch.float64 else 1e-4 * (1 + lse_exact[finite].abs().max().item())
    assert (lse.double() - lse_exact)[finite].abs().max().item() <= lse_tol if finite.any() else True, what
    if not backward:
        return
    grad = torch.randn_like(out)
    with kf.use_backend(backend):
        dq, dk, dv = torch.autograd.grad(out, mine, grad)
    g_theirs = torch.autograd.grad(out_theirs, theirs, grad)
    g_exact = torch.autograd.grad(out_exact, exact, grad.double())
    term_scales = gradient_term_scales(q, k, v, grad, **{**opts, "attn_mask": exact_mask})
    for name, a, b, c, n, t in zip(("dq", "dk", "dv"), (dq, dk, dv), g_theirs, g_exact,
                                   (Sk, Sq * H // Hkv, Sq * H // Hkv), term_scales):
        assert a.shape == c.shape and a.dtype == dtype
        assert_matches_oracle(a, b, c, f"{what} {name}", reduced=n, terms_scale=t)


# (B, H, Hkv, Sq, Sk, D, Dv, causal, window, mask): every option, each with others, at odd lengths
CASES = [
    (2, 4, 4, 17, 17, 64, None, False, None, None),
    (1, 4, 2, 17, 33, 32, None, True, None, None),            # GQA, Sq < Sk causal (bottom right)
    (2, 2, 1, 40, 17, 64, None, True, None, None),            # MQA, Sq > Sk causal: leading rows see nothing
    (1, 2, 2, 1, 100, 128, None, True, None, None),           # one query (decode-like)
    (1, 2, 2, 65, 65, 96, None, False, (8, 3), None),         # window, head dim 96 (padded tiles)
    (1, 4, 2, 50, 70, 32, None, True, (20, None), "bool"),    # causal + window + bool mask + GQA
    (2, 2, 2, 33, 47, 64, 32, False, None, "float"),          # additive mask with -inf, Dv != D
    (1, 2, 1, 48, 48, 16, None, False, (0, 0), "bool_rows"),  # diagonal only; whole rows masked
    # a left-bounded window and no mask: one loop, the band checked on edge tiles at run time
    (1, 4, 2, 70, 90, 32, None, True, (25, None), None),      # causal window, GQA, Sq < Sk, tails
    (2, 2, 1, 75, 40, 64, None, False, (10, None), None),     # left bound only, Sq > Sk
    # a few queries against a long cache: Triton splits the keys (flash-decoding)
    (2, 8, 2, 1, 600, 32, None, False, None, None),
    (1, 4, 1, 4, 700, 64, None, True, (100, None), "bool"),
    (1, 2, 2, 2, 530, 32, 16, False, None, "float"),
]
CPU_TRITON_CASES = CASES  # all small enough for the interpreter
GPU_CASES = CASES + [
    (1, 2, 2, 1000, 1000, 128, None, True, None, None),
    (1, 2, 1, 4097, 4097, 64, None, False, None, None),
    (1, 2, 2, 1000, 4097, 256, None, True, (300, 0), None),
    (2, 8, 2, 1000, 1000, 128, None, False, None, "bool"),
    # eight query heads a key head: float32 dK / dV summed over the group as one FMA chain missed
    # the bound (docs/notes/attention.md)
    (1, 16, 2, 1000, 1000, 64, None, False, None, None),
    (4, 32, 8, 1, 4097, 128, None, True, None, None),         # decode with GQA, odd cache length
]


def _cases(backend, device):
    cases = GPU_CASES if device == "cuda" else CASES
    if backend == "cuda":  # causal and window only
        cases = [c for c in cases if c[9] is None and c[6] is None]
    return cases


def _params():
    out = []
    for bc in backend_cases():
        backend, device = bc.values
        for dtype in dtypes_for(backend, device):
            for case in _cases(backend, device):
                out.append(pytest.param(backend, device, dtype, case, marks=bc.marks,
                                        id=f"{bc.id}-{str(dtype)[6:]}-{'-'.join(map(str, case))}"))
    return out


@pytest.mark.parametrize("backend,device,dtype,case", _params())
def test_matches_oracle(backend, device, dtype, case):
    B, H, Hkv, Sq, Sk, D, Dv, causal, window, mask = case
    check(backend, device, dtype, B, H, Hkv, Sq, Sk, D, Dv, causal, window, mask, backward=backend != "cuda")


WINDOW_CASES = [c for c in CASES if c[8] is not None and c[8][0] is not None and c[9] is None]


@pytest.mark.parametrize("backend,device", backend_cases(("triton",)))
@pytest.mark.parametrize("one_loop", [True, False], ids=["one-loop", "three-loops"])
def test_window_band_walks_both_match_oracle(backend, device, one_loop, monkeypatch):
    # The Triton kernels walk a left-bounded window either as one loop with the band checked
    # on edge tiles at run time or as three loops (masked, unmasked, masked): both, each direction.
    from kernelforge.triton import attention as triton_attention

    assert len(WINDOW_CASES) >= 2
    monkeypatch.setitem(triton_attention.ONE_LOOP_WINDOW, "forward", one_loop)
    monkeypatch.setitem(triton_attention.ONE_LOOP_WINDOW, "backward", one_loop)
    for B, H, Hkv, Sq, Sk, D, Dv, causal, window, mask in WINDOW_CASES:
        check(backend, device, torch.float16, B, H, Hkv, Sq, Sk, D, Dv, causal, window, mask)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_strided_bshd_inputs(backend, device):
    check(backend, device, torch.float32, 2, 4, 2, 23, 31, 32, causal=True, layout="bshd")


@pytest.mark.parametrize("backend,device", backend_cases())
def test_fully_masked_rows_give_zeros_and_zero_gradients(backend, device):
    dtype = torch.float16 if backend == "cuda" else torch.float32
    B, H, S, D = 1, 2, 37, 32
    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    # a bool mask hides every key from rows 0..9
    mask = torch.ones(S, S, dtype=torch.bool, device=device)
    mask[:10] = False
    with kf.use_backend(backend):
        if backend == "cuda":  # forward only, no attn_mask: causal with Sq > Sk leaves the first rows keyless
            out, lse = kf.flash_attention(q.detach(), k[:, :, :27].detach(), v[:, :, :27].detach(), causal=True,
                                          return_lse=True)
            assert torch.all(out[:, :, :10] == 0) and torch.all(lse[:, :, :10] == -math.inf)
            assert not out.isnan().any()
            return
        out, lse = kf.flash_attention(q, k, v, attn_mask=mask, return_lse=True)
        out.sum().backward()
    assert not out.isnan().any() and torch.all(out[:, :, :10] == 0)
    assert torch.all(lse[:, :, :10] == -math.inf) and lse[:, :, 10:].isfinite().all()
    assert not q.grad.isnan().any() and torch.all(q.grad[:, :, :10] == 0)
    assert not k.grad.isnan().any() and not v.grad.isnan().any()


def _sdpa_in_float64(q, k, v, mask):
    """torch's SDPA (the math backend: float64 on the CPU) of float64 CPU q, k, v, with the kv heads
    repeated for the group."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, 1) for t in (k, v))
    mask = None if mask is None else mask.double().cpu()
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# (where the special value goes, what) over q (B, H, Sq, D), k / v (B, Hkv, Sk, D), an additive mask
# (Sq, Sk): a NaN in q's row 3, in key 7 (hidden from no row), in a float mask's (2, 4); +inf in q
# (row 5: scores of both signs, inf - inf); -inf in a key (NaN for rows whose q has the other sign:
# head 0's are made negative there, so some row is NaN whatever the draw)
SPECIAL_VALUES = [("q", (0, 0, 3, 5), math.nan), ("k", (0, 0, 7, 1), math.nan), ("v", (0, 0, 7, 2), math.nan),
                  ("mask", (2, 4), math.nan), ("q", (0, 1, 5, 0), math.inf), ("k", (0, 0, 9, 0), -math.inf)]


@pytest.mark.parametrize("backend,device", backend_cases())
@pytest.mark.parametrize("shape", [(2, 1, 37, 45, 32), (2, 2, 200, 200, 64), (4, 2, 1, 600, 64)],
                         ids=["gqa", "d64", "decode"])
def test_nan_and_inf_propagate_as_in_sdpa(backend, device, shape):
    # A NaN or infinity must show in the rows torch's SDPA gives NaN (a training run that goes NaN
    # shows NaN, not a silently zeroed head), and leave the other rows as they were; the gradients
    # NaN where SDPA's are. Shapes: the query-tiled kernels (grouped heads), head dim 64 (Gluon on
    # Hopper), one query over 600 keys (the split-key decode kernels and their merge on a GPU).
    H, Hkv, Sq, Sk, D = shape
    dtype = torch.float16 if backend == "cuda" or device == "cuda" else torch.float32
    backward = backend != "cuda"  # the CUDA extension is forward-only
    for where, index, value in SPECIAL_VALUES:
        if where == "mask" and backend == "cuda":
            continue  # the CUDA kernels take no attn_mask
        row = {"q": 2, "mask": 0}.get(where)
        if row is not None:  # the last query row where Sq is shorter (decode)
            index = index[:row] + (min(index[row], Sq - 1),) + index[row + 1:]
        q = torch.randn(1, H, Sq, D, device=device, dtype=dtype)
        k, v = (torch.randn(1, Hkv, Sk, D, device=device, dtype=dtype) for _ in range(2))
        mask = torch.randn(Sq, Sk, device=device, dtype=dtype) if where == "mask" else None
        target = {"q": q, "k": k, "v": v, "mask": mask}[where]
        target[index] = value
        if where == "k" and value == -math.inf:  # head 0's queries negative there: a +inf score each
            q[0, 0, :, index[3]] = -q[0, 0, :, index[3]].abs() - 0.1
        leaves = [t.requires_grad_(backward) for t in (q, k, v)]
        with kf.use_backend(backend):
            out, lse = kf.flash_attention(*leaves, attn_mask=mask, return_lse=True)
        what = f"{backend} {dtype} {shape} {value} in {where}{index}"
        exact = [t.detach().double().cpu().requires_grad_(backward) for t in (q, k, v)]
        want = _sdpa_in_float64(*exact, mask)
        nan_rows = want.isnan().any(-1)
        assert nan_rows.any(), what  # every case makes some row NaN
        assert torch.equal(out.isnan().any(-1).cpu(), nan_rows), what
        # lse is the scores' alone: NaN in the rows a NaN score reaches, finite under a NaN in v
        assert torch.equal(lse.isnan().cpu(), nan_rows & (where != "v")), what
        assert lse.isfinite().cpu()[~lse.isnan().cpu()].all(), what
        torch.testing.assert_close(out.cpu()[~nan_rows].double(), want[~nan_rows], atol=2e-2, rtol=2e-2, msg=what)
        if backward:
            grad = torch.randn_like(out)
            got = torch.autograd.grad(out, leaves, grad)
            expected = torch.autograd.grad(want, exact, grad.double().cpu())
            for name, g, e in zip("qkv", got, expected):
                assert torch.equal(g.isnan().cpu(), e.isnan()), f"{what}: d{name}'s NaN pattern"



@pytest.mark.parametrize("backend,device", backend_cases())
@pytest.mark.parametrize("hiding", ["causal", "window", "bool mask"])
def test_a_hidden_keys_nan_or_inf_k_reaches_no_row(backend, device, hiding):
    # Hidden means hidden: a NaN or infinity in the k of a key a row does not see changes nothing
    # in that row (its score is replaced, not offset, by -inf; NaN + -inf would be NaN), on every
    # backend alike. torch's own backends differ here (its math SDPA, and any of them given a bool
    # mask, which it turns into an additive one, make every row NaN); its flash kernels under
    # is_causal agree with this. (A hidden key's v, and its k in dq = dS K, reach rows through a
    # zero weight, 0 x NaN, as in torch: docs/special_values.md.)
    if backend == "cuda" and hiding == "bool mask":
        pytest.skip("the CUDA kernels take no attn_mask")
    H, Sq, Sk, D, bad = 2, 70, 70, 32, 40
    dtype = torch.float16 if device == "cuda" else torch.float32
    rows = torch.arange(Sq).view(-1, 1)
    keys = torch.arange(Sk).view(1, -1)
    options = {"causal": dict(causal=True), "window": dict(window=(8, 8)),
               "bool mask": dict(attn_mask=torch.rand(Sq, Sk, device=device) < 0.5)}[hiding]
    visible = {"causal": keys <= rows, "window": (keys - rows).abs() <= 8,
               "bool mask": options.get("attn_mask", torch.ones(1, dtype=torch.bool)).cpu()}[hiding]
    for value in (math.nan, math.inf, -math.inf):
        q, k, v = (torch.randn(1, H, S, D, device=device, dtype=dtype) for S in (Sq, Sk, Sk))
        k[0, :, bad, 3] = value
        with kf.use_backend(backend):
            out = kf.flash_attention(q, k, v, **options)
        sees_it = visible[:, bad]
        what = f"{backend} {hiding} {value}"
        component = q[0, :, :, 3].cpu()
        # an infinity in k is NaN only where it makes a +inf score (inf - inf) or meets a 0 (0 x inf)
        nan_scores = {math.inf: component >= 0, -math.inf: component <= 0}.get(value, torch.ones(H, Sq, dtype=torch.bool))
        sees_it = sees_it.view(1, 1, Sq) & nan_scores
        assert torch.equal(out.isnan().any(-1).cpu(), sees_it), what

def test_cpu_functions_match_sdpa():
    q, k, v = (torch.randn(2, 8, 300, 64) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(kf.cpu_fused_attention(q, k, v), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kf.optimized_cpu_attention(q, k, v, chunk_size=64), expected, rtol=1e-5, atol=1e-5)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(kf.optimized_cpu_attention(q, k, v, chunk_size=7, causal=True), expected,
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="chunk_size"):
        kf.optimized_cpu_attention(q, k, v, chunk_size=0)


def test_long_cpu_attention_does_not_allocate_the_score_matrix():
    """16k tokens: the score matrix alone would be 1 GiB in float32; the chunked path holds
    16k x 256 scores at a time. Measured as the process's peak RSS in a fresh interpreter."""
    import subprocess
    import sys

    code = (
        "import resource, torch, kernelforge as kf\n"
        "torch.manual_seed(0)\n"
        "q, k, v = (torch.randn(1, 1, 16384, 16) for _ in range(3))\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "out = kf.flash_attention(q, k, v, causal=True)\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "assert out.isfinite().all()\n"
        "print((after - before) // 1024)\n"
    )
    grown_mib = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                   text=True).stdout.split()[-1])
    assert grown_mib < 256, f"peak RSS grew {grown_mib} MiB (a 16k x 16k float32 matrix is 1024 MiB)"


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_opcheck(backend, device):
    q = torch.randn(1, 4, 19, 32, device=device, requires_grad=True)
    k = torch.randn(1, 2, 23, 32, device=device, requires_grad=True)
    v = torch.randn(1, 2, 23, 32, device=device, requires_grad=True)
    mask = torch.rand(19, 23, device=device) > 0.2
    # (batch, seq, heads, dim) storage seen as (batch, heads, seq, dim), as attention layers pass it
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v))
    with kf.use_backend(backend):
        torch.library.opcheck(torch.ops.kernelforge.flash_attention.default,
                              (q, k, v, 0.2, 5, 0, mask.expand(1, 1, 19, 23), [], 0, 0))
        out, lse = torch.ops.kernelforge.flash_attention(q.detach(), k.detach(), v.detach(), 0.2, -1, 0, None, [], 0, 0)
        g = torch.randn_like(out)
        torch.library.opcheck(torch.ops.kernelforge.flash_attention_backward.default,
                              (g, q.detach(), k.detach(), v.detach(), out, lse, 0.2, -1, 0, None, [], 0, 0))


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_torch_compile_matches_eager(backend, device):
    q, k, v = (torch.randn(2, 4, 33, 32, device=device, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return kf.flash_attention(q, k, v, causal=True, window=(9, None)).square().sum()

    with kf.use_backend(backend):
        eager = f(q, k, v)
        grads = torch.autograd.grad(eager, (q, k, v))
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")(q, k, v)
        grads_c = torch.autograd.grad(compiled, (q, k, v))
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend,device", backend_cases(("triton",)))
def test_backward_is_deterministic(backend, device):
    q = torch.randn(1, 8, 300, 64, device=device, requires_grad=True)
    k, v = (torch.randn(1, 2, 300, 64, device=device, requires_grad=True) for _ in range(2))
    with kf.use_backend(backend):
        out = kf.flash_attention(q, k, v, causal=True)
        g = torch.randn_like(out)
        first = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        second = torch.autograd.grad(out, (q, k, v), g)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_empty_inputs():
    q = torch.randn(2, 4, 0, 32, requires_grad=True)
    k = torch.randn(2, 4, 5, 32, requires_grad=True)
    v = torch.randn(2, 4, 5, 32, requires_grad=True)
    out = kf.flash_attention(q, k, v)
    assert out.shape == (2, 4, 0, 32)
    out.sum().backward()
    assert torch.all(k.grad == 0)
    q = torch.randn(1, 2, 3, 8)
    out, lse = kf.flash_attention(q, torch.randn(1, 2, 0, 8), torch.randn(1, 2, 0, 8), return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


@pytest.mark.parametrize("kwargs,match", [
    (dict(q=torch.randn(2, 3, 4)), "q must be 4-D"),
    (dict(k=torch.randn(1, 3, 5, 8), v=torch.randn(1, 3, 5, 8)), "must divide the heads of q"),
    (dict(v=torch.randn(1, 2, 6, 8)), "k and v must agree"),
    (dict(k=torch.randn(1, 2, 5, 16)), "same head_dim"),
    (dict(q=torch.randn(1, 4, 4, 0), k=torch.randn(1, 2, 5, 0)),
     r"head_dim of at least 1, got q of shape \(1, 4, 4, 0\)"),
    (dict(scale="0.5"), "scale must be a real number, got str '0.5'"),
    (dict(scale=[0.5]), r"scale must be a real number, got list \[0.5\]"),
    (dict(v=torch.randn(1, 2, 5, 8, dtype=torch.float64)), "same dtype"),
    (dict(q=torch.randn(1, 4, 4, 8).int()), "dtype in"),
    (dict(window=(3,)), "pair"),
    (dict(window=(-5, 0)), "window left"),
    (dict(attn_mask=torch.ones(4, 6, dtype=torch.bool)), "does not broadcast"),
    (dict(attn_mask=torch.ones(4, 5, dtype=torch.int64)), "attn_mask must be bool"),
    (dict(attn_mask=torch.zeros(4, 5, requires_grad=True)), "attn_mask.detach"),
    (dict(block_mask=torch.ones(4, 5)), "kernelforge.BlockMask"),
    (dict(cache_seqlens=[3]), "cache_seqlens must be a tensor of int32 or int64 lengths"),
    (dict(cache_seqlens=torch.tensor([3.0])), "cache_seqlens must have dtype int32 or int64, got torch.float32"),
    (dict(cache_seqlens=torch.tensor([3, 4])), r"cache_seqlens must have shape \(batch,\) = \(1,\), got \(2,\)"),
    (dict(cache_seqlens=torch.tensor([[3]])), r"cache_seqlens must have shape \(batch,\) = \(1,\), got \(1, 1\)"),
    (dict(cache_seqlens=torch.tensor([3], device="meta")), "cache_seqlens must be on q's device cpu, got meta"),
    (dict(q=torch.randn(1, 4, 4, 8, requires_grad=True), cache_seqlens=torch.tensor([3])),
     "gradients with cache_seqlens are not computed"),
])
def test_bad_input_is_named(kwargs, match):
    args = dict(q=torch.randn(1, 4, 4, 8), k=torch.randn(1, 2, 5, 8), v=torch.randn(1, 2, 5, 8))
    args.update(kwargs)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises((ValueError, TypeError, RuntimeError, NotImplementedError), match=match):
        kf.flash_attention(q, k, v, **args)


def test_explain_names_the_attention_backends():
    q = torch.randn(1, 2, 4, 8)
    text = kf.explain("attention", q, q, q)
    assert "reference" in text and "cuda" in text


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_default_backend_on_gpu_runs_backward_on_triton():
    q, k, v = (torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    kf.flash_attention(q, k, v, causal=True).sum().backward()
    assert "triton" in kf.explain("attention", q, k, v, backward=True)


def test_eager_fast_path_equals_registered_op():
    # kf.flash_attention runs the implementation directly in plain eager mode (through the op's
    # generated autograd.Function when a gradient is needed) and the registered op elsewhere
    from kernelforge.ops.attention import flash_attention_op

    k, v = torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 16)
    x = torch.randn(2, 11, 4, 16).transpose(1, 2)  # (batch, seq, heads, dim) storage
    assert_eager_path_equals_registered_op(
        lambda t: kf.flash_attention(t, k, v, causal=True, scale=0.3), flash_attention_op,
        lambda t: torch.ops.kernelforge.flash_attention(t, k, v, 0.3, -1, 0, None, [], 0, 0)[0], x)

