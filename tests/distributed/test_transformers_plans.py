"""kernelforge.distributed.transformers_plans on 2 CPU processes over gloo (tests/distributed/_harness.py):
a tiny random float64 transformers Llama (and Mistral, Qwen2), patched by kf.patch (the same seed
on every rank), against the one-process patched model on the full batch: tensor parallel (the same
batch on both ranks): the logits, then one training step (the fused loss with labels, backward,
AdamW): the loss, every parameter's gradient and updated value (DTensors gathered with
full_tensor()); FSDP2 (each rank half the batch): the same; tensor parallel then FSDP2 on a 2-D
mesh. The refusals (another family, heads that do not split) run in this process."""
from __future__ import annotations

import types

import pytest
import torch

from tests.distributed._harness import assert_passed, assert_same_step, case_names, run_job, skip_without_gloo

pytestmark = skip_without_gloo

VOCAB = 96
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=32)
FAMILY_EXTRAS = {"mistral": dict(sliding_window=4)}  # a window shorter than the sequence


def _model(family: str = "llama", tie: bool = False, patch: bool = True, **overrides):
    import transformers

    import kernelforge as kf

    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[family]
    config = getattr(transformers, f"{prefix}Config")(**{**SHAPE, **FAMILY_EXTRAS.get(family, {}), **overrides},
                                                       tie_word_embeddings=tie)
    torch.manual_seed(0)  # the same weights for the reference and the parallel model, on every rank
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).double()
    if patch:
        kf.patch(model)
    return model


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return _full(model(input_ids=ids).logits)


def _step(model, ids):
    """One AdamW step on the causal-LM loss with labels (the patched fused loss in training): the
    loss, the gradients and the updated parameters by name (full tensors)."""
    model.train()
    from kernelforge.distributed.plans import optimizer_groups

    optimizer = torch.optim.AdamW(optimizer_groups(model.parameters()), lr=1e-2, weight_decay=0.1,
                                  foreach=True)  # as on CUDA, where foreach is the default
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
    optimizer.step()
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    return _full(out.loss.detach()), grads, params, out.logits


def _tp_case(family, tie=False, patch=True, head="replicate"):
    def case(mesh):
        from torch.distributed.tensor import DTensor, Shard

        from kernelforge.distributed import tensor_parallel_transformers

        ids = torch.randint(0, VOCAB, (2, 9))
        reference = _model(family, tie, patch)
        logits_ref = _logits(reference, ids)
        *expected, logits = _step(reference, ids)
        assert (logits is None) == patch  # the patched fused loss leaves no logits
        model = tensor_parallel_transformers(_model(family, tie, patch), mesh, head=head)
        layer = model.model.layers[0]
        assert layer.self_attn.k_proj.weight.placements == (Shard(0),)
        assert layer.self_attn.k_proj.weight.to_local().shape == (8, 32)  # 1 of 2 kv heads of 8
        assert layer.self_attn.o_proj.weight.placements == (Shard(1),)
        assert layer.mlp.down_proj.weight.placements == (Shard(1),)
        # the patched MLP runs kf.gated_mlp on the local weights: its projections carry no hooks
        assert bool(layer.mlp.gate_proj._forward_pre_hooks) != patch
        if head == "vocab":  # each rank its classes' rows (the vocabulary-parallel loss)
            assert model.lm_head.weight.placements == (Shard(0),)
            assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
        else:  # replicated: the fused loss reads it whole
            assert not isinstance(model.lm_head.weight, DTensor)
        assert isinstance(model.model.embed_tokens.weight, DTensor) != (tie and head == "replicate")
        torch.testing.assert_close(_logits(model, ids), logits_ref, rtol=1e-10, atol=1e-12)
        *got, logits = _step(model, ids)
        assert (logits is None) == patch
        assert_same_step(got, expected)
    return case


def _tp_generate_case(cache_implementation):
    """Greedy generation of the patched model under tensor parallelism (each rank its heads' share of
    the KV cache, dynamic or static): the same tokens as one process."""
    def case(mesh):
        from kernelforge.distributed import tensor_parallel_transformers

        ids = torch.randint(0, VOCAB, (2, 5))
        kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation=cache_implementation)
        reference = _model("llama").eval()
        with torch.no_grad():
            expected = reference.generate(ids, **kwargs)
        model = tensor_parallel_transformers(_model("llama"), mesh).eval()
        with torch.no_grad():
            got = model.generate(ids, **kwargs)
        assert torch.equal(got, expected), (got, expected)
    return case


def _fsdp_case(family, tie=False):
    def case(mesh):
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        from kernelforge.distributed import fully_shard_transformers

        ids = torch.randint(0, VOCAB, (4, 9))
        *expected, _ = _step(_model(family, tie), ids)
        model = fully_shard_transformers(_model(family, tie), mesh)
        assert isinstance(model.lm_head.weight, DTensor)  # sharded between forwards, in the root's unit
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
        rank = dist.get_rank()
        loss, grads, params, logits = _step(model, ids[2 * rank: 2 * rank + 2])  # each rank its half of the batch
        assert logits is None  # the patched fused loss ran, inside the root's forward
        loss = loss.clone()
        dist.all_reduce(loss)  # the mean over equal halves: the full batch's mean
        assert_same_step((loss / 2, grads, params), expected)
    return case


def _two_dimensional_case(dp, tp, tie=False):
    def case(mesh):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from kernelforge.distributed import fully_shard_transformers, tensor_parallel_transformers

        mesh2d = init_device_mesh(mesh.device_type, (dp, tp), mesh_dim_names=("dp", "tp"))  # gloo: cpu, NCCL: cuda
        ids = torch.randint(0, VOCAB, (4, 9))
        *expected, _ = _step(_model("llama", tie), ids)
        model = tensor_parallel_transformers(_model("llama", tie), mesh2d["tp"])
        fully_shard_transformers(model, mesh2d["dp"])
        assert model.model.layers[0].mlp.gate_proj.weight.device_mesh.ndim == 2  # sharded over dp and tp
        rows = ids.shape[0] // dp
        dp_rank = mesh2d["dp"].get_local_rank()
        loss, grads, params, logits = _step(model, ids[rows * dp_rank: rows * (dp_rank + 1)])
        assert logits is None
        loss = loss.clone()
        dist.all_reduce(loss, group=mesh2d["dp"].get_group())
        assert_same_step((loss / dp, grads, params), expected)
    return case


def _cases():
    pytest.importorskip("transformers")
    return {"tensor-parallel-llama": _tp_case("llama"), "fsdp2-llama": _fsdp_case("llama"),
            "tensor-parallel-llama-vocab-head": _tp_case("llama", head="vocab"),
            "tensor-parallel-generate-static-cache": _tp_generate_case("static")}


def _slow_cases():
    pytest.importorskip("transformers")
    return {"tensor-parallel-llama-tied": _tp_case("llama", tie=True),
            "tensor-parallel-llama-unpatched": _tp_case("llama", patch=False),
            "tensor-parallel-mistral": _tp_case("mistral"),
            "tensor-parallel-llama-tied-vocab-head": _tp_case("llama", tie=True, head="vocab"),
            "tensor-parallel-unpatched-vocab-head": _tp_case("llama", patch=False, head="vocab"),
            "tensor-parallel-qwen2": _tp_case("qwen2", tie=True),
            "fsdp2-llama-tied": _fsdp_case("llama", tie=True), "fsdp2-qwen2": _fsdp_case("qwen2"),
            "tp-then-fsdp2-dp1-tp2": _two_dimensional_case(1, 2), "tp-then-fsdp2-dp2-tp1": _two_dimensional_case(2, 1),
            "tensor-parallel-generate-dynamic-cache": _tp_generate_case(None)}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory.mktemp("transformers_plans"), _cases)


@pytest.fixture(scope="module")
def slow_results(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory.mktemp("transformers_plans_slow"), _slow_cases)


@pytest.mark.parametrize("name", case_names(_cases))
def test_plan(results, name):
    assert_passed(results, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", case_names(_slow_cases))
def test_plan_slow(slow_results, name):
    assert_passed(slow_results, name)


def test_refusals():
    pytest.importorskip("transformers")
    import transformers

    from kernelforge.distributed import fully_shard_transformers, tensor_parallel_transformers

    two_ranks = types.SimpleNamespace(size=lambda: 2)  # the checks come before the mesh is used
    gemma = transformers.GemmaForCausalLM(transformers.GemmaConfig(**SHAPE, head_dim=8))
    for plan in (tensor_parallel_transformers, fully_shard_transformers):
        with pytest.raises(ValueError, match="model_type 'gemma'"):
            plan(gemma, two_ranks)
    with pytest.raises(ValueError, match="1 key / value heads must both split evenly over 2 ranks"):
        tensor_parallel_transformers(_model(num_key_value_heads=1), two_ranks)
    with pytest.raises(ValueError, match="tied"):
        tensor_parallel_transformers(_model(tie=True), two_ranks, embeddings="rowwise")
    with pytest.raises(ValueError, match="tied"):
        tensor_parallel_transformers(_model(tie=True), two_ranks, embeddings="replicate", head="vocab")
    with pytest.raises(ValueError, match="head must be"):
        tensor_parallel_transformers(_model(), two_ranks, head="columns")
