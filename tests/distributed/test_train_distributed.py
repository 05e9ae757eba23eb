"""examples/08_train_distributed.py as a user runs it: `torchrun --standalone --nproc_per_node 2` on
the CPU (gloo) (4 for FSDP2 x TP on a (2, 2) mesh), a tiny float64 model at the reference level,
4 steps with a checkpoint every 2. Each plan's loss at every step equals the one-process run's on
the full batch (DDP and FSDP2 give each rank half of it, TP the whole, FSDP2 x TP each dp group
half, the pipeline the whole in micro-batches), and so do its final checkpoint's parameters; a run resumed
from the step-2 checkpoint ends on the uninterrupted run's losses, parameters and AdamW state.
Every run writes only into pytest's tmp_path (its working directory, TMPDIR, --checkpoint-dir)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed._harness import skip_without_gloo

pytestmark = skip_without_gloo

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "08_train_distributed.py"
TIMEOUT_S = 180  # one run; each takes seconds
STEPS = 4
ARGS = ("--steps", str(STEPS), "--log-every", "1", "--checkpoint-every", "2", "--dtype", "float64",
        "--level", "reference", "--batch-size", "8", "--seq-len", "32")
PROGRESS = re.compile(r"^step (\d+)/(\d+)  loss (\S+)  tok/s/(?:rank|gpu) (\d+)  peak mem/rank ([\d.]+) MiB \((.+)\)$",
                      re.MULTILINE)


def run(tmp_path: Path, nproc: int | None, *args: str) -> dict[int, float]:
    """The script in one process (nproc None: plain python) or under torchrun; returns {step: loss}
    of its progress lines."""
    if nproc is not None and torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        pytest.skip(f"the script runs one GPU a rank: {nproc} ranks, {torch.cuda.device_count()} GPUs")
    launcher = [sys.executable] if nproc is None else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONDONTWRITEBYTECODE="1", TMPDIR=str(scratch))
    result = subprocess.run([*launcher, str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    lines = PROGRESS.findall(result.stdout)
    assert lines, f"no progress line:\n{result.stdout}"
    for step, total, loss, rate, memory, how in lines:
        assert float(loss) == float(loss) and int(rate) > 0 and float(memory) > 0 and how, (step, loss, rate, memory)
    return {int(step): float(loss) for step, total, loss, *_ in lines}


def checkpoint(directory: Path, step: int, out: Path) -> dict:
    """The DCP checkpoint of `step` as one flat dict of tensors (model, optimizer, step, data position)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = directory / f"step_{step:08d}"
    assert (path / ".metadata").exists(), sorted(p.name for p in directory.iterdir())
    dcp_to_torch_save(str(path), str(out))
    return flatten(torch.load(out, weights_only=False))


def flatten(state, prefix="") -> dict:
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in flatten(value, f"{prefix}{key}.").items()}
    if isinstance(state, list):
        return {k: v for i, value in enumerate(state) for k, v in flatten(value, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): state}


def assert_same(got: dict, expected: dict, keys=None) -> None:
    keys = keys or [k for k in expected if k.startswith("model.")]
    assert keys and set(keys) <= set(got), sorted(set(keys) - set(got))
    for key in keys:
        if isinstance(expected[key], torch.Tensor):
            torch.testing.assert_close(got[key], expected[key], rtol=1e-9, atol=1e-12, msg=lambda m: f"{key}: {m}")
        else:
            assert got[key] == expected[key], key


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The uninterrupted one-process run (no torchrun, --parallel none): (losses, its directory)."""
    tmp = tmp_path_factory.mktemp("one-process")
    losses = run(tmp, None, *ARGS, "--parallel", "none", "--checkpoint-dir", str(tmp / "ckpt"))
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses, tmp / "ckpt"


def test_no_arguments_is_a_quick_single_process_run(tmp_path):
    losses = run(tmp_path, None)
    assert losses and max(losses) == 10
    assert list((tmp_path / "tmp").glob("kernelforge-dist-*/step_00000010/.metadata"))  # the checkpoint at the end


def check_plan(plan: str, one_process, tmp_path: Path, nproc: int = 2, *plan_args: str) -> None:
    expected_losses, expected_dir = one_process
    losses = run(tmp_path, nproc, *ARGS, "--parallel", plan, *plan_args, "--checkpoint-dir", str(tmp_path / "full"))
    assert losses.keys() == expected_losses.keys()
    for step in losses:  # the global batch's loss: the one process's on the whole batch
        assert losses[step] == pytest.approx(expected_losses[step], rel=1e-9), (step, losses, expected_losses)
    final = checkpoint(tmp_path / "full", STEPS, tmp_path / "full.pt")
    assert_same(final, checkpoint(expected_dir, STEPS, tmp_path / "one.pt"))
    assert int(final["train.step"]) == STEPS and int(final["train.data_position"]) == STEPS * 8

    # interrupted after step 2: a directory holding only the step-2 checkpoint, resumed to step 4
    shutil.copytree(tmp_path / "full" / "step_00000002", tmp_path / "resumed" / "step_00000002")
    resumed = run(tmp_path, nproc, *ARGS, "--parallel", plan, *plan_args, "--checkpoint-dir", str(tmp_path / "resumed"),
                  "--resume")
    assert sorted(resumed) == [3, 4], resumed
    for step in resumed:
        assert resumed[step] == pytest.approx(losses[step], rel=1e-12), (step, resumed, losses)
    after = checkpoint(tmp_path / "resumed", STEPS, tmp_path / "resumed.pt")
    assert_same(after, final, keys=sorted(final))  # parameters, AdamW's moments and step, the data position


def test_ddp(one_process, tmp_path):
    check_plan("ddp", one_process, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["fsdp2", "tp", "tp-sp"])
def test_plan(plan, one_process, tmp_path):
    check_plan(plan, one_process, tmp_path)


def test_fsdp2_with_activation_checkpointing(one_process, tmp_path):
    # each layer run again in the backward: the same losses, parameters and resumed state as the
    # one process without it
    check_plan("fsdp2", one_process, tmp_path, 2, "--activation-checkpointing")


def test_fsdp2_at_the_fastest_level(one_process, tmp_path):
    # the whole-graph compile of the fastest level stops at fully_shard's hooks (Dynamo does not
    # trace them; one fullgraph compile of the model failed): the compiled model, its layers
    # checkpointed, gives the reference's losses and parameters
    check_plan("fsdp2", one_process, tmp_path, 2, "--level", "fastest", "--activation-checkpointing")


def test_the_pipeline_with_activation_checkpointing(one_process, tmp_path):
    # the stages run their layers through the same layer_call: the same losses as one process
    check_plan("pp", one_process, tmp_path, 2, "--microbatches", "2", "--activation-checkpointing")


def test_fsdp2_tp_on_a_2d_mesh(one_process, tmp_path):
    check_plan("fsdp2-tp", one_process, tmp_path, 4, "--tp", "2")


@pytest.mark.slow
def test_fsdp2_tp_sequence_parallel_on_a_2d_mesh(one_process, tmp_path):
    check_plan("fsdp2-tp-sp", one_process, tmp_path, 4, "--tp", "2")


def test_pipeline(one_process, tmp_path):
    # two stages of one layer each, the batch in 2 micro-batches (1F1B): the same losses and final
    # parameters as one process; each rank's checkpoint holds its stage (tok_emb on the first, the
    # head's copy of it on the last), together the model's keys
    check_plan("pp", one_process, tmp_path, 2, "--microbatches", "2")


def test_a_profiled_step_writes_each_ranks_trace(tmp_path):
    # --profile-step: every rank's chrome trace of that step, rank 0's table of ops; the trace reads
    # back through benchmarks/tools/timeline_gaps.py --trace (no device operations on a CPU)
    losses = run(tmp_path, 2, *ARGS, "--parallel", "ddp", "--profile-step", "3",
                 "--profile-dir", str(tmp_path / "prof"))
    assert sorted(losses) == list(range(1, STEPS + 1))
    traces = sorted(p.name for p in (tmp_path / "prof").iterdir())
    assert traces == ["rank0-step3.json", "rank1-step3.json"]
    report = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tools" / "timeline_gaps.py"), "--trace",
                             str(tmp_path / "prof" / "rank0-step3.json")], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=TIMEOUT_S)
    assert report.returncode == 0 and report.stdout.startswith("no device operations in the trace"), report
