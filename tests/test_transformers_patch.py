"""kf.patch on a transformers Llama (kernelforge.transformers): the patched model computes what the
unpatched one does (loss, every gradient, logits, generated tokens), keeps its parameters and
state_dict, reports what it did not patch and why, patches only this instance, and a second patch
changes nothing. Tiny random configs, float32, CPU (no downloads)."""
import warnings

import pytest
import torch
import transformers  # a test requirement (requirements-test.txt)

import kernelforge as kf
from kernelforge import transformers as kf_transformers
from kernelforge.transformers import decoders
from tests.conftest import needs_cuda


SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)
# each family's causal LM at a tiny size; Mistral with a sliding window shorter than the batch's
# sequence, Qwen3 with its q / k norms
FAMILY_MODELS = {
    "llama": lambda tie: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, tie_word_embeddings=tie)),
    "mistral": lambda tie: transformers.MistralForCausalLM(transformers.MistralConfig(
        **SHAPE, sliding_window=8, tie_word_embeddings=tie)),
    "qwen2": lambda tie: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE, tie_word_embeddings=tie)),
    "qwen3": lambda tie: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **SHAPE, head_dim=16, tie_word_embeddings=tie)),
    # Gemma's 1 + w norms and gelu-tanh MLP; Gemma 2 / 3 with their logit softcap (and Gemma 2's
    # attention softcap, left to transformers' attention); Granite with its multipliers and logit
    # scale; OLMo 2's post-norms and q / k norms (over the projection); Phi-3's packed qkv_proj and
    # gate_up_proj, half of each head rotated, a sliding window shorter than the sequence
    "gemma": lambda tie: transformers.GemmaForCausalLM(transformers.GemmaConfig(
        **SHAPE, head_dim=16, tie_word_embeddings=tie)),
    "gemma2": lambda tie: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **SHAPE, head_dim=16, sliding_window=8, final_logit_softcapping=3.0, tie_word_embeddings=tie)),
    "gemma3_text": lambda tie: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **SHAPE, head_dim=16, sliding_window=8, final_logit_softcapping=3.0, tie_word_embeddings=tie)),
    "granite": lambda tie: transformers.GraniteForCausalLM(transformers.GraniteConfig(
        **SHAPE, logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
        tie_word_embeddings=tie)),
    "olmo2": lambda tie: transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**SHAPE, tie_word_embeddings=tie)),
    "phi3": lambda tie: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **SHAPE, pad_token_id=0, bos_token_id=1, eos_token_id=2, partial_rotary_factor=0.5, sliding_window=8,
        tie_word_embeddings=tie)),
    # mixtures of experts (the router's auxiliary loss on for Mixtral; Qwen3-MoE's first layer dense)
    "mixtral": lambda tie: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SHAPE, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, tie_word_embeddings=tie)),
    "qwen3_moe": lambda tie: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SHAPE, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0],
        tie_word_embeddings=tie)),
    # GPT-2: LayerNorms, a GELU MLP between Conv1D projections (dropout off: the losses must match)
    "gpt2": lambda tie: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, tie_word_embeddings=tie)),
}
# the families whose attention forward kernelforge replaces (kf.rope inside); the MLP's note
ROPE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
                 "granite", "olmo2", "phi3")
MOE_LAYERS = {"mixtral": ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"],
              "qwen3_moe": ["model.layers.1.mlp.experts"]}
MLP_NOTES = {"phi3": "kf.swiglu(gate_up_proj(x))", "gpt2": "kf.gelu(c_fc(x), approximate='tanh')",
             "gemma": "kf.gated_mlp (gelu_tanh", "gemma2": "kf.gated_mlp (gelu_tanh",
             "gemma3_text": "kf.gated_mlp (gelu_tanh"}


def tiny_llama(seed=0, tie=True, family="llama"):
    torch.manual_seed(seed)
    return FAMILY_MODELS[family](tie)


def patched(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return kf.patch(model)


@pytest.mark.parametrize("family,tie", [("llama", True), ("llama", False), ("mistral", True), ("qwen2", False),
                                        ("qwen3", True), ("gemma", True), ("gemma2", True), ("gemma3_text", False),
                                        ("granite", True), ("olmo2", False), ("phi3", False), ("mixtral", True),
                                        ("qwen3_moe", False), ("gpt2", True)])
def test_patched_model_computes_the_same(family, tie):
    reference, model = tiny_llama(tie=tie, family=family), tiny_llama(tie=tie, family=family)
    report = patched(model)
    names = {r.name for r in report}
    layer, norms = (("transformer.h", {"transformer.h.1.ln_2", "transformer.ln_f"}) if family == "gpt2" else
                    ("model.layers", {"model.layers.1.post_attention_layernorm", "model.norm"}))
    assert norms | {"lm_head", ""} <= names
    assert (f"{layer}.0.self_attn" in names) == (family in ROPE_FAMILIES)
    if family in ("qwen3", "olmo2", "gemma3_text", "qwen3_moe"):
        assert "model.layers.0.self_attn.q_norm" in names
    if family != "mixtral":  # Mixtral has no dense MLP
        note = next(r.note for r in report if r.name == f"{layer}.0.mlp")
        assert MLP_NOTES.get(family, "kf.gated_mlp (silu") in note
    for experts in MOE_LAYERS.get(family, []):  # transformers' grouped GEMMs, kf.swiglu between them
        assert "_apply_gate -> kf.swiglu (between the grouped_mm" in next(r.note for r in report if r.name == experts)
    assert report.skipped == []
    ids = torch.randint(0, 300, (2, 16))
    labels = ids.clone()
    labels[0, :5] = -100
    want, got = reference(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
    assert got.logits is None  # never made: the fused loss took the hidden states
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    want.loss.backward()
    got.loss.backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    # without labels the logits are transformers' own; generate() picks the same tokens
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    prompt = ids[:1, :6]
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False),
                       reference.generate(prompt, max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("implementation", ["batched_mm", "eager"])
def test_experts_under_each_experts_implementation(implementation, monkeypatch):
    # batched_mm calls the experts' _apply_gate too; eager computes act(gate) * up itself: the
    # experts are then left alone, and the report says how to take them
    calls = []
    swiglu = decoders.swiglu
    monkeypatch.setattr(decoders, "swiglu", lambda *args: calls.append(args[0].shape) or swiglu(*args))
    reference, model = tiny_llama(family="mixtral"), tiny_llama(family="mixtral")
    for m in (reference, model):
        m.set_experts_implementation(implementation)
    report = patched(model)
    experts = MOE_LAYERS["mixtral"]
    if implementation == "eager":
        assert [s.name for s in report.skipped] == experts
        assert "set_experts_implementation('grouped_mm')" in report.skipped[0].reason
        assert "_apply_gate" not in model.model.layers[0].mlp.experts.__dict__
    else:
        assert experts[0] in {r.name for r in report} and report.skipped == []
    ids = torch.randint(0, 300, (2, 12))
    want, got = reference(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    # each layer's experts: one call over the 24 tokens' 2 choices each, [gate | up] packed
    assert calls == ([] if implementation == "eager" else [torch.Size([48, 256])] * 2)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    want.loss.backward()
    got.loss.backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_experts_with_another_gate_layout_are_left_alone():
    # interleaved [gate0, up0, gate1, ...] weights (is_concatenated=False) are not kf.swiglu's layout
    model = tiny_llama(family="mixtral")
    model.model.layers[1].mlp.experts.is_concatenated = False
    report = patched(model)
    reason = "its gated activation is not transformers' default act(gate) * up of [gate | up]"
    assert [(s.name, s.reason) for s in report.skipped] == [("model.layers.1.mlp.experts", reason)]
    assert "_apply_gate" in model.model.layers[0].mlp.experts.__dict__
    assert "_apply_gate" not in model.model.layers[1].mlp.experts.__dict__


def test_a_projection_with_a_hook_keeps_the_unfused_mlp():
    # the fused MLP reads the projections' weights: a hooked (or biased) projection keeps its call
    reference, model = tiny_llama(), tiny_llama()
    calls = []
    model.model.layers[0].mlp.up_proj.register_forward_hook(lambda *args: calls.append(1))
    report = patched(model)
    notes = {r.name: r.note for r in report}
    assert "kf.swiglu" in notes["model.layers.0.mlp"] and "kf.gated_mlp" in notes["model.layers.1.mlp"]
    ids = torch.randint(0, 300, (2, 8))
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss)
    assert calls == [1]


class LowRank(torch.nn.Module):
    """A LoRA-like wrapper: the wrapped Linear plus a low-rank delta (what PEFT puts in place)."""

    def __init__(self, linear):
        super().__init__()
        self.base = linear
        self.a = torch.nn.Parameter(torch.randn(4, linear.in_features) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(linear.out_features, 4) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def test_modules_wrapped_or_hooked_after_the_patch_are_honored():
    # a projection wrapped (as PEFT's LoRA does) after kf.patch: the fused MLP, which reads the
    # weights, gives way to transformers' forward; a hook on the head: the unfused head and loss
    reference, model = tiny_llama(), tiny_llama()
    patched(model)
    torch.manual_seed(1)
    reference.model.layers[0].mlp.up_proj = LowRank(reference.model.layers[0].mlp.up_proj)
    torch.manual_seed(1)
    model.model.layers[0].mlp.up_proj = LowRank(model.model.layers[0].mlp.up_proj)
    ids = torch.randint(0, 300, (2, 10))
    out = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss, reference(input_ids=ids, labels=ids).loss)
    assert out.logits is None  # the fused loss still
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    out = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss, reference(input_ids=ids, labels=ids).loss)
    assert seen == [(2, 10, 300)] and out.logits is not None


def test_gradient_checkpointing():
    # transformers' gradient checkpointing runs the patched layers' forwards again in the backward
    reference, model = tiny_llama(), tiny_llama()
    patched(model)
    for m in (reference, model):  # the name transformers 5.24 prefers, else 5.17's
        getattr(m, "activation_checkpointing_enable", m.gradient_checkpointing_enable)()
        m.train()
    assert model.model.layers[0].gradient_checkpointing
    ids = torch.randint(0, 300, (2, 10))
    got, want = model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(got, want)
    got.backward()
    want.backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_gradient_accumulation_and_tuple_outputs():
    # num_items_in_batch (transformers' Trainer under gradient accumulation): a sum over that
    # count; return_dict=False runs transformers' own forward, logits included
    reference, model = tiny_llama(), tiny_llama()
    patched(model)
    ids = torch.randint(0, 300, (2, 12))
    count = torch.tensor(40)
    want = reference(input_ids=ids, labels=ids, num_items_in_batch=count).loss
    torch.testing.assert_close(model(input_ids=ids, labels=ids, num_items_in_batch=count).loss, want)
    loss, logits = model(input_ids=ids, labels=ids, return_dict=False)[:2]
    torch.testing.assert_close(loss, reference(input_ids=ids, labels=ids).loss)
    assert logits.shape == (2, 12, 300)
    # in eval mode the logits come with the loss (evaluation metrics read them)
    model.eval()
    reference.eval()
    out = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss, reference(input_ids=ids, labels=ids).loss)
    torch.testing.assert_close(out.logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def test_parameters_state_dict_and_a_second_patch():
    model = tiny_llama()
    before = model.state_dict()
    params = list(model.parameters())
    patched(model)
    after = model.state_dict()
    assert list(after) == list(before) and all(after[k] is before[k] or torch.equal(after[k], before[k])
                                               for k in before)
    assert all(a is b for a, b in zip(model.parameters(), params))
    second = patched(model)
    assert second == [] and second.skipped == []


def test_only_this_instance_is_patched():
    model, other = tiny_llama(), tiny_llama()
    patched(model)
    later = tiny_llama()
    for untouched in (other, later):
        assert all("forward" not in m.__dict__ for m in untouched.modules())
    assert "forward" in model.model.norm.__dict__
    assert type(model.model.norm).forward is type(other.model.norm).forward


def test_the_report_says_what_was_not_patched(monkeypatch):
    # a transformers version the forwards were not tested with: the attention and the loss are left
    # alone, and the report (and its warning) says so; the norms and the MLP are patched
    monkeypatch.setattr(kf_transformers, "transformers_version_tested", lambda: (False, "9.9.9"))
    model = tiny_llama()
    with pytest.warns(UserWarning, match="installed 9.9.9 was not"):
        report = kf.patch(model)
    names = {r.name for r in report}
    assert "" not in names and "model.layers.0.self_attn" not in names and "model.norm" in names
    assert [s.name for s in report.skipped] == ["model.layers.0", "model.layers.0.self_attn", "model.layers.1",
                                                "model.layers.1.self_attn", "", ""]
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 300, (1, 8))
    assert model(input_ids=ids, labels=ids).logits is not None


def test_apply_patches_the_models_built_in_its_block(tmp_path):
    # around from_pretrained: the loaded model is patched at the block's exit (its inner LlamaModel
    # with it, once), computes the unpatched model's loss; a Qwen2 built in a "llama" block, and
    # models built after the block, are untouched
    tiny_llama().save_pretrained(tmp_path)
    post_init = transformers.PreTrainedModel.post_init
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with kf_transformers.apply("llama") as done:
            model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
            other = tiny_llama(family="qwen2")
            assert "forward" not in model.model.norm.__dict__  # not before the exit
    assert transformers.PreTrainedModel.post_init is post_init
    assert [m for m, _ in done] == [model] and "forward" in model.model.norm.__dict__
    assert any(r.name == "" and "fused_linear_cross_entropy" in r.note for r in done[0][1])
    assert model.config._attn_implementation == "kernelforge"
    assert all("forward" not in m.__dict__ for m in other.modules())
    later = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all("forward" not in m.__dict__ for m in later.modules())
    ids = torch.randint(0, 300, (2, 12))
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, later(input_ids=ids, labels=ids).loss)
    with pytest.raises(ValueError, match="unknown families"):
        with kf_transformers.apply("t5"):
            pass


def test_family():
    from kernelforge.transformers import decoders, encoders

    assert kf_transformers.FAMILIES == tuple(decoders.FAMILIES) + tuple(encoders.ENCODERS)
    for family in FAMILY_MODELS:
        assert kf_transformers.family(tiny_llama(family=family)) == family
    assert kf_transformers.family(transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=1, d_model=32, d_kv=8, num_heads=2, d_ff=64, vocab_size=100))) is None
    assert kf_transformers.family(torch.nn.Linear(2, 2)) is None
    with pytest.raises(ValueError, match="not a transformers model of a supported family"):
        kf_transformers.patch(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_compiles_without_graph_breaks(family):
    # the patch adds no graph break: the whole training loss traces as one graph, and gives
    # the unpatched model's loss and gradients (mixtures of experts: their experts' batched GEMMs
    # and kf.swiglu; without the router's logits, whose capture breaks the graph in transformers
    # itself, and not on grouped_mm, whose CPU fallback's backward does not trace in transformers 5.17)
    reference, model = tiny_llama(family=family), tiny_llama(family=family)
    for m in (reference, model):
        m.config.output_router_logits = False
        if family in MOE_LAYERS:
            m.set_experts_implementation("batched_mm")
    patched(model)
    ids = torch.randint(0, 300, (2, 16))
    torch._dynamo.reset()
    compiled = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss, backend="aot_eager", fullgraph=True)
    got, want = compiled(ids), reference(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(got, want)
    got.backward()
    want.backward()
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6)


ENCODER_MODELS = {
    "bert": lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=300,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "vit": lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, image_size=32,
        patch_size=8, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
}


@pytest.mark.parametrize("family", list(ENCODER_MODELS))
def test_encoders_compute_the_same(family):
    # BERT and ViT: LayerNorms, the MLP's GELU, BERT's residual + LayerNorm blocks; the loss, the
    # outputs and every gradient as the unpatched model's; a second patch changes nothing
    torch.manual_seed(0)
    reference = ENCODER_MODELS[family]()
    torch.manual_seed(0)
    model = ENCODER_MODELS[family]()
    report = patched(model)
    def note(suffix):  # the layers' path differs between transformers versions (encoder.layer, layers)
        return next(r.note for r in report if r.name.endswith(suffix))

    if family == "bert":
        assert "kf.gelu" in note("0.intermediate") and "kf.add_layer_norm" in note("1.output")
        assert "kf.add_layer_norm" in note("0.attention.output")
        inputs = dict(input_ids=torch.randint(0, 300, (2, 12)), labels=torch.randint(0, 300, (2, 12)))
    else:
        assert "kf.gelu" in note("0.mlp") and "kf.layer_norm" in note("1.layernorm_after")
        inputs = dict(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.randint(0, 5, (2,)))
    assert report.skipped == []
    got, want = model(**inputs), reference(**inputs)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    got.loss.backward()
    want.loss.backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert patched(model) == []


def test_kernelforge_attention_keeps_the_causal_mask_implicit(monkeypatch):
    # kf.patch moves an "sdpa" model to "kernelforge": under torch.compile its plain causal mask
    # is None (SDPA's is_causal), a padding mask or a sliding window is transformers' own, and
    # the losses are the unpatched model's
    from transformers import masking_utils

    from kernelforge.transformers import attention

    made = []

    def spy(*args, **kwargs):
        mask = attention.causal_mask(*args, **kwargs)
        made.append(mask is None)
        return mask

    # compiled: Llama without and with a padding mask; eager: Mistral, whose window (8) is shorter
    # than the sequence (16), so its mask is transformers' own either way
    for family, plain, compile_it in (("llama", True, True), ("mistral", False, False)):
        reference, model = tiny_llama(family=family), tiny_llama(family=family)
        assert reference.config._attn_implementation == "sdpa"
        report = patched(model)  # registers the name (again)
        monkeypatch.setitem(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, attention.NAME, spy)
        assert model.config._attn_implementation == "kernelforge" and any("kernelforge" in r.note for r in report)
        ids = torch.randint(0, 300, (2, 16))
        padding = torch.ones(2, 16, dtype=torch.long)
        padding[1, :3] = 0
        torch._dynamo.reset()
        loss = lambda ids, mask: model(input_ids=ids, labels=ids, attention_mask=mask).loss  # noqa: E731
        run = torch.compile(loss, backend="aot_eager", fullgraph=True) if compile_it else loss
        for mask, implicit in ((None, plain), (padding, False)):
            made.clear()
            got, want = run(ids, mask), reference(input_ids=ids, labels=ids, attention_mask=mask).loss
            torch.testing.assert_close(got, want)
            assert made and all(m == implicit for m in made), (family, mask is None, made)
    # the name by itself, for from_pretrained(..., attn_implementation="kernelforge")
    kf_transformers.register()
    config = transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True)
    config._attn_implementation = "kernelforge"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 300, (1, 8))
    torch.testing.assert_close(model(input_ids=ids).logits, tiny_llama()(input_ids=ids).logits)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_patched_model_on_the_gpu(family):
    # the GPU kernels in the patched model (Triton rope, RMSNorm, SwiGLU, the fused loss's GEMMs
    # and loss kernels), float32: loss and every gradient as the unpatched model's
    reference, model = (tiny_llama(family=family).cuda() for _ in range(2))
    patched(model)
    ids = torch.randint(0, 300, (2, 16), device="cuda")
    want, got = reference(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    want.backward()
    got.backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-5, msg=name)
