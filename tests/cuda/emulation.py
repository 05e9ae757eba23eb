"""Building a CPU emulation of a CUDA extension's kernel: the extension's sources with the
warp-level instructions they use (mma, ldmatrix, cp.async) swapped for their emulation
(attention_emu/attention_mma.cuh), driven by a test's emulate.cpp. Shared by the attention and
GEMM kernel tests."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kernelforge.cuda.compiler import CSRC

MMA_EMULATION = Path(__file__).resolve().parent / "attention_emu" / "attention_mma.cuh"


def cuda_include() -> Path | None:
    """A CUDA toolkit include directory (for cuda_fp16.h / cuda_bf16.h), or None."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    roots.append("/usr/local/cuda")
    for root in filter(None, roots):
        if (Path(root) / "include" / "cuda_bf16.h").is_file():
            return Path(root) / "include"
    return None


def build_emulator(tmp_path_factory, driver_dir: Path) -> Path:
    """The executable of driver_dir/emulate.cpp (with emu_driver.h, next to driver_dir) over a
    copy of the extension sources with the emulated instructions (skips the test where no C++20 compiler or CUDA headers exist)."""
    cxx, include = shutil.which("g++") or shutil.which("c++"), cuda_include()
    if cxx is None or include is None:
        pytest.skip("the kernel emulation needs a C++20 compiler and the CUDA headers (cuda_bf16.h)")
    work = tmp_path_factory.mktemp(driver_dir.name)
    src = work / "csrc"
    shutil.copytree(CSRC, src)
    shutil.copy(MMA_EMULATION, src / "attention_mma.cuh")  # the emulated instructions
    exe = work / "emulate"
    result = subprocess.run(
        [cxx, "-std=c++20", "-O2", "-fno-strict-aliasing", f"-I{src}", f"-I{include}", f"-I{driver_dir.parent}",
         str(driver_dir / "emulate.cpp"),
         "-o", str(exe)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    return exe
