"""kernelforge.distributed.plans on 2 CPU processes over gloo (tests/distributed/_harness.py): a tiny
float64 LanguageModel (the same seed on every rank) at the reference and native levels, one
training step (forward, loss, backward, AdamW step) tensor-parallel (with and without sequence
parallelism: the same batch on both ranks) and data-parallel (DDP, FSDP2: each rank half the
batch) against the one-process run of the same model on the full batch: the loss, every
parameter's gradient and updated value (DTensors gathered with full_tensor())."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed._harness import assert_passed, case_names, run_job, skip_without_gloo

pytestmark = skip_without_gloo

LEVELS = ("reference", "native")


def _model(level):
    from kernelforge.models import LanguageModel

    return LanguageModel(vocab_size=32, dim=16, n_layers=2, n_heads=4, max_seq_len=16, level=level).double()


def _step(model, loss_fn, ids):
    """One AdamW step of `model`'s parameters on loss_fn(ids): the loss, the gradients and the updated parameters by name (full tensors)."""
    from torch.distributed.tensor import DTensor

    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with model.kernel_scope():
        loss = loss_fn(ids)
        loss.backward()
    grads = {n: full(p.grad).clone() for n, p in model.named_parameters()}
    optimizer.step()
    params = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    return full(loss.detach()), grads, params


def _compare(got, expected):
    (loss, grads, params), (loss_ref, grads_ref, params_ref) = got, expected
    torch.testing.assert_close(loss, loss_ref, rtol=1e-10, atol=1e-12)
    assert grads.keys() == grads_ref.keys(), (sorted(grads), sorted(grads_ref))
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-9, atol=1e-12,
                                   msg=lambda m: f"gradient of {name}: {m}")
        torch.testing.assert_close(params[name], params_ref[name], rtol=1e-9, atol=1e-12,
                                   msg=lambda m: f"updated {name}: {m}")


def _tp_case(level, sequence_parallel):
    def case(mesh):
        from kernelforge.distributed.plans import tensor_parallel
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        model = _model(level)
        ids = torch.randint(0, 32, (4, 9))  # 8 positions after the shift: Shard(1) splits them evenly
        reference = copy.deepcopy(model)
        expected = _step(reference, reference.loss, ids)
        tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
        assert model.head.weight is model.tok_emb.weight  # still tied
        assert model.layers[0].attn.num_heads == 2
        qkv = model.layers[0].attn.qkv.weight  # each rank its 2 heads' rows of q, k and v
        assert isinstance(qkv.placements[0], _StridedShard) and qkv.to_local().shape == (24, 16)
        assert model.layers[0].mlp.fc2.weight.placements == (Shard(1),)
        assert isinstance(model.layers[0].norm2.weight, DTensor) == sequence_parallel
        _compare(_step(model, model.loss, ids), expected)
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
            assert ddp.model is model
            loss, grads, params = _step(model, ddp.loss, half)  # the loss through DDP's forward
        else:
            data_parallel(model, "fsdp2", mesh=mesh)
            assert model.layers[0].attn.qkv.weight.placements == (Shard(0),)
            assert model.head.weight is model.tok_emb.weight
            loss, grads, params = _step(model, model.loss, half)
        loss = loss.clone()
        dist.all_reduce(loss)  # the mean over equal halves: the full batch's mean
        _compare((loss / 2, grads, params), expected)
    return case


def _cases():
    cases = {}
    for level in LEVELS:
        cases[f"tensor-parallel-{level}"] = _tp_case(level, False)
        cases[f"tensor-parallel-sequence-parallel-{level}"] = _tp_case(level, True)
        cases[f"ddp-{level}"] = _dp_case(level, "ddp")
        cases[f"fsdp2-{level}"] = _dp_case(level, "fsdp2")
    return cases


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory.mktemp("plans"), _cases)


@pytest.mark.parametrize("name", case_names(_cases))
def test_plan(results, name):
    assert_passed(results, name)
