"""Every script of benchmarks/tuning/ and benchmarks/tools/ runs on the CPU with --tiny (small sizes,
Triton through its interpreter, a few seconds) or is skipped here with the reason from SKIPPED. The
scripts are found on disk, so a new one is covered as soon as it exists: it must be added to RUNNABLE
or to SKIPPED, or its test fails.

Each run is a subprocess from a temporary working directory (a script that writes where it stands
writes there, not into the repository), with the repository on PYTHONPATH as run_gpu.sh has it. The
selected scripts start together, WORKERS at a time: most of a run is Python starting and importing
torch, which overlaps."""
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT_FOLDERS = ("benchmarks/tuning", "benchmarks/tools")
SCRIPTS = sorted(path.relative_to(REPO).as_posix() for folder in SCRIPT_FOLDERS
                 for path in (REPO / folder).glob("*.py") if not path.name.startswith("_"))

# Scripts that run with --tiny, and whether their run is marked `slow` (deselected by -m "not slow"):
# the heaviest here (7-14 s each on two shared cores) and those another test runs already; the rest
# keep tuning sweeps and tools of every kind in the default run.
RUNNABLE = {
    "benchmarks/tuning/attention_block_sweep.py": False,
    "benchmarks/tuning/attention_sweep.py": True,
    "benchmarks/tuning/backend_order.py": True,
    "benchmarks/tuning/cross_entropy_sweep.py": False,
    "benchmarks/tuning/decode_step_sweep.py": False,
    "benchmarks/tuning/decode_sweep.py": True,
    "benchmarks/tuning/gemm_sweep.py": False,
    "benchmarks/tuning/softmax_sweep.py": False,
    "benchmarks/tools/allreduce_probe.py": False,
    "benchmarks/tools/decode_bench.py": False,
    "benchmarks/tools/gemm_overhead.py": False,
    "benchmarks/tools/hf_train_step.py": True,  # also tests/bench/test_hf_train_step.py
    "benchmarks/tools/host_overhead.py": True,  # also tests/bench/test_host_overhead.py
    "benchmarks/tools/linear_cross_entropy_head.py": False,
    "benchmarks/tools/memory_peak.py": False,
    "benchmarks/tools/model_profile.py": True,  # also tests/bench/test_model_profile.py
    "benchmarks/tools/profile_ops.py": True,
    "benchmarks/tools/repeat_timing.py": False,
    "benchmarks/tools/timeline_gaps.py": False,
}
# Scripts that cannot run on the CPU, and why (the test's skip reason).
SKIPPED = {
    "benchmarks/tuning/fastest_choices.py": "every variant is a fresh torch.compile of a workload at the fastest "
                                            "level (CUDA graphs on a GPU): on the CPU each is an Inductor C++ build "
                                            "of minutes, so it runs on a CUDA GPU only",
    "benchmarks/tools/attention_counters.py": "it exists to be read by Nsight Compute (ncu) for hardware counters: "
                                              "it needs a CUDA GPU and Nsight",
}
TIMEOUT_S = 240  # far above any script's time here: a hung interpreter run fails instead of stalling the suite
WORKERS = 2  # runs at once: a CPU test machine's two cores


def _param(script: str):
    return pytest.param(script, marks=pytest.mark.slow) if RUNNABLE.get(script) else script


def _environment() -> dict:
    return dict(os.environ, TRITON_INTERPRET="1",
                PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
                # one CPU thread a run: with the cores shared, torch's thread pools spun against each
                # other (a 4 x 64 layer norm took 50 ms, 0.1 ms on one thread)
                OMP_NUM_THREADS="1")


def _run_tiny(script: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as working_directory:
        return subprocess.run([sys.executable, str(REPO / script), "--tiny"], cwd=working_directory,
                              env=_environment(), capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def tiny_runs(request):
    """script -> the future of its --tiny run, for every runnable script this pytest run selects."""
    selected = [item.callspec.params["script"] for item in request.session.items
                if getattr(item, "module", None) is request.module
                and getattr(item, "originalname", None) == "test_script_runs_tiny_on_the_cpu"]
    pool = ThreadPoolExecutor(max_workers=WORKERS)
    yield {script: pool.submit(_run_tiny, script) for script in selected if script in RUNNABLE}
    pool.shutdown(cancel_futures=True)  # runs no test waits for any more (-x stopped the session) never start


def test_the_tables_name_only_scripts_on_disk():
    assert not RUNNABLE.keys() & SKIPPED.keys(), "a script is either run or skipped"
    assert set(RUNNABLE) | set(SKIPPED) <= set(SCRIPTS), "entries for scripts that are gone"
    assert all(SKIPPED.values()), "every skip names its reason"


@pytest.mark.parametrize("script", [_param(s) for s in SCRIPTS])
def test_script_runs_tiny_on_the_cpu(script, tiny_runs):
    if script in SKIPPED:
        pytest.skip(f"{script}: {SKIPPED[script]}")
    assert script in RUNNABLE, (f"{script} is in neither RUNNABLE nor SKIPPED of {Path(__file__).name}: give it "
                                "a --tiny run on the CPU, or a reason it cannot have one")
    done = tiny_runs[script].result()
    output = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, f"{script} --tiny exited {done.returncode}:\n{output}"
    assert done.stdout.strip(), f"{script} --tiny printed nothing:\n{output}"
