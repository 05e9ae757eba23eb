"""kernelforge.rope against transformers' apply_rotary_pos_emb (written out here, float64 as the
oracle): every backend, dtype and layout (both head orders, strided views, GQA, partial rotary,
per-batch / shared / tabled angles), gradients of q, k, cos and sin, the registered op (opcheck),
torch.compile with no graph break, empty inputs, out-of-range positions, bad input."""
import math

import pytest
import torch

import kernelforge as kf
from tests.conftest import backend_cases
from tests.numerics import assert_matches_oracle


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def transformers_rope(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb, with the partial-rotary split its models use."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]
    outs = []
    for x in (q, k):
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        outs.append(torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1))
    return tuple(outs)


def dtypes_for(backend, device):
    if backend == "reference":
        return [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


def angles(batch, seq, rot, device, dtype=torch.float32, base=10000.0, offset=0):
    """transformers' default rotary angles at positions offset.., both halves repeated."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot, 2, device=device, dtype=torch.float64) / rot)
    positions = torch.arange(offset, offset + seq, device=device, dtype=torch.float64)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).expand(batch, seq, rot), emb.sin().to(dtype).expand(batch, seq, rot)


def qk(batch, heads, kv_heads, seq, dim, device, dtype, heads_first=True):
    """q, k as transformers makes them: (B, S, H, D) projections viewed as (B, H, S, D)."""
    q = torch.randn(batch, seq, heads, dim, device=device, dtype=dtype)
    k = torch.randn(batch, seq, kv_heads, dim, device=device, dtype=dtype)
    return (q.transpose(1, 2), k.transpose(1, 2)) if heads_first else (q, k)


def check(backend, q, k, cos, sin, unsqueeze_dim=1, position_ids=None, what=""):
    """Outputs and the q / k gradients against the float64 oracle, with transformers' own math at
    the inputs' dtype as the yardstick."""
    if position_ids is None:
        cos_t, sin_t = cos, sin
    else:
        cos_t, sin_t = cos[position_ids.long()], sin[position_ids.long()]
    if cos_t.dim() == 2:  # (S, rot): transformers' form is (1, S, rot)
        cos_t, sin_t = cos_t.unsqueeze(0), sin_t.unsqueeze(0)
    mine = [t.detach().clone().requires_grad_() for t in (q, k)]
    with kf.use_backend(backend):
        outs = kf.rope(*mine, cos, sin, position_ids=position_ids, unsqueeze_dim=unsqueeze_dim)
    same = [t.detach().clone().requires_grad_() for t in (q, k)]
    yard = transformers_rope(*same, cos_t.to(q.dtype), sin_t.to(q.dtype), unsqueeze_dim)
    exact = [t.detach().double().requires_grad_() for t in (q, k)]
    oracle = transformers_rope(*exact, cos_t.double(), sin_t.double(), unsqueeze_dim)
    label = f"{backend} {q.dtype} {what} q{tuple(q.shape)} k{tuple(k.shape)} rot={cos.shape[-1]}"
    for name, out, x, y, z in zip("qk", outs, (q, k), yard, oracle):
        assert out.shape == x.shape and out.dtype == x.dtype, f"{label} {name}"
        # the input's memory order where it is dense, else dense in (batch, seq, heads, dim) order
        # (empty_like keeps a tensor's strides exactly when it is dense)
        dense = torch.empty_like(x).stride() == x.stride()
        wanted = x.stride() if dense else torch.empty_like(out).stride()
        assert out.stride() == wanted, f"{label} {name} layout"
        assert_matches_oracle(out, y.detach(), z.detach(), f"{label} {name}", reduced=2)
    grads = [torch.randn_like(o) for o in outs]
    with kf.use_backend(backend):
        got = torch.autograd.grad(outs, mine, grads)
    want = torch.autograd.grad(oracle, exact, [g.double() for g in grads])
    base = torch.autograd.grad(yard, same, grads)
    for name, g, w, b in zip("qk", got, want, base):
        assert_matches_oracle(g, b, w, f"{label} grad {name}", reduced=2)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
@pytest.mark.parametrize("rot", [18, 10], ids=["full", "partial"])
def test_matches_transformers(backend, device, rot):
    # GQA (4 q heads, 2 kv heads), an odd sequence, head dim 18; the angles per batch, shared by
    # the batch (1, S, rot), and as (S, rot)
    for dtype in dtypes_for(backend, device):
        q, k = qk(2, 4, 2, 7, 18, device, dtype)
        cos, sin = angles(2, 7, rot, device, dtype, offset=3)
        check(backend, q, k, cos, sin, what="per batch")
        check(backend, q, k, cos[:1], sin[:1], what="shared (1, S, rot)")
        check(backend, q, k, cos[0], sin[0], what="(S, rot)")


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_layouts(backend, device):
    # (B, S, H, D) with unsqueeze_dim=2, contiguous (B, H, S, D), a strided slice of a wider
    # projection, and angles whose halves differ (the rotation uses each half as given)
    q, k = qk(2, 3, 3, 5, 16, device, torch.float32, heads_first=False)
    cos, sin = angles(2, 5, 16, device)
    check(backend, q, k, cos, sin, unsqueeze_dim=2, what="(B, S, H, D)")
    q, k = qk(2, 3, 1, 5, 16, device, torch.float32)
    check(backend, q.contiguous(), k.contiguous(), cos, sin, what="contiguous")
    wide = torch.randn(2, 5, 3, 40, device=device)
    check(backend, wide[..., 3:19].transpose(1, 2), k, cos, sin, what="strided q")
    cos_raw, sin_raw = torch.randn(2, 5, 16, device=device), torch.randn(2, 5, 16, device=device)
    check(backend, q, k, cos_raw, sin_raw, what="halves differ")


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_position_ids_index_tables(backend, device):
    # cos / sin as (positions, rot) tables indexed per token: (S,) shared, (B, S) per batch (the
    # second sequence left-padded), int32 and int64
    table_cos, table_sin = (t[0] for t in angles(1, 64, 12, device))
    q, k = qk(2, 4, 2, 6, 16, device, torch.float32)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]], device=device)
    check(backend, q, k, table_cos, table_sin, position_ids=positions, what="(B, S) int64")
    check(backend, q, k, table_cos, table_sin, position_ids=positions[0].int() + 50, what="(S,) int32")


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_out_of_range_positions_give_nan(backend, device):
    # no host read checks positions: a token past the table (or negative) comes out NaN, the
    # others exact
    table_cos, table_sin = (t[0] for t in angles(1, 8, 8, device))
    q, k = qk(1, 2, 2, 4, 8, device, torch.float32)
    positions = torch.tensor([0, 8, -1, 3], device=device)
    with kf.use_backend(backend):
        qo, ko = kf.rope(q, k, table_cos, table_sin, position_ids=positions)
    bad = torch.tensor([False, True, True, False], device=device)
    for out in (qo, ko):
        assert out[:, :, bad].isnan().all() and not out[:, :, ~bad].isnan().any()


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_an_unused_rotation_gives_its_input_no_gradient(backend, device):
    # Only q's rotation reaches the loss: k gets no gradient, as in torch (not a zero gradient
    # rotated back by the angles, NaN where a cos / sin is infinite or NaN); q's and the angles'
    # gradients are torch's, NaN / inf where torch's are.
    q, k = qk(1, 2, 2, 4, 8, device, torch.float32)
    cos, sin = angles(1, 4, 8, device)
    cos[0, 1, 0], sin[0, 2, 3] = math.inf, math.nan
    for used in (0, 1):
        mine = [t.clone().requires_grad_() for t in (q, k, cos, sin)]
        theirs = [t.detach().double().cpu().requires_grad_() for t in (q, k, cos, sin)]
        with kf.use_backend(backend):
            out = kf.rope(*mine)[used]
        want = transformers_rope(*theirs)[used]
        grad = torch.randn_like(want)
        out.backward(grad.to(device, out.dtype))
        want.backward(grad)
        assert mine[1 - used].grad is None and theirs[1 - used].grad is None
        for name, a, b in zip(("q", "k", "cos", "sin"), mine, theirs):
            if b.grad is None:
                continue
            what = f"{backend}: {name}'s gradient with only {'qk'[used]} used"
            assert torch.equal(a.grad.isnan().cpu(), b.grad.isnan()), what
            finite = b.grad.isfinite()
            torch.testing.assert_close(a.grad.double().cpu()[finite], b.grad[finite], rtol=1e-5, atol=1e-5, msg=what)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_empty(backend, device):
    for shape_q, shape_k in [((2, 4, 0, 16), (2, 2, 0, 16)), ((0, 4, 3, 16), (0, 2, 3, 16)),
                             ((2, 0, 3, 16), (2, 2, 3, 16))]:
        q, k = torch.randn(shape_q, device=device), torch.randn(shape_k, device=device)
        cos, sin = angles(shape_q[0], shape_q[2], 16, device)
        with kf.use_backend(backend):
            qo, ko = kf.rope(q, k, cos, sin)
        assert qo.shape == q.shape and ko.shape == k.shape
        torch.testing.assert_close(ko, transformers_rope(q, k, cos, sin)[1])


def test_gradcheck_every_input_float64():
    # q, k, cos and sin, per-token angles and tabled ones (their gradient gathered into the rows
    # the positions read), and the second derivative through the transposed op
    q, k = (t.requires_grad_() for t in qk(2, 2, 1, 3, 6, "cpu", torch.float64))
    cos, sin = (torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda *a: kf.rope(*a), (q, k, cos, sin))
    assert torch.autograd.gradgradcheck(lambda *a: kf.rope(*a), (q, k, cos, sin))
    tables = [torch.randn(5, 4, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    positions = torch.tensor([[4, 0, 4], [1, 2, 3]])
    assert torch.autograd.gradcheck(lambda q, k, c, s: kf.rope(q, k, c, s, position_ids=positions),
                                    (q, k, *tables))


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_opcheck(backend, device):
    q, k = qk(2, 4, 2, 3, 8, device, torch.float32)
    cos, sin = angles(2, 3, 8, device)
    table = angles(1, 6, 8, device)[0][0].contiguous()
    samples = [(q, k, cos, sin, None, 1, False), (q, k, cos[:1], sin[:1], None, 1, True),
               (q.transpose(1, 2), k.transpose(1, 2), cos, sin, None, 2, False),
               (q, k, table, table, torch.tensor([5, 0, 2], device=device), 1, False)]
    with kf.use_backend(backend):
        for args in samples:
            torch.library.opcheck(torch.ops.kernelforge.rope.default, args)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_compiles_without_graph_breaks(backend, device):
    # the op is traced into the graph (reference torch ops, or the Triton launch Inductor makes
    # itself): fullgraph, values and gradients equal eager's
    q, k = (t.requires_grad_() for t in qk(2, 4, 2, 5, 16, device, torch.float32))
    cos, sin = angles(2, 5, 16, device)

    def f(q, k):
        qo, ko = kf.rope(q, k, cos, sin)
        return (qo * qo).sum() + (ko * 2).sum()

    torch._dynamo.reset()
    with kf.use_backend(backend):
        compiled = torch.compile(f, backend="aot_eager" if device == "cpu" else "inductor", fullgraph=True)
        got, want = compiled(q, k), f(q, k)
        torch.testing.assert_close(got, want)
        for a, b in zip(torch.autograd.grad(got, (q, k)), torch.autograd.grad(want, (q, k))):
            torch.testing.assert_close(a, b)


def test_bad_input_is_rejected():
    q, k = qk(2, 4, 2, 3, 8, "cpu", torch.float32)
    cos, sin = angles(2, 3, 8, "cpu")
    cases = [
        ((q, k, cos, sin), {"unsqueeze_dim": 0}, ValueError, "unsqueeze_dim must be 1"),
        ((q[0], k, cos, sin), {}, ValueError, "q must be 4-D"),
        ((q, k.half(), cos, sin), {}, RuntimeError, "same dtype"),
        ((q.int(), k, cos, sin), {}, TypeError, "q must have dtype"),
        ((q, k[:1], cos, sin), {}, RuntimeError, "agree in batch, sequence and head dim"),
        ((q, k, cos[..., :3], sin[..., :3]), {}, RuntimeError, "must be even and in 2..8"),
        ((q, k, torch.randn(2, 3, 10), torch.randn(2, 3, 10)), {}, RuntimeError, "must be even and in 2..8"),
        ((q, k, cos, sin[..., :4]), {}, ValueError, "cos and sin must have the same shape"),
        ((q, k, cos[:, :2], sin[:, :2]), {}, RuntimeError, r"cos must be \(3, rot\)"),
        ((q, k, cos, sin), {"position_ids": torch.zeros(3)}, TypeError, "position_ids must be int32 or int64"),
        ((q, k, cos, sin), {"position_ids": torch.zeros(3, dtype=torch.long)}, ValueError, "tables"),
        ((q, k, cos[0], sin[0]), {"position_ids": torch.zeros(4, dtype=torch.long)}, RuntimeError,
         r"position_ids must be \(3,\)"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            kf.rope(*args, **kwargs)
