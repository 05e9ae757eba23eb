"""kernelforge.distributed.plans on 2 CPU processes over gloo (tests/distributed/_harness.py): a tiny
float64 LanguageModel (the same seed on every rank) at the reference and native levels, one
training step (forward, loss, backward, AdamW step) tensor-parallel (with and without sequence
parallelism: the same batch on both ranks) and data-parallel (DDP, FSDP2: each rank half the
batch) against the one-process run of the same model on the full batch: the loss, every
parameter's gradient and updated value (DTensors gathered with full_tensor()); greedy generation
tensor-parallel against the unsharded model's tokens and KV cache. A second, 4-process job on a
(dp, tp) = (2, 2) mesh: FSDP2 x TP (with and without sequence parallelism) against one process on
the full batch, and data_parallel's refusals on a tensor-parallel model. FSDP2 at the compile and
fastest levels too: its layers compiled one by one, no graph break."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed._harness import assert_passed, assert_same_step, case_names, run_job, skip_without_gloo

pytestmark = skip_without_gloo

LEVELS = ("reference", "native")


def _model(level):
    from kernelforge.models import LanguageModel

    return LanguageModel(vocab_size=32, dim=16, n_layers=2, n_heads=4, max_seq_len=16, level=level).double()


def _step(model, loss_fn, ids):
    """One AdamW step of `model`'s parameters on loss_fn(ids): the loss, the gradients and the updated parameters by name (full tensors)."""
    from kernelforge.distributed.plans import optimizer_groups
    from kernelforge.distributed.strided import full_tensor as full  # torch 2.11 cannot gather _StridedShard

    optimizer = torch.optim.AdamW(optimizer_groups(model.parameters()), lr=1e-2, weight_decay=0.1,
                                  foreach=True)  # as on CUDA, where foreach is the default
    with model.kernel_scope():
        loss = loss_fn(ids)
        loss.backward()
    grads = {n: full(p.grad).clone() for n, p in model.named_parameters()}
    optimizer.step()
    params = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    return full(loss.detach()), grads, params


def _tp_case(level, sequence_parallel):
    def case(mesh):
        from kernelforge.distributed.plans import tensor_parallel
        from kernelforge.distributed.strided import distribute_like, full_tensor
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        model = _model(level)
        ids = torch.randint(0, 32, (4, 9))  # 8 positions after the shift: Shard(1) splits them evenly
        reference = copy.deepcopy(model)
        expected = _step(reference, reference.loss, ids)
        qkv_before = model.layers[0].attn.qkv.weight.detach().clone()
        tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
        assert model.head.weight is model.tok_emb.weight  # still tied
        assert model.layers[0].attn.num_heads == 2
        qkv = model.layers[0].attn.qkv.weight  # each rank its 2 heads' rows of q, k and v
        assert isinstance(qkv.placements[0], _StridedShard) and qkv.to_local().shape == (24, 16)
        # gathered and split again by hand (kernelforge.distributed.strided: torch 2.11 cannot)
        whole = full_tensor(qkv)
        torch.testing.assert_close(whole, qkv_before, rtol=0, atol=0)
        again = distribute_like(whole, qkv)
        assert again.placements == qkv.placements and torch.equal(again.to_local(), qkv.to_local())
        assert model.layers[0].mlp.fc2.weight.placements == (Shard(1),)
        assert isinstance(model.layers[0].norm2.weight, DTensor) == sequence_parallel
        assert_same_step(_step(model, model.loss, ids), expected)
    return case


def _dp_case(level, mode):
    def case(mesh):
        import torch.distributed as dist
        from kernelforge.distributed.plans import data_parallel
        from torch.distributed.tensor import Shard

        model = _model(level)
        ids = torch.randint(0, 32, (4, 9))
        reference = copy.deepcopy(model)
        expected = _step(reference, reference.loss, ids)
        rank = dist.get_rank()
        half = ids[2 * rank: 2 * rank + 2]  # each rank its half of the batch
        if mode == "ddp":
            ddp = data_parallel(model, "ddp")
            assert ddp.model is model and ddp.gradient_as_bucket_view  # no bucket-to-gradient copies
            loss, grads, params = _step(model, ddp.loss, half)  # the loss through DDP's forward
        else:
            data_parallel(model, "fsdp2", mesh=mesh)
            assert model.layers[0].attn.qkv.weight.placements == (Shard(0),)
            assert model.head.weight is model.tok_emb.weight
            loss, grads, params = _step(model, model.loss, half)
        loss = loss.clone()
        dist.all_reduce(loss)  # the mean over equal halves: the full batch's mean
        assert_same_step((loss / 2, grads, params), expected)
    return case


def _fsdp2_compiled_case(level):
    # the compile and fastest levels on a model fully_shard made: each layer compiled on its own
    # with its hooks outside the graph (one graph of the whole loss broke at the hooks and ran
    # uncompiled): no graph break, and the step of the unsharded model at the reference level
    return lambda mesh: _fsdp2_compiled_step(mesh, level)


def _fsdp2_compiled_step(mesh, level):
    import torch.distributed as dist
    from kernelforge.distributed.plans import data_parallel
    from torch._dynamo.utils import counters

    model = _model("reference")
    ids = torch.randint(0, 32, (4, 9))
    reference = copy.deepcopy(model)
    expected = _step(reference, reference.loss, ids)
    rank = dist.get_rank()
    data_parallel(model, "fsdp2", mesh=mesh)
    model.set_level(level)
    counters.clear()
    loss, grads, params = _step(model, model.loss, ids[2 * rank: 2 * rank + 2])
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] >= 1, dict(counters)
    loss = loss.clone()
    dist.all_reduce(loss)
    assert_same_step((loss / 2, grads, params), expected)


def _generate_case(level, sequence_parallel=False):
    def case(mesh):
        import torch.distributed as dist
        from kernelforge.distributed.plans import tensor_parallel

        model = _model(level)
        ids = torch.randint(0, 32, (2, 5))
        reference = copy.deepcopy(model)
        expected = reference.generate(ids, max_new_tokens=6, temperature=0)
        tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
        tokens = model.generate(ids, max_new_tokens=6, temperature=0)
        torch.testing.assert_close(tokens, expected, rtol=0, atol=0)
        heads = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)  # the rank's 2 of the 4 heads
        for (k, v), (k_ref, v_ref) in zip(model.decoding.cache, reference.decoding.cache):
            assert k.shape[1] == 2
            torch.testing.assert_close(k, k_ref[:, heads], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(v, v_ref[:, heads], rtol=1e-10, atol=1e-12)
    return case


def _cases():
    cases = {}
    for level in LEVELS:
        cases[f"tensor-parallel-{level}"] = _tp_case(level, False)
        cases[f"tensor-parallel-sequence-parallel-{level}"] = _tp_case(level, True)
        cases[f"ddp-{level}"] = _dp_case(level, "ddp")
        cases[f"fsdp2-{level}"] = _dp_case(level, "fsdp2")
        cases[f"generate-tensor-parallel-{level}"] = _generate_case(level)
        cases[f"generate-sequence-parallel-{level}"] = _generate_case(level, sequence_parallel=True)
    cases.update({f"fsdp2-{level}-layerwise": _fsdp2_compiled_case(level) for level in ("compile", "fastest")})
    return cases


def _fsdp2_tp_case(sequence_parallel, dp_mesh_given):
    def case(mesh):
        from kernelforge.distributed.plans import data_parallel, tensor_parallel
        from torch.distributed.tensor import DTensor

        model = _model("reference")
        ids = torch.randint(0, 32, (4, 9))
        reference = copy.deepcopy(model)
        expected = _step(reference, reference.loss, ids)
        tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
        data_parallel(model, "fsdp2", mesh=mesh["dp"] if dp_mesh_given else mesh)
        qkv = model.layers[0].attn.qkv.weight  # (48, 16): tp rank (24, 16), then dp its 8 columns
        assert isinstance(qkv, DTensor) and qkv.device_mesh.ndim == 2 and qkv.to_local().shape == (24, 8)
        assert model.head.weight is model.tok_emb.weight
        dp = mesh.get_local_rank("dp")
        loss, grads, params = _step(model, model.loss, ids[2 * dp: 2 * dp + 2])  # the dp rank's half of the batch
        loss = loss.clone()
        torch.distributed.all_reduce(loss, group=mesh.get_group("dp"))  # the mean over equal halves
        assert_same_step((loss / 2, grads, params), expected)
    return case


def _refusals_case(mesh):
    from kernelforge.distributed.plans import data_parallel, tensor_parallel

    with pytest.raises(ValueError, match="mesh must be 1-D or 2-D with a 'dp' dimension"):
        data_parallel(_model("reference"), "fsdp2", mesh=_unnamed_2d(mesh))
    model = tensor_parallel(_model("reference"), mesh)  # the 2-D mesh: its "tp" dimension
    assert model.layers[0].attn.qkv.weight.device_mesh == mesh["tp"]
    with pytest.raises(ValueError, match="DDP over a tensor-parallel model is not supported"):
        data_parallel(model, "ddp", mesh=mesh)
    for wrong in (None, mesh["tp"]):
        with pytest.raises(ValueError, match="the model is tensor-parallel"):
            data_parallel(model, "fsdp2", mesh=wrong)


def _unnamed_2d(mesh):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(mesh.device_type, tuple(mesh.shape))  # 2-D without dimension names


def _cases_2d():
    return {
        "fsdp2-tp": _fsdp2_tp_case(False, dp_mesh_given=False),
        "fsdp2-tp-sequence-parallel": _fsdp2_tp_case(True, dp_mesh_given=True),
        "refusals": _refusals_case,
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory.mktemp("plans"), _cases)


@pytest.fixture(scope="module")
def results_2d(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory.mktemp("plans-2d"), _cases_2d, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))


@pytest.mark.parametrize("name", case_names(_cases))
def test_plan(results, name):
    assert_passed(results, name)


@pytest.mark.parametrize("name", case_names(_cases_2d))
def test_plan_2d(results_2d, name):
    assert_passed(results_2d, name)
