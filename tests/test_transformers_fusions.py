"""kf.patch's fusions inside a transformers decoder layer: the attention's q / k / v projections as one
GEMM (and what it keeps for the backward), the residual add joined to the post-attention norm, and
the one after the MLP to the fused MLP's last GEMM.
The tiny configs and helpers are tests/test_transformers_patch.py's."""
import pytest
import torch

import kernelforge as kf
from kernelforge.ops.norms import add_rms_norm
from kernelforge.transformers import decoders
from tests.test_transformers_patch import SHAPE, patched, tiny_llama


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # without and with q / k / v biases
def test_attention_projections_run_as_one_gemm_unless_a_layer_is_wrapped(family):
    model = tiny_llama(family=family)
    kf.patch(model)
    attention = model.model.layers[0].self_attn
    x = torch.randn(2, 5, model.config.hidden_size)
    fused = decoders._projections(attention, x)
    separate = [getattr(attention, name)(x) for name in decoders.ATTENTION_PROJECTIONS]
    assert fused[0].untyped_storage().data_ptr() == fused[2].untyped_storage().data_ptr()  # one GEMM's output
    for got, want in zip(fused, separate):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    calls = []
    attention.k_proj.register_forward_hook(lambda *args: calls.append(1))  # an adapter or hook: each its own
    hooked = decoders._projections(attention, x)
    assert calls and hooked[0].untyped_storage().data_ptr() != hooked[2].untyped_storage().data_ptr()
    for got, want in zip(hooked, separate):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("family,kv_heads", [("llama", 4), ("llama", 2), ("qwen2", 4), ("qwen3", 2)])
def test_the_fused_projection_keeps_its_concatenated_weight_not_its_output(family, kv_heads, monkeypatch):
    # the backward needs x and the concatenated weight: a view of the (tokens x (q + 2 kv) heads)
    # output saved by the attention would keep all of it alive from the forward to the backward
    # (0.8 GB at Llama-3.2-1B x 8192 tokens); the weight, concatenated once a layer in the forward,
    # is kept (12 MiB a layer there) so that the backward need not concatenate it again. As many
    # kv heads as heads: SDPA takes v as it comes (else transformers repeats it: a copy); biases
    # (Qwen2) and q / k norms (Qwen3, which save q and k)
    monkeypatch.setitem(SHAPE, "num_key_value_heads", kv_heads)
    model, reference = tiny_llama(family=family), tiny_llama(family=family)
    kf.patch(model)
    attention = model.model.layers[0].self_attn
    concatenated = (sum(getattr(attention, name).out_features for name in decoders.ATTENTION_PROJECTIONS),
                    model.config.hidden_size)
    outputs, saved = [], []  # the outputs held, so that no other tensor takes their memory meanwhile

    def projections(self, x, _original=decoders._projections):
        outputs.append(_original(self, x))
        return outputs[-1]

    def pack(t):
        saved.append(t)
        return t

    monkeypatch.setattr(decoders, "_projections", projections)
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    fused = {parts[0].untyped_storage().data_ptr() for parts in outputs}
    assert len(fused) == model.config.num_hidden_layers and len({parts[2].untyped_storage().data_ptr()
                                                                 for parts in outputs}) == len(fused)
    assert not [t.shape for t in saved if t.untyped_storage().data_ptr() in fused]
    parameters = {p.data_ptr() for p in model.parameters()}  # the MLP's, of that shape too at this size
    kept = [t for t in saved if sorted(t.shape) == sorted(concatenated) and t.data_ptr() not in parameters]
    assert len(kept) == model.config.num_hidden_layers, [t.shape for t in kept]
    torch.testing.assert_close(kept[0], torch.cat([getattr(attention, name).weight
                                                   for name in decoders.ATTENTION_PROJECTIONS]), rtol=0, atol=0)
    loss.backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    for name in decoders.ATTENTION_PROJECTIONS:
        for kind in ("weight", "bias"):
            want = getattr(getattr(reference.model.layers[0].self_attn, name), kind)
            if want is not None:
                got = getattr(getattr(attention, name), kind).grad
                torch.testing.assert_close(got, want.grad, rtol=1e-4, atol=1e-6, msg=f"{name}.{kind}")


@pytest.mark.parametrize("family", ["llama", "gemma", "gemma2"])
def test_the_residual_add_joins_the_post_attention_norm_where_the_layer_is_llamas(family, monkeypatch):
    # Llama's decoder layer (Gemma's is the same code, its norm 1 + w): the add before the
    # post-attention norm is kf.add_rms_norm's; Gemma 2's sandwich-norm layer keeps its forward
    model = tiny_llama(family=family)
    report = patched(model)
    layer_patched = "model.layers.0" in {r.name for r in report}
    assert layer_patched == (family != "gemma2")
    calls = []
    monkeypatch.setattr(decoders, "add_rms_norm", lambda *a, **k: calls.append(1) or add_rms_norm(*a, **k))
    ids = torch.randint(0, 300, (1, 8))
    reference = tiny_llama(family=family)
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    assert len(calls) == (model.config.num_hidden_layers if layer_patched else 0)


def test_the_residual_add_after_the_mlp_is_the_fused_mlps_unless_the_mlp_is_hooked(monkeypatch):
    # kf.gated_mlp adds the layer's residual in its last GEMM; an MLP hooked after the patch hands
    # the hook its own output (the add outside it); the logits stay the unpatched model's
    model, reference = tiny_llama(), tiny_llama()
    kf.patch(model)
    residuals, fused = [], decoders.gated_mlp

    def recording(*args, **kwargs):
        residuals.append(kwargs.get("residual"))
        return fused(*args, **kwargs)

    monkeypatch.setattr(decoders, "gated_mlp", recording)
    ids = torch.randint(0, 300, (2, 7))
    want = reference(input_ids=ids).logits
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
    assert len(residuals) == model.config.num_hidden_layers and all(r is not None for r in residuals)
    seen = []
    model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: seen.append((args[0], out)))
    residuals.clear()
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
    assert [r is None for r in residuals] == [False, True] and len(seen) == 1
    normed, out = seen[0]
    torch.testing.assert_close(out, reference.model.layers[1].mlp(normed), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2", "phi3", "mixtral", "gpt2"])
def test_the_patched_model_under_autocast(family):
    # float32 weights, torch.autocast(bfloat16): the fused projection and the fused MLP multiply in
    # bfloat16 as transformers' Linear layers do there, forward and backward (the backward of both
    # used to meet a bfloat16 gradient and a float32 weight); loss and gradients as the unpatched
    # model's under autocast, to bfloat16's precision
    model, reference = tiny_llama(family=family), tiny_llama(family=family)
    patched(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    losses = []
    for m in (model, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(m(input_ids=ids, labels=ids).loss)
        losses[-1].backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-2, atol=1e-2)
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert b.grad.dtype == torch.float32, name
        scale = a.grad.abs().max().item() + 1e-6
        assert (b.grad - a.grad).abs().max().item() <= 5e-2 * scale, name


def test_the_patched_model_under_autocast_compiles_whole():
    # torch.compile(fullgraph=True) over the autocast region: the autocast queries at the fused
    # projection and MLP trace (no graph break), the loss and gradients as eager's
    model, reference = tiny_llama(), tiny_llama()
    patched(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))

    def loss_of(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(input_ids=ids, labels=ids).loss

    torch._dynamo.reset()
    got = torch.compile(loss_of, backend="aot_eager", fullgraph=True)(model)
    want = loss_of(reference)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert (b.grad - a.grad).abs().max().item() <= 5e-2 * (a.grad.abs().max().item() + 1e-6), name


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_patched_forwards_are_plain_functions(family):
    # torch 2.11's Dynamo cannot trace a method whose function is a functools.partial: a fullgraph
    # compile of the patched model failed there on the attention's forward (2.13's traces it)
    import functools
    import inspect

    model = tiny_llama(family=family)
    kf.patch(model)
    patched_modules = [m for m in model.modules() if "forward" in m.__dict__]
    assert len(patched_modules) > 3
    for module in patched_modules:
        function = module.forward.__func__
        assert inspect.isfunction(function) and not isinstance(function, functools.partial), type(module)
