"""kernelforge.patch(model): patched models compute what the unpatched ones did (outputs and
gradients of inputs and parameters, train and eval, masks, causal), the kernelforge ops actually
run (torch's transformer fast paths do not bypass them), the Parameters and state_dict are
unchanged and load either way, the report, what is skipped and why, idempotence, bad input."""
import collections
import copy
import dataclasses
import io
import warnings

import pytest
import torch
import torch.nn.functional as F

import kernelforge as kf
import kernelforge.nn.activations
import kernelforge.nn.attention
import kernelforge.nn.linear
import kernelforge.nn.norms
from kernelforge.patching import MultiheadAttention, Replacement, Skipped
from tests.conftest import HAS_CUDA

B, L, E, FF = 3, 7, 24, 40  # odd sequence length and feed-forward width
ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "F.gelu": F.gelu}


def assert_close(a, b, rtol=1e-5):
    """assert_close with the absolute tolerance at the scale of b: a parameter gradient sums
    batch * seq terms, so its rounding error is relative to its largest entry, not to each one."""
    scale = max(b.abs().max().item(), 1.0) if b.numel() else 1.0
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * scale)


def randomize(module):
    """Weights ~ N(0, 1/fan_in), biases and norm weights random: torch zero-initializes MHA's
    biases and sets LayerNorm's weight to ones, which would leave their use untested."""
    for name, p in module.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
        else:
            torch.nn.init.normal_(p, mean=1.0 if "norm" in name and name.endswith("weight") else 0.0, std=0.3)
    return module


def encoder(activation, batch_first, norm_first, nhead=3, num_layers=2, **kwargs):
    layer = torch.nn.TransformerEncoderLayer(E, nhead, FF, dropout=0.0, activation=activation,
                                             batch_first=batch_first, norm_first=norm_first, **kwargs)
    # enable_nested_tensor=False: with 3 heads torch would only warn that it cannot use it (the
    # nested-tensor path has its own test, with an even head count).
    return randomize(torch.nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False))


def grads(out, leaves, g):
    return torch.autograd.grad(out, leaves, g)


def check_same(out, ref, leaves, ref_leaves, rtol=1e-5):
    """Outputs, then gradients of every leaf under one random upstream gradient."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert_close(out, ref, rtol)
    g = torch.randn_like(out)
    for mine, theirs in zip(grads(out, leaves, g), grads(ref, ref_leaves, g)):
        assert_close(mine, theirs, rtol)


@pytest.fixture
def kf_calls(monkeypatch):
    """Counts calls of the kernelforge ops the patched modules run, by name (a forward hook would
    not do: hooks on a TransformerEncoderLayer's modules turn off torch's fast path themselves)."""
    calls = collections.Counter()
    for module, name in ((kernelforge.nn.attention, "flash_attention"), (kernelforge.nn.linear, "gemm"),
                         (kernelforge.nn.norms, "layer_norm"), (kernelforge.nn.norms, "rms_norm"),
                         (kernelforge.nn.activations, "gelu"), (kernelforge.nn.activations, "silu")):
        def counted(*args, _op=getattr(module, name), _name=name, **kwargs):
            calls[_name] += 1
            return _op(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    return calls


def inputs(batch_first, mask_kind, dtype=torch.float32, device="cpu"):
    """x and the encoder's keyword arguments. Padding hides the last keys of two sequences, never
    all of them (MHA gives NaN there, flash_attention zeros)."""
    x = torch.randn((B, L, E) if batch_first else (L, B, E), dtype=dtype, device=device)
    kwargs = {}
    if "padding" in mask_kind:
        pad = torch.zeros(B, L, dtype=torch.bool, device=device)
        pad[0, L - 3:], pad[2, L - 1:] = True, True
        kwargs["src_key_padding_mask"] = pad
    if "causal" in mask_kind:  # torch takes is_causal only as a hint that comes with the mask itself
        # bool (True = hidden) like the padding mask: torch deprecates mixing the two kinds.
        kwargs["mask"] = torch.ones(L, L, dtype=torch.bool, device=device).triu(1)
        kwargs["is_causal"] = True
    return x, kwargs


# ----------------------------------------------------------------------------- TransformerEncoder
@pytest.mark.parametrize("mask_kind", ["none", "padding", "causal", "causal_padding"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS), ids=list(ACTIVATIONS))
def test_transformer_encoder_matches_unpatched(activation, batch_first, norm_first, train, mask_kind, kf_calls):
    model = encoder(ACTIVATIONS[activation], batch_first, norm_first).train(train)
    ref = copy.deepcopy(model)
    replaced = kf.patch(model)
    assert replaced and not replaced.skipped
    assert sum(isinstance(m, MultiheadAttention) for m in model.modules()) == 2
    x, kwargs = inputs(batch_first, mask_kind)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = model(xa, **kwargs)
    # Per layer: one attention, two LayerNorms, linear1 (activation fused in) and linear2 on kf.gemm.
    assert kf_calls == {"flash_attention": 2, "layer_norm": 4, "gemm": 4}
    check_same(out, ref(xb, **kwargs), [xa, *model.parameters()], [xb, *ref.parameters()])


def test_encoder_without_biases_matches_unpatched():
    model = encoder(F.gelu, False, True, bias=False)
    ref = copy.deepcopy(model)
    kf.patch(model)
    assert model.layers[0].self_attn.in_proj.bias is None and model.layers[0].norm1.bias is None
    x, kwargs = inputs(False, "causal_padding")
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    check_same(model(xa, **kwargs), ref(xb, **kwargs), [xa, *model.parameters()], [xb, *ref.parameters()])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")  # torch's, unpatched run
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_eval_without_autograd_runs_kernelforge_not_torchs_fast_paths(batch_first, kf_calls):
    """In eval mode under no_grad torch runs nn.TransformerEncoderLayer as one native op and, with a
    padding mask, the encoder as nested tensors: neither must bypass (or feed) the patched modules.
    An even head count, post-norm and enable_nested_tensor=True let torch take both paths."""
    layer = torch.nn.TransformerEncoderLayer(E, 2, FF, dropout=0.0, activation="gelu", batch_first=batch_first)
    model = randomize(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=batch_first)).eval()
    ref = copy.deepcopy(model)
    replaced = kf.patch(model)
    fast_paths = [r for r in replaced if r.old == r.new]
    assert [r.name for r in fast_paths] == ["layers.0", "layers.1", ""][:3 if batch_first else 2]
    assert not model.use_nested_tensor and all(layer.activation_relu_or_gelu == 0 for layer in model.layers)
    for mask_kind in ("none", "padding"):
        x, kwargs = inputs(batch_first, mask_kind)
        kf_calls.clear()
        with torch.no_grad():
            out, expected = model(x, **kwargs), ref(x, **kwargs)
        assert kf_calls == {"flash_attention": 2, "layer_norm": 4, "gemm": 4}
        if mask_kind == "padding":  # the nested-tensor path gives zeros at padded positions; compare the others
            keep = ~kwargs["src_key_padding_mask"] if batch_first else ~kwargs["src_key_padding_mask"].t()
            out, expected = out[keep], expected[keep]
        assert_close(out, expected)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")  # seq first: torch's note that it cannot
def test_transformer_with_decoder_matches_unpatched():
    model = randomize(torch.nn.Transformer(E, 3, 1, 2, FF, dropout=0.0, activation=F.gelu))  # seq first
    ref = copy.deepcopy(model)
    replaced = kf.patch(model)
    assert {r.name for r in replaced} >= {"decoder.layers.1.multihead_attn", "decoder.layers.1.activation",
                                          "decoder.layers.1.norm3", "encoder.norm", "decoder.norm"}
    src, tgt = torch.randn(L, B, E), torch.randn(5, B, E)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
    leaves = [src.clone().requires_grad_(), tgt.clone().requires_grad_()]
    ref_leaves = [t.clone().requires_grad_() for t in (src, tgt)]
    check_same(model(*leaves, tgt_mask=causal, tgt_is_causal=True),
               ref(*ref_leaves, tgt_mask=causal, tgt_is_causal=True),
               leaves + list(model.parameters()), ref_leaves + list(ref.parameters()))


# ----------------------------------------------------------------------------- MLPs and norms
def test_mlp_activations_fused_into_the_linears(kf_calls):
    mlp = randomize(torch.nn.Sequential(torch.nn.Linear(E, FF), torch.nn.GELU(approximate="tanh"),
                                        torch.nn.Linear(FF, 33), torch.nn.SiLU(), torch.nn.Linear(33, E)))
    ref = copy.deepcopy(mlp)
    replaced = kf.patch(mlp)
    assert [(r.name, r.old, r.new) for r in replaced] == [
        ("0", "torch.nn.Linear", "kernelforge.nn.Linear"), ("1", "torch.nn.GELU", "torch.nn.Identity"),
        ("2", "torch.nn.Linear", "kernelforge.nn.Linear"), ("3", "torch.nn.SiLU", "torch.nn.Identity"),
        ("4", "torch.nn.Linear", "kernelforge.nn.Linear")]
    assert [getattr(m, "activation", "-") for m in mlp] == ["gelu_tanh", "-", "silu", "-", None]
    assert all(type(m) is torch.nn.Identity for m in (mlp[1], mlp[3]))
    assert "fused in (activation='gelu_tanh')" in replaced[0].note and replaced[1].note == "fused into 0"
    x = torch.randn(2, L, E)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = mlp(xa)
    assert kf_calls == {"gemm": 3}  # three GEMMs, no separate activation
    check_same(out, ref(xb), [xa, *mlp.parameters()], [xb, *ref.parameters()])


def test_activations_not_right_after_a_linear_are_swapped_not_fused(kf_calls):
    model = randomize(torch.nn.Sequential(torch.nn.LayerNorm(E), torch.nn.GELU(), torch.nn.Linear(E, FF),
                                          torch.nn.Dropout(0.0), torch.nn.SiLU(), torch.nn.Linear(FF, E),
                                          torch.nn.ReLU()))
    ref = copy.deepcopy(model)
    replaced = kf.patch(model)
    # Linear, Dropout, SiLU: not directly after the Linear, so not fused; the last Linear takes the ReLU.
    assert [type(m).__module__.split(".")[0] for m in model] == ["kernelforge"] * 3 + ["torch"] + ["kernelforge"] * 2 \
        + ["torch"]
    assert [model[2].activation, model[5].activation, type(model[6])] == [None, "relu", torch.nn.Identity]
    assert {r.name: r.note for r in replaced}["1"] == "kernelforge gelu (approximate='none')"
    x = torch.randn(L, E)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = model(xa)
    assert kf_calls == {"layer_norm": 1, "gelu": 1, "gemm": 2, "silu": 1}
    check_same(out, ref(xb), [xa, *model.parameters()], [xb, *ref.parameters()])


class RMSBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(E)  # eps=None: torch's default (finfo eps), which must stay None
        self.proj = torch.nn.Linear(E, FF, bias=False)
        self.act = torch.nn.SiLU()
        self.out_norm = torch.nn.RMSNorm(FF, eps=1e-6, elementwise_affine=False)

    def forward(self, x):
        return self.out_norm(self.act(self.proj(self.norm(x))))


def test_rms_norm_module(kf_calls):
    model = randomize(RMSBlock())
    ref, weight = copy.deepcopy(model), model.norm.weight
    replaced = kf.patch(model)  # act is an attribute of a plain Module, not after a Linear in a Sequential
    assert [(r.name, r.new) for r in replaced] == [
        ("norm", "kernelforge.nn.RMSNorm"), ("proj", "kernelforge.nn.Linear"), ("act", "kernelforge.nn.SiLU"),
        ("out_norm", "kernelforge.nn.RMSNorm")]
    assert model.norm.eps is None and model.out_norm.eps == 1e-6
    assert model.norm.weight is weight and model.out_norm.weight is None and model.norm.offset == 0.0
    x = torch.randn(B, L, E)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = model(xa)
    assert kf_calls == {"rms_norm": 2, "gemm": 1, "silu": 1}
    check_same(out, ref(xb), [xa, *model.parameters()], [xb, *ref.parameters()])


# ----------------------------------------------------------------------------- parameters and state_dict
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_parameters_and_state_dict_unchanged(batch_first):
    model = encoder("gelu", batch_first, False, bias=True)
    model.norm = torch.nn.LayerNorm(E, bias=False)
    params = list(model.named_parameters())
    before = model.state_dict()
    kf.patch(model)
    # The very same Parameter objects, in the same order (an optimizer built before still works).
    assert [id(p) for p in model.parameters()] == [id(p) for _, p in params]
    after = model.state_dict()
    assert list(after) == list(before)  # the same keys in the same order: self_attn.in_proj_weight, ...
    assert "layers.0.self_attn.in_proj_weight" in after and "norm.bias" not in after
    for key, value in before.items():
        assert after[key].data_ptr() == value.data_ptr() and after[key].dtype == value.dtype
    assert list(copy.deepcopy(model).state_dict()) == list(before)  # the key hook survives a copy
    buffer = io.BytesIO()
    torch.save(model, buffer)  # and pickling the whole model
    buffer.seek(0)
    assert list(torch.load(buffer, weights_only=False).state_dict()) == list(before)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_state_dict_loads_both_ways(batch_first):
    x, _ = inputs(batch_first, "none")
    patched = encoder("relu", batch_first, True)
    kf.patch(patched)
    other = encoder("relu", batch_first, True)  # other random weights, never patched
    patched.load_state_dict(other.state_dict())  # strict: a checkpoint written before patching loads
    assert_close(patched(x), other(x))
    theirs = encoder("relu", batch_first, True)
    randomize(patched)
    theirs.load_state_dict(patched.state_dict())  # and one written after patching loads into torch's
    assert_close(theirs(x), patched(x))


def test_patching_twice_replaces_nothing():
    model = torch.nn.Sequential(encoder(F.gelu, False, False), torch.nn.Linear(E, 5), torch.nn.GELU())
    first = kf.patch(model)
    # Per layer: 5 modules, the fused activation, the fast path; then the Linear and its fused GELU.
    assert len(first) == 2 * 7 + 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped, nothing warned
        second = kf.patch(model)
    assert second == [] and second.skipped == []


def test_report_of_one_layer():
    layer = torch.nn.TransformerEncoderLayer(E, 3, FF, dropout=0.0, activation="gelu")  # seq first, relu default
    replaced = kf.patch(layer)
    assert all(isinstance(r, Replacement) for r in replaced)
    assert [(r.name, r.old, r.new) for r in replaced] == [
        ("linear1", "torch.nn.Linear", "kernelforge.nn.Linear"),
        ("activation", "torch.nn.functional.gelu", "torch.nn.Identity"),
        ("self_attn", "torch.nn.MultiheadAttention", "kernelforge.patching.MultiheadAttention"),
        ("linear2", "torch.nn.Linear", "kernelforge.nn.Linear"),
        ("norm1", "torch.nn.LayerNorm", "kernelforge.nn.LayerNorm"),
        ("norm2", "torch.nn.LayerNorm", "kernelforge.nn.LayerNorm"),
        ("", "torch.nn.TransformerEncoderLayer", "torch.nn.TransformerEncoderLayer")]
    notes = [r.note for r in replaced]
    assert notes[0] == "kernelforge gemm with activation fused in (activation='gelu')"
    assert "transposed to batch first" in notes[2] and "fast path off" in notes[6]
    with pytest.raises(dataclasses.FrozenInstanceError):
        replaced[0].note = "changed"
    assert layer.self_attn.batch_first is False and "batch_first=False" in repr(layer.self_attn)


# ----------------------------------------------------------------------------- what is skipped
class WithMHA(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(E, 3, batch_first=True, **kwargs)
        self.norm = torch.nn.LayerNorm(E)

    def forward(self, x, kv):
        return self.norm(self.attn(x, kv, kv, need_weights=False)[0])


@pytest.mark.parametrize("kwargs,reason", [
    (dict(kdim=16, vdim=16), "kdim/vdim (16/16) != embed_dim (24)"), (dict(add_bias_kv=True), "add_bias_kv=True"),
    (dict(add_zero_attn=True), "add_zero_attn=True"), (dict(dropout=0.1), "dropout=0.1")],
    ids=["kdim", "add_bias_kv", "add_zero_attn", "dropout"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_mha_kernelforge_cannot_take_is_skipped_and_reported(kwargs, reason, train):
    model = randomize(WithMHA(**kwargs)).train(train)
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"left 1 module\(s\) as they were: attn \(torch.nn.MultiheadAttention\)"):
        replaced = kf.patch(model)
    assert [(s.name, s.type) for s in replaced.skipped] == [("attn", "torch.nn.MultiheadAttention")]
    assert isinstance(replaced.skipped[0], Skipped) and replaced.skipped[0].reason.startswith(reason)
    assert type(model.attn) is torch.nn.MultiheadAttention and type(model.attn.out_proj) is type(ref.attn.out_proj)
    assert [r.name for r in replaced] == ["norm"]  # the rest is still patched
    x, kv = torch.randn(B, L, E), torch.randn(B, 5, kwargs.get("kdim", E))
    if train and "dropout" in kwargs:  # the same dropout draws on both sides
        torch.manual_seed(1)
        out = model(x, kv)
        torch.manual_seed(1)
        assert_close(out, ref(x, kv))
    else:
        assert_close(model(x, kv), ref(x, kv))


def test_a_second_patch_reports_the_skipped_modules_without_warning_again():
    model = randomize(WithMHA(dropout=0.1))
    with pytest.warns(UserWarning, match="left 1 module"):
        kf.patch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once is enough
        second = kf.patch(model)
    assert second == [] and [s.name for s in second.skipped] == ["attn"]
    with pytest.warns(UserWarning, match="left 1 module"):  # another model is warned of as before
        kf.patch(randomize(WithMHA(dropout=0.1)))


def test_modules_with_hooks_and_subclasses_are_skipped():
    class MyLinear(torch.nn.Linear):
        pass

    seen = []
    model = torch.nn.Sequential(torch.nn.Linear(E, E), torch.nn.GELU(), MyLinear(E, E), torch.nn.LayerNorm(E))
    model[0].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with pytest.warns(UserWarning, match="left 2 module"):
        replaced = kf.patch(model)
    assert [(s.name, s.reason.split(" (")[0].split(":")[0]) for s in replaced.skipped] == [
        ("0", "hooks are registered on it"), ("2", "a subclass of torch.nn.Linear")]
    assert replaced.skipped[1].type.endswith("MyLinear")
    assert [type(m).__name__ for m in model] == ["Linear", "GELU", "MyLinear", "LayerNorm"]
    assert type(model[0]) is torch.nn.Linear and type(model[1]) is kf.nn.GELU  # not fused into the hooked Linear
    model(torch.randn(2, E))
    assert seen == [(2, E)]


def test_inplace_silu_skipped_unless_fused():
    model = torch.nn.Sequential(torch.nn.Linear(E, E), torch.nn.SiLU(inplace=True), torch.nn.SiLU(inplace=True))
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="inplace=True"):
        replaced = kf.patch(model)
    assert model[0].activation == "silu" and type(model[1]) is torch.nn.Identity  # fused: exact
    assert [s.name for s in replaced.skipped] == ["2"] and type(model[2]) is torch.nn.SiLU
    x = torch.randn(B, E)
    assert_close(model(x), ref(x))


def test_model_itself_is_not_replaced():
    norm = torch.nn.LayerNorm(E)
    with pytest.warns(UserWarning, match="it is the model itself"):
        replaced = kf.patch(norm)
    assert replaced == [] and replaced.skipped[0].name == "" and type(norm) is torch.nn.LayerNorm


def test_shared_modules_stay_shared():
    norm, linear = torch.nn.LayerNorm(E), torch.nn.Linear(E, E)
    # One LayerNorm in two places; one Linear both before a GELU and alone: fusing would change the second use.
    model = torch.nn.ModuleDict({"a": torch.nn.Sequential(norm, linear, torch.nn.GELU()),
                                 "b": torch.nn.Sequential(norm, linear)})
    ref = copy.deepcopy(model)
    kf.patch(model)
    assert model["a"][0] is model["b"][0] and type(model["a"][0]) is kf.nn.LayerNorm
    assert model["a"][1] is model["b"][1] and model["a"][1].activation is None
    assert type(model["a"][2]) is kf.nn.GELU
    x = torch.randn(B, E)
    for key in ("a", "b"):
        assert_close(model[key](x), ref[key](x))


def test_kernelforge_aware_modules_patch_themselves():
    class Aware(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(E)  # left for kernelforge_patch: patch() does not descend
            self.patched = False

        def kernelforge_patch(self):
            if self.patched:
                return None  # nothing (left) to do: no Replacement
            self.patched = True
            return "swapped its own attention"

    model = torch.nn.Sequential(Aware(), torch.nn.LayerNorm(E))
    replaced = kf.patch(model)
    aware = f"{__name__}.test_kernelforge_aware_modules_patch_themselves.<locals>.Aware"
    assert replaced == [Replacement("0", aware, aware, "swapped its own attention"),
                        Replacement("1", "torch.nn.LayerNorm", "kernelforge.nn.LayerNorm", "kernelforge layer_norm")]
    assert type(model[0].norm) is torch.nn.LayerNorm and model[0].patched
    assert kf.patch(model) == []


def test_not_a_module_raises_type_error():
    with pytest.raises(TypeError, match=r"kernelforge.patch: model must be a torch.nn.Module, got torch.Tensor"):
        kf.patch(torch.randn(3))
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got builtins.dict"):
        kf.patch({"layer": torch.nn.LayerNorm(E)})


# ----------------------------------------------------------------------------- the MHA adapter itself
def test_seq_first_mha_adapter_cross_attention_and_positional_arguments():
    mha = randomize(torch.nn.MultiheadAttention(E, 3))  # batch_first=False, torch's default
    ref = copy.deepcopy(mha)
    model = torch.nn.ModuleDict({"mha": mha})
    kf.patch(model)
    mine = model["mha"]
    query, memory = torch.randn(L, B, E), torch.randn(5, B, E)
    pad = torch.zeros(B, 5, dtype=torch.bool)
    pad[1, 3:] = True
    leaves, ref_leaves = [t.clone().requires_grad_() for t in (query, memory)], [t.clone().requires_grad_()
                                                                                for t in (query, memory)]
    # MHA's positional order: query, key, value, key_padding_mask, need_weights.
    out, weights = mine(leaves[0], leaves[1], leaves[1], pad, False)
    assert weights is None
    check_same(out, ref(ref_leaves[0], ref_leaves[1], ref_leaves[1], pad, False)[0],
               leaves + list(mine.parameters()), ref_leaves + list(ref.parameters()))
    assert_close(mine(query[:, 0], memory[:, 0], memory[:, 0], need_weights=False)[0],
                 ref(query[:, 0], memory[:, 0], memory[:, 0], need_weights=False)[0])  # unbatched


@pytest.mark.parametrize("batch_first", [False, True])
def test_mha_adapter_returns_the_weights_when_asked(batch_first):
    # torch's default need_weights=True: the weights (averaged over heads, or per head) and the
    # output as torch computes them, batched or not, with a padding mask or causal
    mha = randomize(torch.nn.MultiheadAttention(E, 3, batch_first=batch_first))
    ref = copy.deepcopy(mha)
    model = torch.nn.ModuleDict({"mha": mha})
    kf.patch(model)
    mine = model["mha"]
    assert isinstance(mine, MultiheadAttention)
    x = torch.randn(B, L, E) if batch_first else torch.randn(L, B, E)
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, 4:] = True
    for kwargs in (dict(), dict(key_padding_mask=pad, average_attn_weights=False),
                   dict(attn_mask=torch.ones(L, L, dtype=torch.bool).triu(1), is_causal=True)):
        out, weights = mine(x, x, x, **kwargs)
        want, want_weights = ref(x, x, x, **kwargs)
        assert weights is not None and weights.shape == want_weights.shape, kwargs
        assert_close(out, want)
        assert_close(weights, want_weights)
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)  # is_causal alone: the mask built for torch's path
    for got, want in zip(mine(x, x, x, is_causal=True), ref(x, x, x, attn_mask=causal, is_causal=True)):
        assert_close(got, want)
    unbatched = x[:, 0] if not batch_first else x[0]
    for got, want in zip(mine(unbatched, unbatched, unbatched), ref(unbatched, unbatched, unbatched)):
        assert_close(got, want)


# ----------------------------------------------------------------------------- against float64 (and the GPU)
def error(out, oracle):
    return (out.double() - oracle).abs().max().item()


def check_against_float64(device, dtype, batch_first, norm_first, mask_kind, kf_calls):
    """The patched encoder and torch's at `dtype`, both measured against the unpatched encoder in
    float64: the patched one may err at most twice as much plus a floor (tests/numerics.py's
    rule), for the output and every gradient."""
    base = encoder("gelu", batch_first, norm_first, nhead=4)
    oracle_model = copy.deepcopy(base).to(device, torch.float64)
    model, ref = copy.deepcopy(base).to(device, dtype), copy.deepcopy(base).to(device, dtype)
    kf.patch(model)
    x, kwargs = inputs(batch_first, mask_kind, torch.float64, device)  # masks are bool: any dtype takes them
    xo, xa, xb = x.clone().requires_grad_(), x.to(dtype).requires_grad_(), x.to(dtype).requires_grad_()
    out, expected, oracle = model(xa, **kwargs), ref(xb, **kwargs), oracle_model(xo, **kwargs)
    assert kf_calls["flash_attention"] == 2 and kf_calls["gemm"] == 4 and kf_calls["layer_norm"] == 4
    floor = {torch.bfloat16: 2 ** -8, torch.float32: 2 ** -21}[dtype]
    g = torch.randn_like(oracle)
    pairs = [(out, expected, oracle)] + list(zip(
        grads(out, [xa, *model.parameters()], g.to(dtype)), grads(expected, [xb, *ref.parameters()], g.to(dtype)),
        grads(oracle, [xo, *oracle_model.parameters()], g)))
    for mine, theirs, exact in pairs:
        scale = max(exact.abs().max().item(), 1.0)
        assert error(mine, exact) <= 2 * error(theirs, exact) + 4 * floor * scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mask_kind", ["padding", "causal"])
def test_against_float64_cpu(dtype, mask_kind, kf_calls):
    check_against_float64("cpu", dtype, True, False, mask_kind, kf_calls)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
class TestPatchedEncoderOnGPU:
    """The TransformerEncoder comparison on CUDA (Triton / CUDA backends), bf16 and fp32."""

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
    @pytest.mark.parametrize("batch_first,norm_first", [(True, False), (False, True)], ids=["bf_post", "sf_pre"])
    @pytest.mark.parametrize("mask_kind", ["padding", "causal"])
    def test_matches_torch(self, dtype, batch_first, norm_first, mask_kind, kf_calls):
        check_against_float64("cuda", dtype, batch_first, norm_first, mask_kind, kf_calls)

    @pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
    def test_fp32_matches_unpatched(self, train, kf_calls):
        model = encoder(F.gelu, False, True).cuda().train(train)
        ref = copy.deepcopy(model)
        kf.patch(model)
        x, kwargs = inputs(False, "causal_padding", device="cuda")
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = model(xa, **kwargs)
        assert kf_calls == {"flash_attention": 2, "layer_norm": 4, "gemm": 4}
        check_same(out, ref(xb, **kwargs), [xa, *model.parameters()], [xb, *ref.parameters()], rtol=1e-4)


def test_patched_attention_takes_is_causal_as_torch_does():
    """torch's MHA reads is_causal as a hint that attn_mask is causal (the mask decides), and
    needs a mask with it; with fewer keys than queries a bottom-right causal mask would differ."""
    mha = torch.nn.MultiheadAttention(24, 3, batch_first=True)
    original = copy.deepcopy(mha)
    model = torch.nn.ModuleDict({"attn": mha})
    kf.patch(model)
    q, memory = torch.randn(2, 9, 24), torch.randn(2, 5, 24)
    mask = torch.ones(9, 5, dtype=torch.bool).triu(1)  # top-left aligned, as torch's own causal masks
    expected, _ = original(q, memory, memory, attn_mask=mask, is_causal=True, need_weights=False)
    got, _ = model["attn"](q, memory, memory, attn_mask=mask, is_causal=True, need_weights=False)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"is_causal without attn_mask needs as many queries as keys, got 9 and 5"):
        model["attn"](q, memory, memory, is_causal=True)
