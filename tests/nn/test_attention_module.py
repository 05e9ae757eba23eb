"""kernelforge.nn.Attention: against torch.nn.MultiheadAttention(batch_first=True) (outputs and
the gradients of inputs and parameters, with bool / float / padding / causal masks), GQA and
qk_norm against hand-written SDPA references, cross-attention, unbatched input, checkpoints,
nn.TransformerEncoderLayer drop-in, torch.compile, the Triton backend, and bad arguments."""
import pytest
import torch
import torch.nn.functional as F

import kernelforge as kf
from tests.conftest import backend_cases

B, L, S, E, H = 3, 11, 9, 48, 4  # odd sequence lengths; head_dim 12
TOL = {torch.float64: dict(rtol=1e-13, atol=1e-13), torch.float32: dict(rtol=2e-6, atol=2e-6)}


def assert_close(a, b, dtype):
    """assert_close with the absolute tolerance at the scale of b: a parameter gradient sums
    batch * seq terms, so its rounding error is relative to its largest entry, not to each one."""
    scale = max(b.abs().max().item(), 1.0) if b.numel() else 1.0
    torch.testing.assert_close(a, b, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * scale)


def randomize(module):
    """Weights ~ N(0, 1/fan_in) (activations of order 1), biases ~ N(0, 0.3): torch
    zero-initializes MHA's biases, which would leave their use untested."""
    for p in module.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5 if p.dim() == 2 else 0.3)
    return module


def random_mha(dtype, **kwargs):
    return randomize(torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=dtype, **kwargs))


def masks(kind, dtype, Lq=L, Sk=L):
    """(attn_mask, key_padding_mask) in MHA's convention (bool True = masked out). Key 0 is
    never masked, so no query loses all its keys (MHA gives NaN there, flash_attention 0)."""
    hidden = torch.rand(Lq, Sk) < 0.3
    hidden[:, 0] = False
    pad = torch.zeros(B, Sk, dtype=torch.bool)
    pad[0, Sk - 3:], pad[2, Sk - 1:] = True, True
    additive = torch.randn(B * H, Lq, Sk, dtype=dtype).masked_fill(torch.rand(B * H, Lq, Sk) < 0.2, float("-inf"))
    additive[..., 0] = 0.5
    return {"none": (None, None), "bool_2d": (hidden, None), "bool_3d": (hidden.repeat(B * H, 1, 1), None),
            "float_3d": (additive, None), "padding": (None, pad),
            "float_padding": (None, torch.zeros(B, Sk, dtype=dtype).masked_fill(pad, float("-inf"))),
            "bool_and_padding": (hidden, pad), "float_and_bool_padding": (additive, pad)}[kind]


def check_same(out_a, out_b, leaves_a, leaves_b, dtype):
    """Outputs, then gradients of every leaf under one random upstream gradient."""
    assert_close(out_a, out_b, dtype)
    g = torch.randn_like(out_a)
    for ga, gb in zip(torch.autograd.grad(out_a, leaves_a, g), torch.autograd.grad(out_b, leaves_b, g)):
        assert_close(ga, gb, dtype)


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask")  # torch's, float_and_bool
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["none", "bool_2d", "bool_3d", "float_3d", "padding", "float_padding",
                                  "bool_and_padding", "float_and_bool_padding", "causal", "causal_and_padding"])
def test_matches_torch_mha(dtype, kind):
    mha = random_mha(dtype)
    mine, x = kf.nn.Attention.from_torch(mha), torch.randn(B, L, E, dtype=dtype)
    causal = kind.startswith("causal")
    attn_mask, pad = masks("padding" if kind == "causal_and_padding" else "none" if causal else kind, dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    if causal:  # MHA takes is_causal only as a hint that comes with the mask itself
        causal_mask = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=dtype)
        ref = mha(xa, xa, xa, attn_mask=causal_mask, key_padding_mask=pad, need_weights=False, is_causal=True)[0]
    else:
        ref = mha(xa, xa, xa, attn_mask=attn_mask, key_padding_mask=pad, need_weights=False)[0]
    out, weights = mine(xb, attn_mask=attn_mask, key_padding_mask=pad, is_causal=causal)
    assert weights is None and out.shape == (B, L, E) and out.dtype == dtype
    check_same(out, ref, [xb, *mine.parameters()], [xa, *mha.parameters()], dtype)
    mine.causal = causal  # the module's causal flag and an explicit (x, x, x) call: the same numbers
    assert torch.equal(mine(x, x, x, attn_mask=attn_mask, key_padding_mask=pad)[0], out)


@pytest.mark.parametrize("shared_kv", [False, True], ids=["key_and_value", "key_is_value"])
def test_cross_attention_matches_torch_mha(shared_kv):
    dtype = torch.float64
    mine = kf.nn.Attention.from_torch(mha := random_mha(dtype))
    q, k = torch.randn(B, L, E, dtype=dtype), torch.randn(B, S, E, dtype=dtype)
    v = k if shared_kv else torch.randn(B, S, E, dtype=dtype)
    attn_mask, pad = masks("bool_and_padding", dtype, L, S)
    leaves_a = [t.clone().requires_grad_() for t in dict.fromkeys((q, k, v))]  # k is v: one leaf
    leaves_b = [t.clone().requires_grad_() for t in leaves_a]
    args_a = leaves_a + leaves_a[-1:] * (3 - len(leaves_a))
    args_b = leaves_b + leaves_b[-1:] * (3 - len(leaves_b))
    ref = mha(*args_a, attn_mask=attn_mask, key_padding_mask=pad, need_weights=False)[0]
    out = mine(*args_b, attn_mask=attn_mask, key_padding_mask=pad)[0]
    assert out.shape == (B, L, E)
    check_same(out, ref, leaves_b + list(mine.parameters()), leaves_a + list(mha.parameters()), dtype)


def reference_attention(mod, x, *, causal=False, attn_mask=None, qk_norm=False):
    """The module spelled out: fused projection, optional qk RMSNorm, k/v heads repeated for
    GQA, torch's SDPA (bool attn_mask True = attend), out projection."""
    Bx, Lx, _ = x.shape
    Hq, Hkv, D = mod.num_heads, mod.num_kv_heads, mod.head_dim
    q, k, v = F.linear(x, mod.in_proj.weight, mod.in_proj.bias).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(Bx, Lx, Hq, D), k.view(Bx, Lx, Hkv, D), v.view(Bx, Lx, Hkv, D)
    if qk_norm:
        q, k = F.rms_norm(q, (D,), mod.q_norm.weight), F.rms_norm(k, (D,), mod.k_norm.weight)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (k, v))  # (B, H, L, D)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal)
    return F.linear(y.transpose(1, 2).reshape(Bx, Lx, -1), mod.out_proj.weight, mod.out_proj.bias)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("window", [None, (4, 1)], ids=["no_window", "window"])
def test_grouped_query_attention_qk_norm_and_window(causal, qk_norm, window):
    dtype, T = torch.float64, 13
    mod = randomize(kf.nn.Attention(64, 8, num_kv_heads=2, causal=causal, qk_norm=qk_norm, window=window, dtype=dtype))
    assert mod.in_proj.weight.shape == ((8 + 2 * 2) * 8, 64)
    if qk_norm:
        with torch.no_grad():
            mod.q_norm.weight.add_(1.0), mod.k_norm.weight.add_(1.0)
    x = torch.randn(2, T, 64, dtype=dtype)
    pad = torch.zeros(2, T, dtype=torch.bool)
    pad[1, 9:] = True  # every query keeps a visible key, window or not
    i, j = torch.arange(T).view(-1, 1), torch.arange(T).view(1, -1)
    band = torch.ones(T, T, dtype=torch.bool) if window is None else (j >= i - window[0]) & (j <= i + window[1])
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = reference_attention(mod, xa, causal=causal, attn_mask=~pad.view(2, 1, 1, T) & band, qk_norm=qk_norm)
    out = mod(xb, key_padding_mask=pad)[0]
    check_same(out, ref, [xb, *mod.parameters()], [xa, *mod.parameters()], dtype)


def test_unbatched_input_matches_torch_mha():
    mha = random_mha(torch.float64)
    mine = kf.nn.Attention.from_torch(mha)
    x = torch.randn(L, E, dtype=torch.float64)
    pad = torch.zeros(L, dtype=torch.bool)
    pad[-2:] = True
    out = mine(x, key_padding_mask=pad)[0]
    assert out.shape == (L, E)
    assert_close(out, mha(x, x, x, key_padding_mask=pad, need_weights=False)[0], torch.float64)


def test_loads_torch_checkpoints_and_drops_into_transformer_layer():
    layer = torch.nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=0.0, batch_first=True,
                                             dtype=torch.float64)
    randomize(layer)
    mine = kf.nn.Attention(E, H, dtype=torch.float64)
    mine.load_state_dict(layer.self_attn.state_dict())  # in_proj_weight / in_proj_bias keys
    assert set(mine.state_dict()) == {"in_proj.weight", "in_proj.bias", "out_proj.weight", "out_proj.bias"}
    assert torch.equal(mine.in_proj_weight, layer.self_attn.in_proj_weight)
    x = torch.randn(B, L, E, dtype=torch.float64)
    _, pad = masks("padding", torch.float64)
    with torch.no_grad():  # in eval mode without autograd torch's native fast path runs: it must not take ours
        expected = {mode: layer.train(mode)(x, src_key_padding_mask=pad) for mode in (True, False)}
        layer.self_attn = mine
        for mode in (True, False):
            assert_close(layer.train(mode)(x, src_key_padding_mask=pad), expected[mode], torch.float64)


def compile_case():
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[0, 7:] = True
    return kf.nn.Attention(32, 4, num_kv_heads=2, causal=True), torch.randn(2, 10, 32, requires_grad=True), pad


@pytest.mark.slow
def test_torch_compile_matches_eager():
    mod, x, pad = compile_case()
    compiled = torch.compile(mod, fullgraph=False)
    torch.testing.assert_close(compiled(x, key_padding_mask=pad)[0], mod(x, key_padding_mask=pad)[0])
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, key_padding_mask=pad)[0], mod(x, key_padding_mask=pad)[0])


@pytest.mark.slow
def test_torch_compile_backward_matches_eager():
    mod, x, pad = compile_case()
    out = torch.compile(mod, fullgraph=False)(x, key_padding_mask=pad)[0]
    ref = mod(x, key_padding_mask=pad)[0]
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, [x, *mod.parameters()], g),
                    torch.autograd.grad(ref, [x, *mod.parameters()], g)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend,device", backend_cases(("triton",)))
def test_triton_backend_matches_reference(backend, device):
    # The module's q/k/v are strided views of the projection and its masks are broadcast views.
    mod = kf.nn.Attention(32, 4, num_kv_heads=2, device=device)
    x = torch.randn(2, 37, 32, device=device, requires_grad=True)
    attn_mask, pad = torch.rand(37, 37, device=device) < 0.3, torch.zeros(2, 37, dtype=torch.bool, device=device)
    attn_mask[:, 0], pad[1, 30:] = False, True
    with kf.use_backend(backend):
        out = mod(x, attn_mask=attn_mask, key_padding_mask=pad, is_causal=True)[0]
    ref = mod(x, attn_mask=attn_mask, key_padding_mask=pad, is_causal=True)[0]
    g = torch.randn_like(out)
    with kf.use_backend(backend):
        grads = torch.autograd.grad(out, [x, *mod.parameters()], g)
    for a, b in zip((out, *grads), (ref, *torch.autograd.grad(ref, [x, *mod.parameters()], g))):
        assert_close(a, b, torch.float32)


def test_fully_masked_query_gives_zero_attention():
    # Documented difference: MHA gives NaN for a query with no visible key; here its
    # attention is 0, so the output is out_proj's bias.
    mod = kf.nn.Attention(16, 2)
    torch.nn.init.normal_(mod.out_proj.bias)
    hidden = torch.zeros(4, 4, dtype=torch.bool)
    hidden[2] = True
    out = mod(torch.randn(1, 4, 16), attn_mask=hidden)[0]
    assert torch.equal(out[0, 2], mod.out_proj.bias.detach()) and out.isfinite().all()


def test_dropout_only_in_eval_mode():
    mod = kf.nn.Attention(16, 2, dropout=0.1)
    x = torch.randn(2, 5, 16)
    with pytest.raises(NotImplementedError, match=r"dropout=0.1 in training mode is not supported: "
                       r"kernelforge.flash_attention has no dropout"):
        mod(x)
    mod.eval()
    assert mod(x)[0].shape == (2, 5, 16)


def test_bad_arguments_are_rejected_clearly():
    Attention = kf.nn.Attention
    with pytest.raises(ValueError, match=r"embed_dim \(30\) must be divisible by num_heads \(4\)"):
        Attention(30, 4)
    with pytest.raises(ValueError, match=r"num_heads \(8\) must be divisible by num_kv_heads \(3\)"):
        Attention(64, 8, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"kdim=8 != embed_dim=16 is not supported"):
        Attention(16, 2, kdim=8)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.5"):
        Attention(16, 2, dropout=1.5)
    mod, x = Attention(16, 2), torch.randn(2, 5, 16)
    with pytest.raises(NotImplementedError, match=r"need_weights=True is not supported: flash attention never "
                       r"forms the attention weights"):
        mod(x, x, x, need_weights=True)
    with pytest.raises(ValueError, match=r"pass both key and value"):
        mod(x, x)
    with pytest.raises(ValueError, match=r"query must be \(batch, seq, embed_dim=16\).* got shape \(2, 5, 8\)"):
        mod(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(L, S\) = \(5, 5\) or \(batch \* num_heads, "
                       r"L, S\) = \(4, 5, 5\), got \(5, 4\)"):
        mod(x, attn_mask=torch.zeros(5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(batch, S\) = \(2, 5\), got \(5,\)"):
        mod(x, key_padding_mask=torch.zeros(5, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"must be bool .* or float .* got torch.int64"):
        mod(x, attn_mask=torch.zeros(5, 5, dtype=torch.long))
    for kwargs, what in ((dict(batch_first=False), "batch_first=False"), (dict(add_bias_kv=True), "add_bias_kv"),
                         (dict(add_zero_attn=True), "add_zero_attn"), (dict(kdim=8), "kdim/vdim")):
        mha = torch.nn.MultiheadAttention(16, 2, **{"batch_first": True, **kwargs})
        with pytest.raises(ValueError, match=rf"from_torch: {what}.* is not supported"):
            Attention.from_torch(mha)
