"""kernelforge.distributed.pipeline on CPU processes over gloo (tests/distributed/_harness.py): a tiny
float64 LanguageModel at the reference level (the same seed on every rank) split into a 2-stage
pipeline, trained one step through the 1F1B and GPipe schedules with 2 and 4 micro-batches,
against the one-process model on the full batch: the loss (on the last stage), every parameter's
gradient on its stage (the tied embedding's two copies each with the full tied gradient) and
its value after one AdamW step; gradient accumulation over two steps, eval_loss, an explicit
layer split, an untied head (the pipeline group given as a process group); the bad inputs.
Slow: the interleaved schedule, the native level, and pipeline x data parallelism (FSDP2, DDP)
on a 4-process (pp=2, dp=2) mesh."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed._harness import assert_passed, case_names, run_job, skip_without_gloo

pytestmark = skip_without_gloo

VOCAB = 32


def _model(n_layers=3, level="reference", tied=True):
    from kernelforge.models import LanguageModel

    model = LanguageModel(vocab_size=VOCAB, dim=16, n_layers=n_layers, n_heads=4, max_seq_len=16, level=level).double()
    if not tied:
        model.head.weight = torch.nn.Parameter(torch.randn_like(model.head.weight) * 0.02)
    return model


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _reference(model, batches):
    """The one-process run: the loss of each batch, the gradients accumulated over them, the
    parameters after one AdamW step, by name."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    with model.kernel_scope():
        for ids in batches:
            loss = model.loss(ids)
            loss.backward()
            losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _pipeline_step(pipe, batches):
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
    losses = [pipe.step(ids) for ids in batches]
    grads = {n: _full(p.grad).clone() for n, p in pipe.named_parameters()}
    optimizer.step()
    return losses, grads, {n: _full(p.detach()).clone() for n, p in pipe.named_parameters()}


def _compare(pipe, got, expected, tied=True):
    (losses, grads, params), (losses_ref, grads_ref, params_ref) = got, expected
    for loss, loss_ref in zip(losses, losses_ref):
        if pipe.is_last:
            torch.testing.assert_close(loss, loss_ref, rtol=1e-10, atol=1e-12)
        else:
            assert loss is None, loss
    assert grads, "the stage holds no parameter"
    for name in grads:
        # the last stage's tied head is its copy of the one tied parameter, named tok_emb.weight in the model
        ref_name = "tok_emb.weight" if name == "head.weight" and tied else name
        torch.testing.assert_close(grads[name], grads_ref[ref_name], rtol=1e-9, atol=1e-12,
                                   msg=lambda m: f"gradient of {name}: {m}")
        torch.testing.assert_close(params[name], params_ref[ref_name], rtol=1e-9, atol=1e-12,
                                   msg=lambda m: f"updated {name}: {m}")


def _layer_indices(pipe):
    return sorted({int(n.split(".")[1]) for n, _ in pipe.named_parameters() if n.startswith("layers.")})


def _train_case(schedule, n_microbatches, *, n_layers=3, stage_layers=None, tied=True, steps=1, level="reference",
                stages_per_rank=None, expected_layers=None, as_group=False):
    def case(mesh):
        import torch.distributed as dist
        from kernelforge.distributed import pipeline_parallel

        model = _model(n_layers, level, tied)
        batches = [torch.randint(0, VOCAB, (4, 9)) for _ in range(steps)]
        reference = copy.deepcopy(model)
        expected = _reference(reference, batches)
        pipe = pipeline_parallel(model, mesh.get_group() if as_group else mesh, n_microbatches, schedule,
                                 stage_layers=stage_layers,
                                 stages_per_rank=stages_per_rank)
        rank = dist.get_rank()
        assert pipe.is_first == (rank == 0) and pipe.is_last == (rank == 1)
        if expected_layers is not None:
            assert _layer_indices(pipe) == expected_layers[rank], _layer_indices(pipe)
        names = {n for n, _ in pipe.named_parameters()}
        assert ("tok_emb.weight" in names) == (rank == 0) and ("head.weight" in names) == (rank == 1), names
        _compare(pipe, _pipeline_step(pipe, batches), expected, tied)
        eval_loss = pipe.eval_loss(batches[0])
        if pipe.is_last:
            with torch.no_grad(), reference.kernel_scope():
                torch.testing.assert_close(eval_loss, reference.loss(batches[0]), rtol=1e-10, atol=1e-12)
        else:
            assert eval_loss is None
    return case


def _bad_inputs_case(mesh):
    from kernelforge.distributed import pipeline_parallel

    with pytest.raises(ValueError, match="schedule must be one of"):
        pipeline_parallel(_model(), mesh, 2, "zero-bubble")
    with pytest.raises(ValueError, match="1 layers cannot fill 2 stages"):
        pipeline_parallel(_model(n_layers=1), mesh, 2)
    with pytest.raises(ValueError, match="adding up to the model's 3 layers"):
        pipeline_parallel(_model(), mesh, 2, stage_layers=[1, 1])
    with pytest.raises(ValueError, match="entries for 2 stages"):
        pipeline_parallel(_model(), mesh, 2, stage_layers=[3])
    with pytest.raises(ValueError, match="n_microbatches must be a positive int"):
        pipeline_parallel(_model(), mesh, 0)
    with pytest.raises(ValueError, match="data_parallel needs a 2-D DeviceMesh"):
        pipeline_parallel(_model(), mesh, 2, data_parallel="fsdp2")
    with pytest.raises(ValueError, match="stages_per_rank"):
        pipeline_parallel(_model(), mesh, 2, "1f1b", stages_per_rank=2)
    with pytest.raises(ValueError, match="'fastest' level"):
        pipeline_parallel(_model().set_level("fastest"), mesh, 2)
    pipe = pipeline_parallel(_model(), mesh, 2)
    with pytest.raises(ValueError, match="does not split into 2 equal micro-batches"):
        pipe.step(torch.randint(0, VOCAB, (3, 9)))
    with pytest.raises(ValueError, match="ids must be"):
        pipe.step(torch.randint(0, VOCAB, (4,)))
    assert pipe.step(torch.randint(0, VOCAB, (4, 9))) is None or pipe.is_last  # still usable after the refusals


def _cases():
    cases = {}
    for schedule in ("1f1b", "gpipe"):
        for n in (2, 4):
            cases[f"{schedule}-{n}-microbatches"] = _train_case(schedule, n, expected_layers=[[0, 1], [2]])
    cases["1f1b-accumulate-2-steps"] = _train_case("1f1b", 2, steps=2)
    cases["1f1b-stage-layers-0-3"] = _train_case("1f1b", 2, stage_layers=[0, 3], expected_layers=[[], [0, 1, 2]])
    cases["1f1b-untied-head-process-group"] = _train_case("1f1b", 2, tied=False, as_group=True)
    cases["bad-inputs"] = _bad_inputs_case
    return cases


def _slow_cases():
    return {
        "interleaved-1f1b-4-microbatches": _train_case("interleaved-1f1b", 4, n_layers=4,
                                                       expected_layers=[[0, 2], [1, 3]]),
        "gpipe-native-level": _train_case("gpipe", 2, level="native"),
    }


def _pp_dp_case(data_parallel):
    def case(mesh):
        import torch.distributed as dist
        from kernelforge.distributed import pipeline_parallel

        model = _model()
        ids = torch.randint(0, VOCAB, (8, 9))
        reference = copy.deepcopy(model)
        expected = _reference(reference, [ids])
        pipe = pipeline_parallel(model, mesh, 2, "1f1b", data_parallel=data_parallel)
        dp = mesh["dp"].get_local_rank()
        part = ids[4 * dp: 4 * dp + 4]  # each dp rank its half of the batch, 2 micro-batches of 2
        assert pipe.is_first == (mesh["pp"].get_local_rank() == 0), dist.get_rank()
        _compare(pipe, _pipeline_step(pipe, [part]), expected)
    return case


def _pp_dp_cases():
    return {f"pp2-dp2-{mode}": _pp_dp_case(mode) for mode in ("fsdp2", "ddp")}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory.mktemp("pipeline"), _cases)


@pytest.fixture(scope="module")
def slow_results(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory.mktemp("pipeline-slow"), _slow_cases)


@pytest.fixture(scope="module")
def pp_dp_results(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory.mktemp("pipeline-pp-dp"), _pp_dp_cases, mesh_shape=(2, 2),
                   mesh_dim_names=("pp", "dp"))


@pytest.mark.parametrize("name", case_names(_cases))
def test_pipeline(results, name):
    assert_passed(results, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", case_names(_slow_cases))
def test_pipeline_slow(slow_results, name):
    assert_passed(slow_results, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", case_names(_pp_dp_cases))
def test_pipeline_with_data_parallel(pp_dp_results, name):
    assert_passed(pp_dp_results, name)
