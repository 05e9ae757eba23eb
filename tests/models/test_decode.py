"""Static-cache decoding (kernelforge.models.decoding): LanguageModel.generate against a greedy reference
that recomputes the full forward for every new token, the compile level compiling once per bucket, the
decoder kept and rebuilt as it should, sampling on the device; on a GPU, the step in CUDA graphs (by
hand, or reduce-overhead with no cudagraph skip) with no host sync, every level's tokens as native's."""
import contextlib
import copy

import pytest
import torch

from kernelforge.models import EXTRA_LEVELS, LEVELS, LanguageModel
from kernelforge.models.decoding import CACHE_BUCKET, HAND_GRAPHED_LEVELS, cache_rows, prompt_rows, sample
from tests.conftest import needs_cuda
from tests.models.test_transformer_models import randomize, tiny_lm


def greedy_reference(model, prompt, new_tokens):
    """Greedy decoding the slow way: the whole sequence through the model's forward for every token."""
    ids = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_bucket_lengths():
    assert cache_rows(5, 40) == 40 and cache_rows(30, 2048) == CACHE_BUCKET == 256
    assert cache_rows(256, 2048) == 256 and cache_rows(257, 2048) == 512 and cache_rows(640, 2048) == 768
    assert cache_rows(640, 700) == 700  # within max_seq_len
    assert prompt_rows(1, 256) == prompt_rows(16, 256) == 16 and prompt_rows(17, 256) == 32
    assert prompt_rows(512, 768) == 512 and prompt_rows(300, 768) == 512 and prompt_rows(30, 20) == 20


@pytest.mark.parametrize("level", ["native", "torchscript", "reference",
                                   pytest.param("fastest", marks=pytest.mark.slow)])  # ~2 min of compiling here
def test_generate_equals_the_greedy_full_forward(level):
    native = randomize(tiny_lm()).eval()
    model = copy.deepcopy(native).set_level(level)
    prompt = torch.randint(0, 61, (2, 6))
    assert torch.equal(model.generate(prompt, 10, temperature=0), greedy_reference(native, prompt, 10))
    # another prompt and length in the same bucket: the same decoder, its cache written over from the start
    decoder = model.decoding
    shorter = torch.randint(0, 61, (2, 3))
    assert torch.equal(model.generate(shorter, 7, temperature=0), greedy_reference(native, shorter, 7))
    assert model.decoding is decoder


def test_compile_level_generates_the_greedy_tokens_and_compiles_once_per_bucket():
    """The prefill and the step compile once each; more tokens, or another prompt length in the same
    bucket, compile nothing new."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # a fresh count, and no earlier test's graphs near Dynamo's recompile limit
    counters.clear()
    native = randomize(tiny_lm()).eval()
    model = copy.deepcopy(native).set_level("compile")
    prompt = torch.randint(0, 61, (2, 6))
    expected = greedy_reference(native, prompt, 12)
    assert torch.equal(model.generate(prompt, 3, temperature=0), expected[:, :9])
    compiled = counters["stats"]["unique_graphs"]
    assert compiled == 2, dict(counters["stats"])  # the prefill and the step, really compiled
    assert torch.equal(model.generate(prompt, 12, temperature=0), expected)
    assert counters["stats"]["unique_graphs"] == compiled  # no compile per token
    other = torch.randint(0, 61, (2, 11))  # pads to the same 16 rows as 6 tokens
    assert torch.equal(model.generate(other, 5, temperature=0), greedy_reference(native, other, 5))
    assert counters["stats"]["unique_graphs"] == compiled


def test_a_padded_prefill_gives_the_real_tokens_logits():
    """The levels that compile right-pad the prompt; causal masking leaves the real tokens' logits
    unchanged, whatever the padding holds."""
    model = randomize(tiny_lm()).eval()
    ids = torch.randint(0, 61, (2, 5))
    padded = torch.cat([ids, torch.randint(0, 61, (2, 11))], dim=1)
    with torch.no_grad():
        expected = model(ids)[:, -1]
        got = model.compute_cached(padded, torch.arange(16), model.new_cache(2, 40, torch.float32, "cpu"),
                                   torch.tensor([4]))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@contextlib.contextmanager
def no_host_reads():
    """Any read of a tensor's value on the host raises (the CPU stand-in for a GPU sync)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    with contextlib.ExitStack() as stack:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
            original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, refuse)
            stack.callback(setattr, torch.Tensor, name, original)
        yield


@pytest.mark.parametrize("level", ["native", "reference"])
def test_a_decode_step_reads_nothing_on_the_host(level):
    model = randomize(tiny_lm(level=level)).eval()
    decoder = model.decoder(2, 20, torch.int64, "cpu")
    logits = decoder.prefill(torch.randint(0, 61, (2, 6)))
    with no_host_reads():
        for _ in range(3):
            logits = decoder.step(sample(logits, 0.8, 5, None))
        sample(logits, 0, None, None)


def test_the_decoder_is_kept_while_it_fits_and_rebuilt_when_not():
    model = randomize(tiny_lm()).eval()
    model.generate(torch.randint(0, 61, (2, 4)), 3)
    first = model.decoding
    assert first.rows == 40 and len(first.cache) == 2 and first.cache[0][0].shape == (2, 3, 40, 16)
    model.generate(torch.randint(0, 61, (2, 9)), 20)  # the same bucket
    assert model.decoding is first
    model.generate(torch.randint(0, 61, (3, 4)), 3)  # another batch
    assert model.decoding is not first
    second = model.decoding
    model.double()  # new parameter memory: a captured graph would read the old
    model.generate(torch.randint(0, 61, (3, 4)), 3)
    assert model.decoding is not second and model.decoding.cache[0][0].dtype == torch.float64
    assert copy.deepcopy(model).decoding is None
    model.set_level("reference")
    assert model.decoding is None


def test_sampling_draws_from_the_softmax_on_the_device():
    """The exponential race picks each token with its softmax probability, within top_k."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).expand(40000, 5)
    generator = torch.Generator().manual_seed(0)
    drawn = sample(logits, 1.5, None, generator)[:, 0]
    frequencies = torch.bincount(drawn, minlength=5) / drawn.numel()
    torch.testing.assert_close(frequencies, torch.softmax(logits[0] / 1.5, -1), rtol=0, atol=0.01)
    top2 = torch.bincount(sample(logits, 1.0, 2, generator)[:, 0], minlength=5) / drawn.numel()
    assert top2[2:].sum() == 0
    torch.testing.assert_close(top2[:2], torch.softmax(logits[0, :2], -1), rtol=0, atol=0.01)
    assert torch.equal(sample(logits[:2], 0, None, None), torch.zeros(2, 1, dtype=torch.long))


def test_generate_names_an_empty_prompt():
    with pytest.raises(ValueError, match=r"ids must hold at least one token per sequence, got shape \(2, 0\)"):
        tiny_lm().generate(torch.zeros(2, 0, dtype=torch.long), 3)


# ----------------------------------------------------------------------------- GPU
def gpu_lm():
    torch.manual_seed(0)
    return randomize(LanguageModel(vocab_size=512, dim=256, n_layers=2, n_heads=4, max_seq_len=600)).cuda().eval()


def decisive_prefix(tokens, expected, margins, floor):
    """tokens equal expected up to the first step whose expected top-2 logit margin is below `floor`
    (there a low-precision model may legitimately pick the other token)."""
    for t in range(tokens.shape[1]):
        if (margins[:, t] < floor).any():
            return True
        if not torch.equal(tokens[:, t], expected[:, t]):
            return False
    return True


@pytest.mark.parametrize("level", LEVELS + EXTRA_LEVELS)
@pytest.mark.gpu
@needs_cuda
def test_every_level_generates_native_float32s_tokens(level):
    """float32: token for token; bf16: as long as the float32 model's choice is decisive. Twice: the
    second call replays the graphs captured by the first."""
    torch._dynamo.reset()
    model = gpu_lm()
    prompt = torch.randint(0, 512, (2, 37), device="cuda")
    expected = model.generate(prompt, 24, temperature=0)
    with torch.no_grad():
        top2 = model(expected[:, :-1])[:, prompt.shape[1] - 1:].float().topk(2, dim=-1).values
    margins = top2[..., 0] - top2[..., 1]
    fp32 = copy.deepcopy(model).set_level(level)
    bf16 = copy.deepcopy(model).bfloat16().set_level(level)
    for _ in range(2):
        assert torch.equal(fp32.generate(prompt, 24, temperature=0), expected)
        tokens = bf16.generate(prompt, 24, temperature=0)[:, prompt.shape[1]:]
        assert decisive_prefix(tokens, expected[:, prompt.shape[1]:], margins, 0.05 * top2.abs().max().item())


@pytest.mark.parametrize("level", HAND_GRAPHED_LEVELS)
@pytest.mark.gpu
@needs_cuda
def test_the_step_replays_a_cuda_graph_captured_by_hand(level):
    model = gpu_lm().set_level(level)
    prompt = torch.randint(0, 512, (2, 20), device="cuda")
    first = model.generate(prompt, 9, temperature=0)
    decoder = model.decoding
    assert isinstance(decoder.graph, torch.cuda.CUDAGraph) and decoder.replays == 8
    assert torch.equal(model.generate(prompt, 9, temperature=0), first)
    assert model.decoding is decoder and decoder.replays == 16  # the same graph, replayed


@pytest.mark.parametrize("level", ["compile", "fastest"])
@pytest.mark.gpu
@needs_cuda
def test_reduce_overhead_captures_the_step_with_no_cudagraph_skip(level):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    native = gpu_lm()
    model = copy.deepcopy(native).set_level(level)
    prompt = torch.randint(0, 512, (2, 25), device="cuda")
    first = model.generate(prompt, 9, temperature=0)
    assert torch.equal(first, native.generate(prompt, 9, temperature=0))
    compiled = counters["stats"]["unique_graphs"]
    assert torch.equal(model.generate(prompt, 9, temperature=0), first)  # replays
    other = prompt[:, :20]  # another length in the same buckets: 32 prompt rows, 256 cache rows
    assert torch.equal(model.generate(other, 30, temperature=0), native.generate(other, 30, temperature=0))
    assert counters["stats"]["unique_graphs"] == compiled, dict(counters["stats"])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert model.decoding.graph is None  # torch.compile's cudagraph trees hold the graphs here


@pytest.mark.parametrize("level", LEVELS + EXTRA_LEVELS)
@pytest.mark.gpu
@needs_cuda
def test_decode_steps_do_not_synchronize(level):
    """Sampling and the step, once warm, under torch.cuda's sync debug mode set to raise."""
    torch._dynamo.reset()
    model = gpu_lm().set_level(level)
    prompt = torch.randint(0, 512, (2, 20), device="cuda")
    model.generate(prompt, 6, temperature=0.9, top_k=20)  # compiles, captures
    decoder = model.decoding
    logits = decoder.prefill(prompt)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            logits = decoder.step(sample(logits, 0.9, 20, None))
    finally:
        torch.cuda.set_sync_debug_mode("default")
