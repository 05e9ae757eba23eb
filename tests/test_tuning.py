"""Measured backend choice (kernelforge.tuning): on the CPU with a fake timer and a fake GPU name
(the `measure` and `device_name` seams, and `_MEASURE_CPU` to let CPU tensors be measured),
the cache file, the CLI; on a GPU (-m gpu) a real measurement reused by a second process."""
import functools
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernelforge as kf
from kernelforge import backends, tuning
from kernelforge.cli import main
from kernelforge.reference.attention import Visibility
from tests.conftest import needs_cuda

PROBE = "tuning_probe"
GPU = "Fake GPU 80GB"
FAKE_TIMES = {"triton": 20.0, "cuda": 10.0}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory, measurement on, and nothing read or measured yet."""
    monkeypatch.setenv("KERNELFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KERNELFORGE_TUNING", raising=False)
    monkeypatch.delenv("KERNELFORGE_BACKEND", raising=False)
    tuning.reset()
    yield tmp_path / "cache" / "tuning.json"
    tuning.reset()


def _probe_impl(x):
    backends.select(PROBE, x)  # the forced backend must be the one chosen
    return x * 2


@pytest.fixture
def probe(cache, monkeypatch):
    """An op with three backends that all take CPU tensors, measured on the CPU under a fake GPU
    name, with `measure` returning FAKE_TIMES for the forced backend. Yields the list of
    (backend, output) each measured run gave."""
    always = lambda *inputs, **options: None  # noqa: E731
    for b in ("triton", "cuda", "reference"):
        backends.register(PROBE, b, "kernelforge.reference.softmax", always)
    backends.set_preference(PROBE, lambda x: (("triton", "cuda", "reference"), "the probe's rule"),
                            lambda x: (x.device.type, x.dtype))
    backends.set_tuning(PROBE, tuning.Tuner(lambda x: (tuning.pow2(x.shape[0]), x.dtype),
                                            lambda x: functools.partial(_probe_impl, x)))
    runs = []

    def fake_measure(run, device, budget_s):
        backend = backends.forced_backend()
        runs.append((backend, run()))
        return FAKE_TIMES[backend]

    monkeypatch.setattr(tuning, "measure", fake_measure)
    monkeypatch.setattr(tuning, "device_name", lambda device: GPU)
    monkeypatch.setattr(tuning, "_MEASURE_CPU", True)
    monkeypatch.setattr(tuning, "cuda_ready", lambda extension: True)
    yield runs
    for table in (backends._registry, backends._preferences, backends._choice_keys, backends._buckets,
                  backends._tuners):
        table.pop(PROBE, None)
    backends.forget_choices()


def _context() -> str:
    return tuning.context_of(torch.device("cpu"))


def _file(path) -> dict:
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------- measuring
def test_a_rank_of_a_distributed_job_measures_nothing_but_uses_the_file(probe, cache, monkeypatch):
    x = torch.randn(5, 3)
    monkeypatch.setattr(tuning, "in_distributed_job", lambda: True)
    choice = backends.select(PROBE, x)
    assert choice.backend == "triton" and not choice.measured and probe == []  # the rules
    assert choice.unmeasured == tuning.DISTRIBUTED and not cache.exists()
    monkeypatch.setattr(tuning, "in_distributed_job", lambda: False)
    tuning.reset()
    assert backends.select(PROBE, x).backend == "cuda" and len(probe) == 2  # measured, written
    monkeypatch.setattr(tuning, "in_distributed_job", lambda: True)
    tuning.reset()  # as a rank of a later job: the file read, nothing measured
    choice = backends.select(PROBE, x)
    assert choice.backend == "cuda" and choice.measured and len(probe) == 2


def test_an_unbuilt_cuda_extension_is_not_a_candidate(probe, monkeypatch):
    """A first call does not wait for nvcc: without a built extension only triton is left, and one
    candidate is not measured."""
    asked = []
    monkeypatch.setattr(tuning, "cuda_ready", lambda extension: asked.append(extension) or False)
    choice = backends.select(PROBE, torch.randn(5, 3))
    assert choice.backend == "triton" and not choice.measured and probe == []
    assert asked == [PROBE] and "cuda's extension is not built yet" in choice.unmeasured


def test_the_compiler_knows_an_extension_is_built_without_building_it(tmp_path, monkeypatch):
    from kernelforge.cuda.compiler import EXTENSIONS, CUDACompiler, visible_arch_list

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    compiler = CUDACompiler(cache_dir=tmp_path)
    assert not compiler.ready("gemm") and not compiler.ready("no such extension")
    sources = [compiler.source_dir / s for s in EXTENSIONS["gemm"].sources]
    name = f"{EXTENSIONS['gemm'].name}_{compiler.cache_key(sources, visible_arch_list())[:16]}"
    (tmp_path / name).mkdir()
    (tmp_path / name / f"{name}.so").write_bytes(b"")  # what a finished JIT build leaves
    assert compiler.ready("gemm") and not compiler.ready("softmax")


def test_measures_each_bucket_once_and_keeps_the_fastest(probe):
    choice = backends.select(PROBE, torch.randn(5, 3))
    assert choice.backend == "cuda" and choice.measured == (("cuda", 10.0), ("triton", 20.0))
    assert [b for b, _ in probe] == ["triton", "cuda"]  # the reference is no contender
    assert "measured fastest for inputs like these on Fake GPU 80GB" in choice.reason
    assert backends.select(PROBE, torch.randn(7, 3)).backend == "cuda"  # 7 rows: the bucket of 8 again
    assert len(probe) == 2
    backends.select(PROBE, torch.randn(9, 3))  # 16
    assert len(probe) == 4


def test_the_runs_are_detached_and_unrecorded(probe):
    x = torch.randn(4, 3, requires_grad=True)
    with backends.recording() as counts:
        assert backends.select(PROBE, x).backend == "cuda"
    assert dict(counts) == {(PROBE, "cuda"): 1}
    assert all(not out.requires_grad and out.grad_fn is None for _, out in probe)
    assert all(torch.equal(out, x.detach() * 2) for _, out in probe)


def test_a_candidate_that_fails_is_left_out(probe, monkeypatch):
    def measure(run, device, budget_s):
        if backends.forced_backend() == "cuda":
            raise RuntimeError("the extension did not build")
        return 30.0

    monkeypatch.setattr(tuning, "measure", measure)
    choice = backends.select(PROBE, torch.randn(4, 3))
    assert choice.backend == "triton" and choice.measured == (("triton", 30.0),)


def test_every_candidate_failing_leaves_the_rules(probe, monkeypatch):
    monkeypatch.setattr(tuning, "measure", lambda run, device, budget_s: 1 / 0)
    choice = backends.select(PROBE, torch.randn(4, 3))
    assert choice.backend == "triton" and not choice.measured
    assert "every candidate failed when measured (triton: ZeroDivisionError" in choice.unmeasured


def test_no_measurement_when_forced_preferred_or_traced(probe, monkeypatch):
    x = torch.randn(4, 3)
    with backends.use_backend("reference"):
        assert backends.select(PROBE, x).backend == "reference"
        assert "rules (no measurement: reference is forced)" in kf.explain(PROBE, x)
    with backends.prefer_backend("cuda"):
        assert backends.select(PROBE, x).reason == "cuda was preferred"
    with backends.tracing():
        assert backends.select(PROBE, x).backend == "triton"
    monkeypatch.setenv("KERNELFORGE_BACKEND", "reference")
    assert backends.select(PROBE, x).backend == "reference"
    assert probe == []


def test_the_environment_variable_turns_measurement_off(probe, monkeypatch):
    monkeypatch.setenv("KERNELFORGE_TUNING", "0")
    x = torch.randn(4, 3)
    assert backends.select(PROBE, x).backend == "triton"
    assert "rules (no measurement: KERNELFORGE_TUNING is '0')" in kf.explain(PROBE, x)
    assert probe == [] and not tuning.cache_path().exists()


def test_a_dispatch_mode_defers_the_measurement_uncached(probe):
    # an eager plan's recording is a dispatch mode: measuring inside it would record the runs
    x = torch.randn(4, 3)
    with TorchDispatchMode():
        choice = backends.select(PROBE, x)
    assert choice.backend == "triton" and choice.unmeasured == "a dispatch mode is active" and probe == []
    assert backends.select(PROBE, x).backend == "cuda"  # not cached: the next call measures


def test_a_changed_choice_drops_the_eager_plans_after_a_deferred_call(probe):
    before = backends.plan_key()
    backends.select(PROBE, torch.randn(4, 3))  # measured before any plan could hold the bucket's choice
    assert backends.plan_key() == before
    x = torch.randn(40, 3)
    with TorchDispatchMode():  # a plan recorded here would hold the rules' triton
        assert backends.select(PROBE, x).backend == "triton"
    assert backends.plan_key() == before
    assert backends.select(PROBE, x).backend == "cuda"
    assert backends.plan_key() != before


# ----------------------------------------------------------------------------- the cache file
def test_the_file_holds_the_entry_and_a_new_process_reuses_it(probe, cache, monkeypatch):
    backends.select(PROBE, torch.randn(5, 3))
    data = _file(cache)
    assert data["format"] == tuning.FORMAT
    context = data["contexts"][_context()]
    assert context["gpu"] == GPU and context["versions"]["torch"] == torch.__version__
    assert context["entries"] == {f"{PROBE} (8, torch.float32)": {"backend": "cuda", "us": FAKE_TIMES}}
    tuning.reset()  # what a new process knows: the file
    monkeypatch.setattr(tuning, "measure", lambda *args: pytest.fail("measured again"))
    x = torch.randn(6, 3)
    with TorchDispatchMode():  # the rules, uncached: an eager plan may hold them
        assert backends.select(PROBE, x).backend == "triton"
    before = backends.plan_key()
    choice = backends.select(PROBE, x)
    assert choice.backend == "cuda" and choice.measured == (("cuda", 10.0), ("triton", 20.0))
    assert backends.plan_key() != before  # the file's choice differs from the one handed out: plans dropped


def test_a_save_merges_what_another_process_wrote(probe, cache, monkeypatch):
    backends.select(PROBE, torch.randn(5, 3))
    data = _file(cache)
    theirs = {"backend": "triton", "us": {"triton": 1.0, "cuda": 2.0}}
    data["contexts"][_context()]["entries"][f"{PROBE} (32, torch.float32)"] = theirs
    cache.write_text(json.dumps(data))
    backends.select(PROBE, torch.randn(100, 3))  # 128: measured here, saved with theirs
    assert set(_file(cache)["contexts"][_context()]["entries"]) == {
        f"{PROBE} (8, torch.float32)", f"{PROBE} (32, torch.float32)", f"{PROBE} (128, torch.float32)"}
    runs = len(probe)
    assert backends.select(PROBE, torch.randn(20, 3)).backend == "triton"  # theirs, read at the save
    assert len(probe) == runs


@pytest.mark.parametrize("change", ["gpu", "version"])
def test_another_gpu_or_library_version_measures_anew(probe, cache, monkeypatch, change):
    backends.select(PROBE, torch.randn(5, 3))
    old_context = _context()
    tuning.reset()
    if change == "gpu":
        monkeypatch.setattr(tuning, "device_name", lambda device: "Another GPU")
    else:
        newer = {**tuning.versions(), "kernelforge": "9.9"}
        monkeypatch.setattr(tuning, "versions", lambda: newer)
    backends.select(PROBE, torch.randn(5, 3))
    assert len(probe) == 4
    assert set(_file(cache)["contexts"]) == {old_context, _context()} and old_context != _context()


@pytest.mark.parametrize("content", ["{not json", '{"format": 99, "contexts": {}}', '{"contexts": [1]}'])
def test_a_corrupt_file_is_ignored_with_one_warning_and_rewritten(probe, cache, content):
    cache.parent.mkdir(parents=True)
    cache.write_text(content)
    with pytest.warns(RuntimeWarning, match="is corrupt") as caught:
        assert backends.select(PROBE, torch.randn(5, 3)).backend == "cuda"
        backends.select(PROBE, torch.randn(50, 3))
    assert len([w for w in caught if "tuning cache" in str(w.message)]) == 1
    assert len(_file(cache)["contexts"][_context()]["entries"]) == 2


def test_an_unwritable_location_keeps_measurements_in_memory_with_one_warning(probe, tmp_path, monkeypatch):
    in_the_way = tmp_path / "a_file"
    in_the_way.write_text("")
    monkeypatch.setenv("KERNELFORGE_CACHE_DIR", str(in_the_way / "cache"))  # no directory can be made there
    with pytest.warns(RuntimeWarning, match="cannot write the tuning cache") as caught:
        backends.select(PROBE, torch.randn(5, 3))
        backends.select(PROBE, torch.randn(50, 3))
    assert len([w for w in caught if "tuning cache" in str(w.message)]) == 1
    assert len(probe) == 4 and in_the_way.read_text() == ""
    backends.forget_choices()
    backends.select(PROBE, torch.randn(5, 3))  # kept in memory
    assert len(probe) == 4


# ----------------------------------------------------------------------------- the ops that opt in
def test_the_ops_that_opt_in(monkeypatch):
    assert tuning.GEMM.bucket(torch.randn(4, 4), torch.randn(4, 4)) is None  # CPU calls: no bucket in the key
    monkeypatch.setattr(tuning, "_MEASURE_CPU", True)
    assert [op for op in ("gemm", "norms", "softmax", "attention", "rope") if backends.tuned(op)] == [
        "gemm", "norms", "softmax", "attention"]
    a, b = torch.randn(3, 100, 64), torch.randn(32, 64).t()
    assert tuning.GEMM.bucket(a, b, compute="fp32") == (512, 32, 64, 1, True, torch.float32, torch.float32, "fp32")
    assert tuning.SOFTMAX.bucket(torch.randn(3, 5, 7), dim=1) == (32, 5, torch.float32)
    x, w = torch.randn(6, 10, dtype=torch.bfloat16), torch.randn(10)
    assert tuning.NORMS.bucket(x, w, None, n=10) == (8, 10, torch.bfloat16, torch.float32, None)
    assert tuning.NORMS.bucket(x, w, None, n=10, backward=True) is None
    q, k = torch.randn(2, 4, 100, 16), torch.randn(2, 2, 300, 16)
    assert tuning.ATTENTION.bucket(q, k, k, vis=Visibility(None, 0)) == (8, 128, 512, 2, 16, 16, torch.float32, None, 0)
    assert tuning.ATTENTION.bucket(q, k, k, vis=Visibility(None, 0), backward=True) is None
    assert tuning.ATTENTION.bucket(q, k, k, vis=Visibility(None, None, attn_mask=torch.ones(1, dtype=torch.bool))) is None


def test_the_runners_run_the_ops_without_touching_their_inputs():
    a, b = torch.randn(2, 5, 8), torch.randn(8, 3)
    x, w, bias = torch.randn(4, 6), torch.randn(6), torch.randn(6)
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    inputs = [t.clone() for t in (a, b, x, w, bias, q, k, v)]
    with backends.use_backend("reference"):
        torch.testing.assert_close(tuning.GEMM.run(a, b, compute="fp32")()[0], a @ b)
        torch.testing.assert_close(tuning.SOFTMAX.run(x, dim=0)(), torch.softmax(x, 0))
        torch.testing.assert_close(tuning.NORMS.run(x, w, None, n=6)()[0],
                                   torch.nn.functional.rms_norm(x, (6,), w, 1e-5))
        torch.testing.assert_close(tuning.NORMS.run(x, w, bias, n=6)()[0],
                                   torch.nn.functional.layer_norm(x, (6,), w, bias, 1e-5))
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.ones(5, 7, dtype=torch.bool).tril(7 - 5))
        torch.testing.assert_close(tuning.ATTENTION.run(q, k, v, vis=Visibility(None, 0))()[0], expected)
    assert all(torch.equal(t, c) for t, c in zip((a, b, x, w, bias, q, k, v), inputs))


def test_explain_says_why_the_rules_decided(cache):
    x = torch.randn(3, 4)
    assert "rules (no measurement: only CUDA calls are measured, this one has a cpu tensor)" in kf.explain("softmax", x)
    assert "rules (no measurement: rope does not opt in to measurement)" in kf.explain("rope", torch.randn(1, 1, 2, 4))


def test_a_real_op_with_one_candidate_is_not_measured(probe):
    # measured on the CPU (the fake GPU): the rules list the reference only there
    text = kf.explain("softmax", torch.randn(3, 4))
    assert "rules (no measurement: only the reference can run these inputs)" in text and probe == []


def test_explain_shows_the_measured_times(probe):
    text = kf.explain(PROBE, torch.randn(4, 3))
    assert f"{PROBE}: runs on cuda because it measured fastest for inputs like these on {GPU}." in text
    assert "  measured: cuda 10.0 us, triton 20.0 us" in text


# ----------------------------------------------------------------------------- the command
def test_tune_show_and_clear(cache, capsys, monkeypatch):
    assert main(["tune", "--show"]) == 0
    assert f"tuning cache: {cache} (none yet)" in capsys.readouterr().out
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"format": 1, "contexts": {"GPU X | torch 0": {"gpu": "GPU X", "versions": {}, "entries": {
        "gemm (8,)": {"backend": "triton", "us": {"triton": 1.0, "cuda": 2.0}}}}}}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    assert "other GPUs or versions: 1 entries in 1 contexts" in out and "GPU X | torch 0: 1" in out
    assert main(["tune", "--clear"]) == 0
    assert f"deleted {cache}" in capsys.readouterr().out and not cache.exists()


def test_tune_without_a_gpu_fails_clearly(cache, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune", "--suite", "softmax"]) == 2
    assert "kernelforge tune: no CUDA GPU is visible" in capsys.readouterr().err


def test_filling_runs_the_suites_and_models(probe):
    # on the CPU (the fake GPU): the real ops have the reference only there, so nothing is measured;
    # what runs is the filling's own path through the suites' inputs and the models' kernels
    from kernelforge.tuning_fill import fill_from_models, fill_from_suites

    out = io.StringIO()
    cpu = torch.device("cpu")
    assert fill_from_suites(["softmax", "rms_norm"], ["fp32"], out, device=cpu, quick=True) == 0
    assert out.getvalue() == "softmax: 0 new entries\nrms_norm: 0 new entries\n"
    out = io.StringIO()
    with backends.recording() as counts:  # the model ran on kernelforge's ops, forward and backward
        assert fill_from_models(["gnn"], ["fp32"], out, device=cpu, realistic=False) == 0
    assert out.getvalue() == "GNN forward (fp32): 0 new entries\n"
    assert {"gather_scatter", "norms"} <= {op for op, _ in counts}
    with pytest.raises(ValueError, match="no benchmark suite"):
        fill_from_suites(["no_such_suite"], ["fp32"], out, device=cpu)


def test_python_m_kernelforge_tune_show(cache):
    out = subprocess.run([sys.executable, "-m", "kernelforge", "tune", "--show"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "KERNELFORGE_CACHE_DIR": str(cache.parent)})
    assert out.returncode == 0, out.stderr
    assert f"tuning cache: {cache}" in out.stdout


# ----------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@needs_cuda
def test_a_measurement_on_the_gpu_is_reused_by_another_process(cache):
    shapes = [(256, 512, 256), (4096, 1024, 512)]
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        kf.gemm(a, b)
        assert "  measured: " in kf.explain("gemm", a, b, compute="bf16")  # Triton, cuBLAS, CUDA: three candidates
    entries = _file(cache)["contexts"][tuning.context_of(torch.device("cuda"))]["entries"]
    assert len([key for key in entries if key.startswith("gemm ")]) == 2
    code = textwrap.dedent(f"""
        import torch, kernelforge as kf
        from kernelforge import tuning
        def refuse(*args):
            raise SystemExit("measured again")
        tuning.measure = refuse
        for m, k, n in {shapes!r}:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
            kf.gemm(a, b)
            print(kf.explain("gemm", a, b, compute="bf16"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "KERNELFORGE_CACHE_DIR": str(cache.parent)})
    assert out.returncode == 0, out.stderr + out.stdout
    assert out.stdout.count("  measured: ") == 2
