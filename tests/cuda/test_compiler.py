"""The CUDA sources and the JIT compiler: .cu files compile with nvcc wherever it exists;
on a GPU the extensions build, cache by source hash, and load in a second process
without compiling."""
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kernelforge.cuda import compiler
from kernelforge.cuda.compiler import CSRC, EXTENSIONS, CUDABuildError, CUDACompiler
from tests.conftest import needs_cuda

NVCC = shutil.which("nvcc")
KERNEL_FILES = sorted(p.name for p in CSRC.glob("*.cu"))


def test_every_extension_source_exists():
    for ext in EXTENSIONS.values():
        for source in ext.sources:
            assert (CSRC / source).is_file(), f"{ext.name}: missing {source}"
    assert KERNEL_FILES, "no .cu files found"


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on the PATH")
@pytest.mark.parametrize("source", KERNEL_FILES)
def test_cu_file_compiles_for_sm90(source, tmp_path):
    # Kernel files are plain CUDA (no torch headers), so they compile on any machine with nvcc;
    # ptxas -v reports every kernel's stack frame and spills, which must be 0.
    result = subprocess.run(
        [NVCC, "-O3", "-std=c++17", "-arch=sm_90", "-Werror", "all-warnings", "-Xptxas", "-v", "-c",
         str(CSRC / source), "-o", str(tmp_path / "k.o")],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "k.o").stat().st_size > 0
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
    assert frames, "ptxas -v reported no functions"
    spilling = [f for f in frames if f[1] != "0" or f[2] != "0"]
    assert not spilling, f"{len(spilling)} of {len(frames)} kernels spill: {spilling}"


def test_cache_key_follows_sources_flags_and_archs(tmp_path):
    for name in os.listdir(CSRC):
        shutil.copy(CSRC / name, tmp_path / name)
    comp = CUDACompiler(source_dir=tmp_path, cache_dir=tmp_path / "cache")
    paths = [tmp_path / s for s in EXTENSIONS["softmax"].sources]
    key = comp.cache_key(paths, "9.0")
    assert comp.cache_key(paths, "9.0") == key
    assert comp.cache_key(paths, "8.0;9.0") != key
    assert CUDACompiler(source_dir=tmp_path, extra_cuda_cflags=["-DX=1"]).cache_key(paths, "9.0") != key
    header = next(tmp_path.glob("*.h"))
    header.write_text(header.read_text() + "\n// touched\n")
    assert comp.cache_key(paths, "9.0") != key, "editing a header must invalidate the cache"


def test_unknown_sources_are_rejected_clearly():
    comp = CUDACompiler()
    with pytest.raises(FileNotFoundError, match=r"'nope\.cu' is not a source of any kernelforge extension"):
        comp.compile_from_file("nope.cu", "x")
    with pytest.raises(KeyError, match=r"unknown CUDA extension 'nope'"):
        comp.load("nope")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_build_without_gpu_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    with pytest.raises(CUDABuildError, match=r"cannot build CUDA extension softmax_\w+: (this torch build|no CUDA GPU)"):
        CUDACompiler(cache_dir=tmp_path).load("softmax")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    with pytest.raises(CUDABuildError, match="TORCH_CUDA_ARCH_LIST is not set"):
        compiler.visible_arch_list()


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_cuda
def test_seed_api_compile_from_file_and_softmax_op():
    from kernelforge.cuda import SoftMaxOp, get_cuda_compiler, get_cuda_softmax

    module = get_cuda_compiler().compile_from_file("softmax_cuda.cu", "my_softmax")
    op = SoftMaxOp(module)
    x = torch.randn(2, 4, 8, device="cuda")
    y = op.forward(x)
    torch.testing.assert_close(y, torch.softmax(x, -1))
    g = torch.randn_like(y)
    expected = torch.ops.aten._softmax_backward_data(g, y, -1, x.dtype)
    torch.testing.assert_close(op.backward(g, y), expected)
    default = get_cuda_softmax()
    torch.testing.assert_close(default.forward(x), y)
    torch.testing.assert_close(get_cuda_softmax(log=True).forward(x), torch.log_softmax(x, -1))


@pytest.mark.gpu
@needs_cuda
def test_second_process_compiles_nothing(tmp_path):
    # First process builds into a fresh cache; a second one must import the library
    # straight from it (no ninja, no nvcc): fast, and the library file is untouched.
    env = dict(os.environ, KERNELFORGE_CACHE_DIR=str(tmp_path))
    code = ("import time, torch; t=time.perf_counter(); "
            "from kernelforge.cuda.compiler import get_cuda_compiler as g; g().load('softmax'); "
            "print(time.perf_counter()-t)")
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr
    (library,) = list(Path(tmp_path).glob("cuda/*/*.so"))
    mtime = library.stat().st_mtime_ns
    time.sleep(0.05)
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert library.stat().st_mtime_ns == mtime
    assert float(second.stdout.strip()) < 2.0, f"second load took {second.stdout.strip()} s"
    assert float(second.stdout.strip()) < float(first.stdout.strip())


def test_a_failed_build_is_reported_so_selection_falls_back(monkeypatch):
    # After an extension fails to build, why_unavailable names it, so the backend registry
    # stops choosing it (instead of failing every call).
    import kernelforge.cuda as kcuda
    from kernelforge.cuda.compiler import get_cuda_compiler

    monkeypatch.setattr(compiler, "why_toolchain_unavailable", lambda: None)
    monkeypatch.setitem(get_cuda_compiler().failures, "softmax", "nvcc exploded")
    assert kcuda.why_unavailable() is None
    assert kcuda.why_unavailable("softmax") == "the softmax extension failed to build: nvcc exploded"
