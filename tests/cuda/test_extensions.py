"""How the CUDA extensions are found and built ahead of time (kernelforge/cuda/extensions.py,
setup.py), and when the loader takes an ahead-of-time library instead of a JIT build."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernelforge.cuda.compiler import EXTENSIONS, CUDACompiler
from kernelforge.cuda.extensions import CSRC, Extension, aot_mismatch, aot_record, arch_covers, discover, parse_archs
from tests.conftest import needs_cuda

ROOT = Path(__file__).resolve().parents[2]


def test_extensions_are_found_by_the_naming_convention(tmp_path):
    assert EXTENSIONS == discover()
    assert EXTENSIONS["norms"].sources == ("norms_backward.cu", "norms_forward.cu", "norms_binding.cpp")
    assert set(EXTENSIONS) == {"activations", "attention", "convrnn", "gemm", "norms", "softmax"}
    for name in ("softmax_cuda.cu", "softmax_binding.cpp", "row_common.cuh"):
        shutil.copy(CSRC / name, tmp_path / name)
    # a second extension whose name extends the first: its kernel file is its own
    (tmp_path / "softmax_ce_binding.cpp").write_text("// binding\n")
    (tmp_path / "softmax_ce_cuda.cu").write_text("// kernel\n")
    (tmp_path / "orphan_cuda.cu").write_text("// no binding: not an extension\n")
    assert discover(tmp_path) == {
        "softmax": Extension("softmax", ("softmax_cuda.cu", "softmax_binding.cpp")),
        "softmax_ce": Extension("softmax_ce", ("softmax_ce_cuda.cu", "softmax_ce_binding.cpp")),
    }


@pytest.mark.parametrize("text,expected", [
    ("9.0", "9.0"), ("sm_90", "9.0"), ("90a", "9.0a"), ("sm_100, 8.0;9.0+PTX", "8.0;9.0+PTX;10.0"),
    ("9.0 9.0 sm_90", "9.0"),
])
def test_architectures_are_read_in_every_spelling(text, expected):
    assert parse_archs(text) == expected


@pytest.mark.parametrize("text,message", [("hopper", "cannot read architecture 'hopper'"), (" ; ", "names no")])
def test_unreadable_architectures_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        parse_archs(text)


@pytest.mark.parametrize("archs,capability,runs", [
    ("9.0", (9, 0), True), ("8.0", (8, 6), True), ("8.6", (8, 0), False), ("8.0;9.0", (10, 0), False),
    ("8.0+PTX", (10, 0), True), ("9.0a", (9, 0), True), ("9.0a", (10, 0), False), ("10.0", (9, 0), False),
])
def test_which_builds_run_on_which_gpu(archs, capability, runs):
    assert arch_covers(archs, capability) is runs


def test_visible_gpus_give_one_architecture_each(monkeypatch):
    from kernelforge.cuda.extensions import arch_list, visible_capabilities

    caps = {0: (9, 0), 1: (8, 0), 2: (9, 0)}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    assert visible_capabilities(torch) == [(8, 0), (9, 0)]
    assert arch_list(visible_capabilities(torch)) == "8.0;9.0"


def _record(**changes):
    ext = EXTENSIONS["softmax"]
    base = aot_record(ext, "9.0", ["-O3"], ["-O3", "-lineinfo"], "2.11.0", "13.0", "3.12")
    return {**base, **changes}


def test_an_ahead_of_time_build_is_used_only_if_everything_still_holds():
    expected = _record(archs="")
    assert aot_mismatch(_record(), expected, (9, 0)) is None
    assert aot_mismatch(None, expected, (9, 0)) == "not built ahead of time"
    assert "unreadable" in aot_mismatch({"unreadable": "x.json: bad"}, expected, (9, 0))
    for key, value, words in (("digest", "0" * 64, "the sources changed"),
                              ("device_flags", ["-O3"], "the compile flags differ"),
                              ("torch", "2.13.0", "torch is another version"),
                              ("cuda", "12.8", "torch's CUDA is another version"),
                              ("python", "3.11", "Python is another version")):
        why = aot_mismatch(_record(**{key: value}), expected, (9, 0))
        assert why is not None and why.startswith(words), (key, why)
    assert "does not run on compute capability 10.0" in aot_mismatch(_record(), expected, (10, 0))


def test_editing_a_source_invalidates_the_record(tmp_path):
    for name in os.listdir(CSRC):
        shutil.copy(CSRC / name, tmp_path / name)
    ext = EXTENSIONS["convrnn"]
    before = aot_record(ext, "9.0", [], [], "t", "c", "p", tmp_path)
    (tmp_path / "convrnn_cuda.cu").write_text((tmp_path / "convrnn_cuda.cu").read_text() + "\n// edit\n")
    assert aot_record(ext, "9.0", [], [], "t", "c", "p", tmp_path)["digest"] != before["digest"]


def _pretend_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))


def test_the_loader_says_why_it_builds_jit(monkeypatch, tmp_path):
    _pretend_gpu(monkeypatch)
    ext = EXTENSIONS["softmax"]
    comp = CUDACompiler(aot_dir=tmp_path)
    assert comp._load_ahead_of_time(ext) is None
    assert comp.aot_status["softmax"] == "not built ahead of time"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    record = aot_record(ext, "9.0", comp.cflags, comp.cuda_cflags, torch.__version__, "13.0", python)
    (tmp_path / "softmax.json").write_text(json.dumps({**record, "torch": "1.0"}))
    assert comp._load_ahead_of_time(ext) is None
    assert comp.aot_status["softmax"].startswith("torch is another version since the ahead-of-time build")
    (tmp_path / "softmax.json").write_text(json.dumps(record))
    assert comp._load_ahead_of_time(ext) is None
    assert "no library softmax.<abi>.so" in comp.aot_status["softmax"]
    monkeypatch.setenv("KERNELFORGE_DEBUG", "1")  # a debug process does not take an optimized build
    debug = CUDACompiler(aot_dir=tmp_path)
    assert debug._load_ahead_of_time(ext) is None
    assert debug.aot_status["softmax"].startswith("the compile flags differ")
    other = CUDACompiler(source_dir=tmp_path, aot_dir=tmp_path)
    assert other._load_ahead_of_time(ext) is None
    assert other.aot_status["softmax"] == "ahead-of-time builds are off for this compiler"


def _setup_module():
    spec = importlib.util.spec_from_file_location("kernelforge_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: setup() does not run
    return module


def test_a_plain_install_compiles_nothing(monkeypatch):
    monkeypatch.delenv("KERNELFORGE_BUILD_CUDA", raising=False)
    assert _setup_module().cuda_build_options() == {}
    monkeypatch.setenv("KERNELFORGE_BUILD_CUDA", "0")
    assert _setup_module().cuda_build_options() == {}


def test_an_ahead_of_time_build_names_what_it_cannot_do(monkeypatch):
    setup = _setup_module()
    monkeypatch.setenv("KERNELFORGE_BUILD_CUDA", "softmax,nope")
    with pytest.raises(SystemExit, match=r"no extension named \['nope'\]"):
        setup.cuda_build_options()
    if torch.version.cuda is None:
        monkeypatch.setenv("KERNELFORGE_BUILD_CUDA", "1")
        with pytest.raises(SystemExit, match="is a CPU build"):
            setup.cuda_build_options()


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_cuda
def test_setup_builds_ahead_of_time_and_the_loader_prefers_it(tmp_path):
    # setup.py build_ext for one extension into a scratch build directory, then a fresh process
    # whose compiler looks there: it imports that library (no JIT build) and the op runs on it.
    env = dict(os.environ, KERNELFORGE_BUILD_CUDA="convrnn", KERNELFORGE_CACHE_DIR=str(tmp_path / "jit"))
    lib, temp = tmp_path / "lib", tmp_path / "temp"
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(lib), "--build-temp",
                            str(temp)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    aot_dir = lib / "kernelforge" / "cuda" / "_aot"
    record = json.loads((aot_dir / "convrnn.json").read_text())
    assert record["torch"] == torch.__version__ and record["digest"] == aot_record(
        EXTENSIONS["convrnn"], "", [], [], "", "", "")["digest"]
    code = f"""
import torch, kernelforge as kf
from kernelforge.cuda.compiler import AOT_LOADED, CUDACompiler
import kernelforge.cuda.compiler as c, kernelforge.cuda.convrnn as launcher
comp = CUDACompiler(aot_dir={str(aot_dir)!r})
launcher.get_cuda_compiler = lambda: comp  # the launcher loads the extension through this compiler
module = comp.load("convrnn")
assert comp.aot_status["convrnn"] == AOT_LOADED, comp.aot_status
assert module.__file__.startswith({str(aot_dir)!r}), module.__file__
x, h = torch.randn(2, 5, 9, device="cuda"), torch.randn(2, 9, device="cuda")
k = torch.randn(1, 1, 3, device="cuda") / 3
with kf.use_backend("cuda"):
    out, last = kf.convrnn(x, k, h)
ref, ref_last = kf.convrnn(x.cpu(), k.cpu(), h.cpu())
torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
assert not any((c.default_cache_dir().parent).glob("cuda/convrnn_*")), "built JIT too"
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-3000:]
