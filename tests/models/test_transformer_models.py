"""The transformer block, language model and ViT at every level: the same weights give the same
outputs as the native level run in float64 (the oracle), within twice the error the native level
makes in the tested dtype, plus a small floor."""
import copy
import os

import pytest
import torch

from kernelforge import backends
from kernelforge.models import (EXTRA_LEVELS, LEVELS, KernelOptimizedLanguageModel, KernelOptimizedVisionTransformer, LanguageModel,
                                LevelUnavailableError, OptimizedTransformerBlock, VisionTransformer)
from tests.conftest import needs_cuda

CPU_LEVELS = ["native", "torchscript", "compile", "reference"] + (
    ["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
GPU = [pytest.mark.gpu, needs_cuda]


def level_cases(cpu_levels=tuple(CPU_LEVELS)):
    cases = [pytest.param(level, "cpu", id=f"{level}-cpu") for level in cpu_levels]
    return cases + [pytest.param(level, "cuda", id=f"{level}-cuda", marks=GPU) for level in LEVELS + EXTRA_LEVELS]


# The fastest level compiles the whole model (~15 s on a CPU): a representative few tests take it there.
WITH_FASTEST = tuple(CPU_LEVELS) + ("fastest",)


def tiny_lm(**kw):
    return LanguageModel(vocab_size=61, dim=48, n_layers=2, n_heads=3, max_seq_len=40, **kw)


def tiny_vit(**kw):
    return VisionTransformer(image_size=24, patch_size=8, num_classes=7, dim=48, depth=2, heads=3, **kw)


def tiny_block(**kw):
    return OptimizedTransformerBlock(dim=48, num_heads=3, **kw)


def randomize(model):
    """Norm weights of ones and zero biases would hide a swapped weight or bias: draw them all."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if p.dim() == 1 else 0.0))
    return model


def check_against_oracle(model, inputs, level, device, dtype, floor=1e-5):
    """Runs `model` at `level` and at native in float64 and in `dtype`, returns the output."""
    oracle_model = copy.deepcopy(model).to(device, torch.float64).set_level("native")
    native = copy.deepcopy(model).to(device, dtype).set_level("native")
    tested = copy.deepcopy(model).to(device, dtype).set_level(level)
    cast = [t.to(device, torch.float64) if t.is_floating_point() else t.to(device) for t in inputs]
    expected = oracle_model(*cast)
    low = [t.to(dtype) if t.is_floating_point() else t for t in cast]
    native_err = (native(*low).double() - expected).abs().max().item()
    out = tested(*low)
    err = (out.double() - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert out.dtype == dtype and out.shape == expected.shape
    assert err <= 2 * native_err + floor * scale, f"{level}: error {err:.3g}, native's {native_err:.3g}"
    return out


@pytest.mark.parametrize("level, device", level_cases(WITH_FASTEST))
def test_language_model_levels_match_the_oracle(level, device):
    model = randomize(tiny_lm())
    ids = torch.randint(0, 61, (2, 17))
    check_against_oracle(model, [ids], level, device, torch.float32)


@pytest.mark.parametrize("level, device", level_cases())
def test_vision_transformer_levels_match_the_oracle(level, device):
    model = randomize(tiny_vit())
    check_against_oracle(model, [torch.randn(3, 3, 24, 24)], level, device, torch.float32)


@pytest.mark.parametrize("norm, mlp, causal", [("layer", "gelu", False), ("rms", "swiglu", True),
                                               ("rms", "gelu", False), ("layer", "swiglu", True)])
@pytest.mark.parametrize("level, device", level_cases(("native", "torchscript") + tuple(CPU_LEVELS[3:])))
def test_block_levels_match_the_oracle(level, device, norm, mlp, causal):
    model = randomize(tiny_block(norm=norm, mlp=mlp, causal=causal))
    check_against_oracle(model, [torch.randn(2, 13, 48)], level, device, torch.float32)


@pytest.mark.parametrize("level", ["native", "torchscript", "triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_low_precision_levels_match_the_oracle(level, dtype):
    torch.manual_seed(1)  # bf16 / f16 errors vary by draw; one draw keeps the 2x rule meaningful
    lm = randomize(LanguageModel(vocab_size=512, dim=256, n_layers=2, n_heads=4, max_seq_len=256))
    check_against_oracle(lm, [torch.randint(0, 512, (2, 200))], level, "cuda", dtype, floor=1e-2)
    vit = randomize(VisionTransformer(image_size=64, patch_size=16, num_classes=10, dim=256, depth=2, heads=4))
    check_against_oracle(vit, [torch.randn(4, 3, 64, 64)], level, "cuda", dtype, floor=1e-2)


def test_the_block_of_the_design_documents():
    block = OptimizedTransformerBlock(dim=512, num_heads=8)
    x = torch.randn(4, 128, 512)  # [batch, sequence, features]
    assert block(x).shape == (4, 128, 512)


def test_causal_block_ignores_later_tokens():
    block = randomize(tiny_block(causal=True, norm="rms"))
    x = torch.randn(1, 9, 48)
    changed = x.clone()
    changed[:, 6:] += 1.0
    y, y_changed = block(x), block(changed)
    torch.testing.assert_close(y[:, :6], y_changed[:, :6])
    assert (y[:, 6:] - y_changed[:, 6:]).abs().max() > 1e-3


@pytest.mark.parametrize("level, device", level_cases())
def test_gradients_match_across_levels(level, device):
    model = randomize(tiny_lm()).to(device)
    ids = torch.randint(0, 61, (2, 11), device=device)
    native = copy.deepcopy(model)
    native(ids).square().mean().backward()
    model.set_level(level)
    with model.kernel_scope():
        model(ids).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), native.parameters()):
        # fp32 sums over every token in another order: ~2e-5 of the gradient's scale measured
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4 * q.grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("level, device", level_cases(WITH_FASTEST))
def test_next_token_loss_and_its_gradients_match_across_levels(level, device):
    """LanguageModel.loss at every level: the value against the float64 native level (2x native's
    float32 error + a floor), the gradients against native's."""
    if level in ("compile", "fastest"):
        # A fresh start: after other shapes compiled in this process Dynamo marks the shapes dynamic, and
        # Inductor of torch 2.11 then fails on this graph on CUDA (an assertion in its tiling analysis;
        # docs/notes/losses.md: dynamic=True fails, static passes). Not ours to fix.
        torch._dynamo.reset()
    model = randomize(tiny_lm()).to(device)
    ids = torch.randint(0, 61, (3, 12), device=device)
    expected = copy.deepcopy(model).double().loss(ids).item()
    native = copy.deepcopy(model)
    native_loss = native.loss(ids)
    native_loss.backward()
    model.set_level(level)
    with model.kernel_scope():
        loss = model.loss(ids)
        loss.backward()
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert abs(loss.item() - expected) <= 2 * abs(native_loss.item() - expected) + 1e-6 * abs(expected)
    for (name, p), q in zip(model.named_parameters(), native.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4 * q.grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("level, device", level_cases())
def test_generation_is_the_same_at_every_level(level, device):
    model = randomize(tiny_lm()).to(device).eval()
    prompt = torch.randint(0, 61, (3, 5), device=device)
    new = 3 if (level, device) == ("triton", "cpu") else 9  # the interpreter takes seconds a step
    expected = model.generate(prompt, new, temperature=0)
    model.set_level(level)
    assert torch.equal(model.generate(prompt, new, temperature=0), expected)
    assert torch.equal(model.generate(prompt, new, temperature=0), expected)  # a second run reuses traces / graphs


def test_kv_cache_logits_equal_the_full_forward():
    model = randomize(tiny_lm()).eval()
    ids = torch.randint(0, 61, (2, 12))
    full = model(ids)
    cache = model.new_cache(2, 12, torch.float32, "cpu")
    # the cache path reduces in another order (a masked full-cache SDPA): fp32 rounding at the logits' scale
    close = dict(rtol=1e-5, atol=1e-5 * full.abs().max().item())
    with torch.no_grad():
        prefill = model.compute_cached(ids[:, :7], torch.arange(7), cache)
        torch.testing.assert_close(prefill, full[:, 6], **close)
        for t in range(7, 12):
            torch.testing.assert_close(model.compute_cached(ids[:, t:t + 1], torch.tensor([t]), cache), full[:, t],
                                       **close)


def test_sampling_follows_temperature_top_k_and_the_generator():
    model = randomize(tiny_lm()).eval()
    prompt = torch.randint(0, 61, (4, 3))
    runs = [model.generate(prompt, 12, temperature=1.3, top_k=4, generator=torch.Generator().manual_seed(7))
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0][:, :3], prompt)
    # every sampled token is among the 4 most likely at its step
    logits = model(runs[0][:, :-1])[:, 2:]
    top4 = logits.topk(4, dim=-1).indices
    assert (top4 == runs[0][:, 3:, None]).any(-1).all()
    greedy = model.generate(prompt, 1, temperature=0)
    assert torch.equal(greedy[:, -1], model(prompt)[:, -1].argmax(-1))
    assert torch.equal(model.generate(prompt, 0), prompt)


def test_language_model_errors_name_the_problem():
    model = tiny_lm()
    with pytest.raises(ValueError, match=r"ids must be \(batch, seq\) int64/int32 token ids, got shape \(5,\)"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"41 positions exceed max_seq_len 40"):
        model(torch.zeros(1, 41, dtype=torch.long))
    with pytest.raises(ValueError, match=r"40 positions exceed max_seq_len 40|positions exceed"):
        model.generate(torch.zeros(1, 30, dtype=torch.long), 11)
    with pytest.raises(ValueError, match=r"top_k must be in 1\.\.61, got 0"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 2, top_k=0)
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 2, temperature=-1)
    with pytest.raises(ValueError, match=r"vocab_size must be positive, got 0"):
        LanguageModel(vocab_size=0)
    with pytest.raises(ValueError, match=r"dim \(50\) must be a positive multiple of num_heads \(3\)"):
        LanguageModel(vocab_size=10, dim=50, n_heads=3)


def test_vision_transformer_patch_embedding_is_the_strided_convolution():
    model = randomize(tiny_vit())
    images = torch.randn(2, 3, 24, 24)
    conv = torch.nn.functional.conv2d(images, model.patch_embed.weight.view(48, 3, 8, 8), model.patch_embed.bias,
                                      stride=8)
    torch.testing.assert_close(model.patch_embed(model.patches(images)), conv.flatten(2).transpose(1, 2))
    with pytest.raises(ValueError, match=r"images must be \(batch, 3, 24, 24\), got shape \(2, 3, 32, 32\)"):
        model(torch.randn(2, 3, 32, 32))
    with pytest.raises(ValueError, match=r"image_size \(30\) must be a multiple of patch_size \(8\)"):
        VisionTransformer(image_size=30, patch_size=8)


def test_design_document_names_and_defaults():
    lm = KernelOptimizedLanguageModel(vocab_size=10000, dim=512)
    assert lm.config.n_layers == 6 and lm.tok_emb.weight is lm.head.weight  # tied embeddings
    vit = KernelOptimizedVisionTransformer(image_size=224, num_classes=1000)
    assert vit.config.patch_size == 16 and vit.config.dim == 768 and vit.config.depth == 12
    assert sum(p.numel() for p in vit.parameters()) == pytest.approx(86.6e6, rel=0.01)  # ViT-B/16


def test_levels_share_parameters_and_say_what_they_need(monkeypatch):
    model = tiny_lm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for level in CPU_LEVELS:
        model.set_level(level)
        assert model.level == level and model.state_dict().keys() == before.keys()
    with pytest.raises(ValueError, match=r"level must be one of \('native', 'torchscript', 'compile', 'triton', "
                                         r"'cuda', 'fastest', 'reference'\), got 'fast'"):
        model.set_level("fast")
    if not torch.cuda.is_available():
        with pytest.raises(LevelUnavailableError, match=r"LanguageModel\(level='cuda'\): no CUDA GPU is visible; the "
                                                        r"cuda level runs kernelforge's CUDA C\+\+ kernels"):
            tiny_lm(level="cuda")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(LevelUnavailableError, match=r"the triton level runs Triton kernels: Triton runs CPU "
                                                        r"tensors only with TRITON_INTERPRET=1"):
            tiny_vit(level="triton")


def test_copies_of_a_traced_model_work():
    model = tiny_vit(level="torchscript")
    images = torch.randn(1, 3, 24, 24)
    y = model(images)
    clone = copy.deepcopy(model)
    torch.testing.assert_close(clone(images), y)
    with torch.no_grad():
        clone.head.bias.add_(1.0)  # the copy has its own parameters and its own trace
    torch.testing.assert_close(clone(images), y + 1.0)
    torch.testing.assert_close(model(images), y)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the triton level needs a GPU or TRITON_INTERPRET=1")
def test_triton_level_runs_kernelforge_ops_in_both_directions():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_lm(level="triton").to(device)
    ids = torch.randint(0, 61, (2, 9), device=device)
    with model.kernel_scope(), backends.recording() as ran:
        model.loss(ids).backward()
    assert {op for op, _ in ran} == {"gemm", "norms", "attention", "gated_activation", "cross_entropy"}
    assert {backend for _, backend in ran} == {"triton"}


def test_patch_moves_the_models_onto_kernelforge_ops():
    import kernelforge as kf

    model = randomize(tiny_lm()).eval()
    ids = torch.randint(0, 61, (2, 9))
    expected = model(ids)
    container = torch.nn.ModuleDict({"lm": model, "norm": torch.nn.LayerNorm(61)})
    replaced = kf.patch(container)
    notes = {r.name: r.note for r in replaced}
    assert notes["lm"] == "level set to 'reference' (its parameters are on cpu)" and "norm" in notes
    assert model.level == "reference"
    with backends.recording() as ran:
        torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert {op for op, _ in ran} == {"gemm", "norms", "attention", "gated_activation"}
    assert kf.patch(container) == []  # the model patched itself once; the second call finds nothing new


def test_torchscript_and_compile_levels_really_trace_and_compile():
    model = tiny_vit()
    images = torch.randn(2, 3, 24, 24)
    model.set_level("torchscript")(images)
    assert [type(m).__name__ for m in model._wrapped.values()] == ["TopLevelTracedModule"]
    model(images)
    model(torch.randn(3, 3, 24, 24))  # another batch size: another trace
    assert len(model._wrapped) == 2
    model.set_level("compile")
    assert model._wrapped == {}  # a level switch drops the previous level's traces
    model(images)
    (compiled,) = model._wrapped.values()  # torch.compile's wrapper of the bound method
    assert compiled._torchdynamo_orig_callable == model.compute


def test_a_trace_follows_replaced_parameters():
    model = tiny_lm(level="torchscript").eval()
    ids = torch.randint(0, 61, (1, 8))
    before = model(ids)
    other = randomize(tiny_lm())
    model.load_state_dict(other.state_dict(), assign=True)  # new Parameter objects
    torch.testing.assert_close(model(ids), other(ids))
    assert (model(ids) - before).abs().max() > 1e-3


@pytest.mark.parametrize("sq, sk", [(1, 6), (3, 6), (6, 6)])
def test_native_causal_attention_aligns_to_the_bottom_right_as_kernelforge(sq, sk):
    from kernelforge.models.levels import KERNELFORGE_KERNELS, TORCH_KERNELS

    q, k, v = torch.randn(2, 3, sq, 8), torch.randn(2, 3, sk, 8), torch.randn(2, 3, sk, 8)
    with backends.use_backend("reference"):
        expected = KERNELFORGE_KERNELS.attention(q, k, v, causal=True)
    torch.testing.assert_close(TORCH_KERNELS.attention(q, k, v, causal=True), expected)
    # the last query sees every key, the first sees sk - sq + 1 of them
    torch.testing.assert_close(TORCH_KERNELS.attention(q, k, v, causal=True)[:, :, -1],
                               torch.nn.functional.scaled_dot_product_attention(q[:, :, -1:], k, v)[:, :, 0])
