"""flash_attention_varlen: every backend against a float64 oracle computed sequence by sequence
(output, lse, dQ, dK, dV) over packed lengths including 0, 1 and primes, unequal q / k lengths
(causal with Lq <= Lk and Lq > Lk), grouped heads, windows, strided views and padding rows;
the registered ops (opcheck), torch.compile, and bad input."""
import math

import pytest
import torch

import kernelforge as kf
from tests.attention_oracle import gradient_term_scales, naive_attention
from tests.conftest import backend_cases, device_cases, needs_cuda
from tests.numerics import assert_matches_oracle
from tests.op_paths import assert_eager_path_equals_registered_op


def dtypes_for(backend, device):
    if device == "cpu" and backend == "triton":
        return [torch.float32, torch.float16]  # the interpreter's bfloat16 dot is wrong: GPU suite
    return [torch.float32, torch.float16, torch.bfloat16] + ([torch.float64] if backend == "reference" else [])


def offsets(lengths, device):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)


def per_sequence(q, k, v, lens_q, lens_k, **options):
    """The oracle: naive attention (softmax(scale Q K^T masked) V, in plain torch) of each sequence
    alone, packed back: (out (total_q, H, Dv), lse (total_q, H)); rows past the sequences are 0 / -inf."""
    outs, lses = [], []
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_k):
        heads_first = [t.transpose(0, 1).unsqueeze(0) for t in (q[q0:q0 + lq], k[k0:k0 + lk], v[k0:k0 + lk])]
        out, lse = naive_attention(*heads_first, **options)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0].transpose(0, 1))
        q0, k0 = q0 + lq, k0 + lk
    pad = q.shape[0] - q0
    outs.append(q.new_zeros(pad, q.shape[1], v.shape[-1]))
    lses.append(torch.full((pad, q.shape[1]), -math.inf, dtype=q.dtype))
    return torch.cat(outs), torch.cat(lses)


def term_scales(q, k, v, grad, lens_q, lens_k, **options):
    """The largest cancelling term of each gradient (tests/attention_oracle.py), over the sequences."""
    scales = [0.0, 0.0, 0.0]
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_k):
        if lq and lk:
            views = [t.transpose(0, 1).unsqueeze(0) for t in (q[q0:q0 + lq], k[k0:k0 + lk], v[k0:k0 + lk],
                                                             grad[q0:q0 + lq])]
            scales = [max(a, b) for a, b in zip(scales, gradient_term_scales(*views, **options))]
        q0, k0 = q0 + lq, k0 + lk
    return scales


def make_inputs(lens_q, lens_k, H, Hkv, D, Dv, dtype, device, layout="dense", pad=0):
    total_q, total_k = sum(lens_q) + pad, sum(lens_k) + pad
    if layout == "packed":  # q, k, v as views of one (tokens, 3, heads, dim) projection: strided rows
        assert total_q == total_k and H == Hkv and D == Dv
        qkv = torch.randn(total_q, 3, H, D, device=device, dtype=dtype)
        return qkv[:, 0], qkv[:, 1], qkv[:, 2]
    if layout == "dim_major":  # (heads, tokens, dim) storage seen token-first
        return (torch.randn(h, t, d, device=device, dtype=dtype).transpose(0, 1)
                for t, h, d in ((total_q, H, D), (total_k, Hkv, D), (total_k, Hkv, Dv)))
    return (torch.randn(t, h, d, device=device, dtype=dtype) for t, h, d in ((total_q, H, D), (total_k, Hkv, D),
                                                                             (total_k, Hkv, Dv)))


def check(backend, device, dtype, lens_q, lens_k, H, Hkv, D, Dv=None, causal=False, window=None, layout="dense",
          pad=0, slack=0):
    """Output, lse and gradients on `backend` against the float64 oracle, with the same naive
    computation in `dtype` as the yardstick (tests/numerics.py). pad: rows of q and k past the
    last sequence; slack: added to max_seqlen (the grid is then larger than the work)."""
    Dv = Dv or D
    q, k, v = make_inputs(lens_q, lens_k, H, Hkv, D, Dv, dtype, device, layout, pad)
    cu_q, cu_k = offsets(lens_q, device), offsets(lens_k, device)
    scale = 0.7 / math.sqrt(D)
    mine = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    theirs = [t.detach().cpu().clone().requires_grad_() for t in (q, k, v)]
    exact = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    what = f"{backend} {dtype} lens {lens_q}/{lens_k} H{H}/{Hkv} D{D}/{Dv} causal={causal} window={window} {layout}"
    with kf.use_backend(backend):
        out, lse = kf.flash_attention_varlen(*mine, cu_q, cu_k, max(lens_q) + slack, max(lens_k) + slack,
                                             causal=causal, window=window, scale=scale, return_lse=True)
    opts = dict(scale=scale, causal=causal, window=window)
    out_theirs, _ = per_sequence(*theirs, lens_q, lens_k, **opts)
    out_exact, lse_exact = per_sequence(*exact, lens_q, lens_k, **opts)
    total_q = q.shape[0]
    assert out.shape == (total_q, H, Dv) and out.dtype == dtype and out.device == q.device and out.is_contiguous()
    assert_matches_oracle(out, out_theirs.to(device), out_exact, f"{what} out", reduced=max(lens_k))
    assert lse.shape == (total_q, H) and not lse.requires_grad
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    finite = lse_exact.isfinite()
    assert torch.equal(lse.isfinite().cpu(), finite), f"{what}: lse -inf rows differ"
    if finite.any():
        tol = 1e-9 if dtype == torch.float64 else 1e-4 * (1 + lse_exact[finite].abs().max().item())
        assert (lse.cpu().double() - lse_exact)[finite].abs().max().item() <= tol, what
    assert torch.all(out.cpu()[~finite] == 0), f"{what}: a row that sees no key is not zero"

    grad = torch.randn_like(out)
    with kf.use_backend(backend):
        grads = torch.autograd.grad(out, mine, grad)
    g_theirs = torch.autograd.grad(out_theirs, theirs, grad.cpu())
    g_exact = torch.autograd.grad(out_exact, exact, grad.cpu().double())
    scales = term_scales(*exact, grad.cpu().double(), lens_q, lens_k, **opts)
    group = H // Hkv
    for name, a, b, c, n, s in zip(("dq", "dk", "dv"), grads, g_theirs, g_exact,
                                   (max(lens_k), max(lens_q) * group, max(lens_q) * group), scales):
        assert a.shape == c.shape and a.dtype == dtype and a.is_contiguous(), f"{what} {name}"
        assert_matches_oracle(a, b.to(device), c, f"{what} {name}", reduced=max(n, 1), terms_scale=s)
    assert torch.all(grads[0].cpu()[~finite] == 0), f"{what}: a keyless row has a gradient"


# (lens_q, lens_k, H, Hkv, D, Dv, causal, window): lengths 0, 1 and primes, several tiles of 16
CASES = [
    ([5, 0, 17, 1, 33], [5, 0, 17, 1, 33], 4, 2, 32, None, False, None),     # GQA, an empty sequence
    ([7, 13, 1, 31], [7, 13, 1, 31], 2, 1, 16, None, True, None),            # MQA causal, Lq = Lk
    ([3, 19, 0, 11, 37], [10, 29, 4, 5, 2], 4, 4, 16, 32, True, None),       # causal Lq < Lk and Lq > Lk, Dv != D
    ([23, 2, 37], [29, 0, 17], 4, 2, 64, 16, False, (4, 2)),                 # window, a keyless sequence
    ([41, 17], [41, 43], 2, 2, 32, None, True, (8, None)),                   # causal sliding window
    ([1, 1, 1, 3], [37, 2, 0, 53], 4, 1, 32, None, True, (5, 0)),            # decode-like rows
    ([29, 31], [31, 29], 2, 1, 48, None, False, (None, 3)),                  # right bound only, D 48 (padded)
]


def _params():
    out = []
    for bc in backend_cases(("reference", "triton")):
        backend, device = bc.values
        for dtype in dtypes_for(backend, device):
            for i, case in enumerate(CASES):
                out.append(pytest.param(backend, device, dtype, case, marks=bc.marks,
                                        id=f"{bc.id}-{str(dtype)[6:]}-case{i}"))
    return out


@pytest.mark.parametrize("backend,device,dtype,case", _params())
def test_matches_oracle(backend, device, dtype, case):
    lens_q, lens_k, H, Hkv, D, Dv, causal, window = case
    check(backend, device, dtype, lens_q, lens_k, H, Hkv, D, Dv, causal, window)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
@pytest.mark.parametrize("layout", ["packed", "dim_major"])
def test_strided_views(backend, device, layout):
    check(backend, device, torch.float32, [19, 0, 34], [19, 0, 34], 2, 2, 32, causal=True, layout=layout)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_padding_rows_and_larger_max_seqlen(backend, device):
    # rows past cu_seqlens[-1] (a padded batch) give zeros, -inf and zero gradients; a max_seqlen
    # above every length only widens the grid
    check(backend, device, torch.float32, [9, 20], [14, 3], 4, 2, 16, causal=True, pad=7, slack=21)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_int64_offsets_and_no_sequences(backend, device):
    q, k, v = (torch.randn(6, 2, 16, device=device) for _ in range(3))
    lens = torch.tensor([0, 4, 6], device=device)
    with kf.use_backend(backend):
        a = kf.flash_attention_varlen(q, k, v, lens, lens, 4, 4, causal=True)
        b = kf.flash_attention_varlen(q, k, v, lens.int(), lens.int(), 4, 4, causal=True)
        assert torch.equal(a, b)
        out, lse = kf.flash_attention_varlen(q, k, v, lens[:1], lens[:1], 0, 0, return_lse=True)  # batch 0
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


@pytest.mark.parametrize("device", device_cases())
def test_equals_flash_attention_per_sequence(device):
    # the same computation as kf.flash_attention on each sequence's (1, H, L, D) view: bitwise on
    # the CPU (one reference), to the dtype's rounding on a GPU (other tiles, other order)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lens_q, lens_k = [37, 1, 64, 0, 100], [50, 9, 64, 3, 71]
    q, k, v = make_inputs(lens_q, lens_k, 8, 2, 64, 64, dtype, device)
    cu_q, cu_k = offsets(lens_q, device), offsets(lens_k, device)
    out, lse = kf.flash_attention_varlen(q, k, v, cu_q, cu_k, 100, 71, causal=True, window=(20, None),
                                         return_lse=True)
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lens_q)):
        rows, keys = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        o, s = kf.flash_attention(*(t[sl].transpose(0, 1).unsqueeze(0) for t, sl in ((q, rows), (k, keys), (v, keys))),
                                  causal=True, window=(20, None), return_lse=True)
        if device == "cpu":
            assert torch.equal(out[rows], o[0].transpose(0, 1)) and torch.equal(lse[rows], s[0].transpose(0, 1))
        else:
            torch.testing.assert_close(out[rows], o[0].transpose(0, 1), atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(lse[rows], s[0].transpose(0, 1), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_opcheck(backend, device):
    lens_q, lens_k = [5, 0, 12], [7, 3, 9]
    cu_q, cu_k = offsets(lens_q, device), offsets(lens_k, device)
    q = torch.randn(17, 4, 16, device=device, requires_grad=True)
    k, v = (torch.randn(19, 2, 16, device=device, requires_grad=True) for _ in range(2))
    with kf.use_backend(backend):
        torch.library.opcheck(torch.ops.kernelforge.flash_attention_varlen.default,
                              (q, k, v, cu_q, cu_k, 12, 9, 0.3, 4, 0))
        out, lse = torch.ops.kernelforge.flash_attention_varlen(q.detach(), k.detach(), v.detach(), cu_q, cu_k,
                                                                12, 9, 0.3, -1, 0)
        torch.library.opcheck(torch.ops.kernelforge.flash_attention_varlen_backward.default,
                              (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, cu_q, cu_k,
                               12, 9, 0.3, -1, 0))


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_torch_compile_fullgraph_matches_eager(backend, device):
    lens = [13, 0, 21]
    cu = offsets(lens, device)
    q, k, v = (torch.randn(34, 2, 16, device=device, requires_grad=True) for _ in range(3))

    def f(q, k, v, max_seqlen):
        return kf.flash_attention_varlen(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True,
                                         window=(6, None)).square().sum()

    torch._dynamo.reset()
    compiled_f = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    # a second max_seqlen: Dynamo recompiles with it as a symbolic int (automatic dynamic shapes)
    for max_seqlen in (21, 26):
        with kf.use_backend(backend):
            eager = f(q, k, v, max_seqlen)
            grads = torch.autograd.grad(eager, (q, k, v))
            compiled = compiled_f(q, k, v, max_seqlen)
            grads_c = torch.autograd.grad(compiled, (q, k, v))
        torch.testing.assert_close(compiled, eager)
        for a, b in zip(grads_c, grads):
            torch.testing.assert_close(a, b)


def test_reference_stays_one_op_under_compile():
    # the reference reads cu_seqlens on the host: registered opaque, it is one custom op in the
    # graph (no graph break, no .tolist() traced), forward and backward
    from tests.op_paths import aot_graphs

    cu = offsets([4, 7], "cpu")
    q, k, v = (torch.randn(11, 2, 8, requires_grad=True) for _ in range(3))
    out, grads, targets = aot_graphs(lambda q, k, v: kf.flash_attention_varlen(q, k, v, cu, cu, 7, 7), (q, k, v),
                                     torch.ones(11, 2, 8))
    assert "kernelforge.flash_attention_varlen.default" in targets
    assert "kernelforge.flash_attention_varlen_backward.default" in targets
    torch.testing.assert_close(out, kf.flash_attention_varlen(q, k, v, cu, cu, 7, 7))


def test_eager_fast_path_equals_registered_op():
    from kernelforge.ops.attention_varlen import flash_attention_varlen_op

    cu = offsets([3, 8], "cpu")
    k, v = torch.randn(11, 2, 16), torch.randn(11, 2, 16)
    x = torch.randn(4, 11, 16).transpose(0, 1)  # (heads, tokens, dim) storage
    assert_eager_path_equals_registered_op(
        lambda t: kf.flash_attention_varlen(t, k, v, cu, cu, 8, 8, causal=True, scale=0.3), flash_attention_varlen_op,
        lambda t: torch.ops.kernelforge.flash_attention_varlen(t, k, v, cu, cu, 8, 8, 0.3, -1, 0)[0], x)


def test_explain_names_the_backends():
    q = torch.randn(4, 2, 8)
    text = kf.explain("flash_attention_varlen", q, q, q)
    assert "attention_varlen: runs on reference" in text and "triton" in text


CU = torch.tensor([0, 2, 5], dtype=torch.int32)


@pytest.mark.parametrize("kwargs,match", [
    (dict(q=torch.randn(1, 5, 4, 8)), r"q must be 3-D \(total_tokens, heads, head_dim\), got shape \(1, 5, 4, 8\)"),
    (dict(k=torch.randn(5, 16), v=torch.randn(5, 16)), "k must be 3-D"),
    (dict(v=torch.randn(5, 2)), "v must be 3-D"),
    (dict(k=torch.randn(5, 3, 8), v=torch.randn(5, 3, 8)), r"heads of k and v \(3\) must divide the heads of q \(4\)"),
    (dict(k=torch.randn(5, 2, 16)), "same head_dim, got 8 and 16"),
    (dict(v=torch.randn(6, 2, 8)), "k and v must agree"),
    (dict(v=torch.randn(5, 2, 8, dtype=torch.float64)), "same dtype"),
    (dict(cu_seqlens_q=CU.float()), "cu_seqlens_q must have dtype int32 or int64, got torch.float32"),
    (dict(cu_seqlens_k=CU.to(torch.int16)), "cu_seqlens_k must have dtype int32 or int64, got torch.int16"),
    (dict(cu_seqlens_q=[0, 2, 5]), "cu_seqlens_q must be a tensor"),
    (dict(cu_seqlens_q=CU.view(1, 3)), r"cu_seqlens_q must have shape \(batch \+ 1,\), got \(1, 3\)"),
    (dict(cu_seqlens_k=CU[:0]), r"cu_seqlens_k must have shape \(batch \+ 1,\), got \(0,\)"),
    (dict(cu_seqlens_k=CU[:2]), r"same shape \(batch \+ 1,\), got \(3,\) and \(2,\)"),
    (dict(cu_seqlens_q=CU.to("meta")), "cu_seqlens_q must be on q's device cpu, got meta"),
    (dict(max_seqlen_q=-1), "max_seqlen_q must be an int >= 0, got -1"),
    (dict(max_seqlen_k=3.0), "max_seqlen_k must be an int >= 0, got 3.0"),
    (dict(window=(-2, 0)), "window left"),
    (dict(scale="x"), "scale must be a real number"),
    # the reference reads the offsets on the host, so it checks their values too
    (dict(max_seqlen_q=2), "sequence 1 has 3 rows in cu_seqlens_q but the matching max_seqlen is 2"),
    (dict(cu_seqlens_k=torch.tensor([0, 3, 2], dtype=torch.int32)),
     r"cu_seqlens_k must be non-decreasing, got cu_seqlens_k\[1\] = 3 > cu_seqlens_k\[2\] = 2"),
    (dict(cu_seqlens_q=torch.tensor([1, 2, 5], dtype=torch.int32)), r"cu_seqlens_q\[0\] must be 0, got 1"),
    (dict(cu_seqlens_k=torch.tensor([0, 2, 6], dtype=torch.int32), max_seqlen_k=4), "exceeds the 5 packed rows"),
])
def test_bad_input_is_named(kwargs, match):
    args = dict(q=torch.randn(5, 4, 8), k=torch.randn(5, 2, 8), v=torch.randn(5, 2, 8), cu_seqlens_q=CU,
                cu_seqlens_k=CU, max_seqlen_q=3, max_seqlen_k=3)
    args.update(kwargs)
    options = {name: args.pop(name) for name in ("window", "scale") if name in args}
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        kf.flash_attention_varlen(*args.values(), **options)


# ----------------------------------------------------------------------------- GPU suite
GPU_CASES = [
    ([300, 1, 517, 0, 1024], [300, 64, 517, 5, 1000], 16, 4, 128, None, True, None),
    ([777, 129], [1031, 64], 8, 8, 64, None, False, (128, 0)),
    ([1, 1, 1, 1], [4097, 1, 0, 333], 8, 1, 256, None, True, None),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", GPU_CASES, ids=["causal-gqa", "window", "decode-d256"])
def test_gpu_matches_oracle(dtype, case):
    lens_q, lens_k, H, Hkv, D, Dv, causal, window = case
    check("triton", "cuda", dtype, lens_q, lens_k, H, Hkv, D, Dv, causal, window)


@pytest.mark.gpu
@needs_cuda
def test_gpu_backward_is_deterministic_and_default_is_triton():
    lens = [300, 0, 257]
    cu = offsets(lens, "cuda")
    q = torch.randn(557, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(557, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    assert "runs on triton" in kf.explain("flash_attention_varlen", q, k, v, backward=True)
    out = kf.flash_attention_varlen(q, k, v, cu, cu, 300, 300, causal=True)
    g = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), g)
    for a, b in zip(first, second):
        assert torch.equal(a, b)

