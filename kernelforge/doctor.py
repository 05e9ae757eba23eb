"""`kernelforge doctor`: the toolchain check users run first.

Prints the versions that matter (Python, torch and its CUDA, Triton, nvcc, ninja), the
GPUs, whether backends are measured (and the measurements' cache file), whether each CUDA
extension builds and loads and whether a Triton kernel runs, then one line of verdict.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import time
from typing import Callable, TextIO

import torch


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _nvcc_version() -> str:
    from torch.utils.cpp_extension import CUDA_HOME

    candidates = ([f"{CUDA_HOME}/bin/nvcc"] if CUDA_HOME else []) + [shutil.which("nvcc") or ""]
    for nvcc in filter(None, candidates):
        try:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
        except OSError:
            continue
        release = [line for line in out.splitlines() if "release" in line]
        return f"{release[0].split('release')[-1].strip()} ({nvcc})" if release else out.strip()
    return "not found"


def _check(label: str, fn: Callable[[], str], out: TextIO) -> bool:
    t0 = time.perf_counter()
    try:
        detail = fn()
        out.write(f"  {label:<22} ok ({detail}, {time.perf_counter() - t0:.1f} s)\n")
        return True
    except Exception as err:  # the doctor reports every failure, whatever its type
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        out.write(f"  {label:<22} FAILED: {first}\n")
        return False


def _triton_smoke() -> str:
    from kernelforge.triton.softmax import softmax_forward_rows

    x = torch.randn(64, 1000, device="cuda")
    torch.testing.assert_close(softmax_forward_rows(x, False), torch.softmax(x, -1))
    return "softmax kernel compiled, ran and matched torch"


def _extension_smoke(name: str) -> Callable[[], str]:
    def run() -> str:
        from kernelforge.cuda.compiler import AOT_LOADED, get_cuda_compiler

        compiler = get_cuda_compiler()
        compiler.load(name)
        status = compiler.aot_status.get(name)
        if status == AOT_LOADED:
            return f"{AOT_LOADED}, from {compiler.aot_dir}"
        return f"JIT, cached in {compiler.cache_dir} (ahead of time: {status})"

    return run


def _tuning_state(n_gpus: int) -> str:
    """Whether backends are measured (kernelforge.tuning), the cache file, and its entries for gpu 0."""
    from kernelforge import tuning

    state = "on" if tuning.enabled() else f"off ({tuning.ENV_VAR}={os.environ.get(tuning.ENV_VAR)!r})"
    if not n_gpus:
        return f"{state}, on CUDA devices only; cache {tuning.cache_path()}"
    count = len(tuning.entries(tuning.context_of(torch.device("cuda", 0))))
    return f"{state}; cache {tuning.cache_path()}: {count} entries for gpu 0 and these versions"


def run_doctor(out: TextIO) -> int:
    from kernelforge.cuda.compiler import EXTENSIONS, why_toolchain_unavailable

    out.write("kernelforge doctor\n")
    out.write(f"  python                 {platform.python_version()} ({platform.platform()})\n")
    out.write(f"  torch                  {torch.__version__} (CUDA {torch.version.cuda or 'none: CPU build'})\n")
    out.write(f"  triton                 {_version('triton')}\n")
    out.write(f"  nvcc                   {_nvcc_version()}\n")
    out.write(f"  ninja                  {shutil.which('ninja') or 'not found'}\n")
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i in range(n_gpus):
        p = torch.cuda.get_device_properties(i)
        out.write(f"  gpu {i}                  {p.name}, compute capability {p.major}.{p.minor}, "
                  f"{p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs\n")
    if not n_gpus:
        out.write("  gpu                    none visible\n")
    out.write(f"  measured choice        {_tuning_state(n_gpus)}\n")

    toolchain = why_toolchain_unavailable()
    problems = []
    if n_gpus:
        if _version("triton") == "not installed":
            problems.append("Triton is not installed")
        elif not _check("triton kernels", _triton_smoke, out):
            problems.append("Triton kernels fail")
        if toolchain is not None:
            out.write(f"  cuda extensions        cannot build: {toolchain}\n")
            problems.append(f"CUDA extensions cannot build ({toolchain})")
        for name in EXTENSIONS if toolchain is None else ():
            if not _check(f"cuda extension {name}", _extension_smoke(name), out):
                problems.append(f"CUDA extension {name} fails")

    if not n_gpus:
        verdict = ("CPU ONLY: kernelforge runs its reference implementations here "
                   "(Triton kernels run only through TRITON_INTERPRET=1; CUDA kernels need a GPU).")
        code = 0
    elif problems:
        verdict = "PROBLEM: " + "; ".join(problems) + ". The ops fall back to the backends that work."
        code = 1
    else:
        verdict = "READY: every backend (Triton, CUDA, reference) builds and runs on this machine."
        code = 0
    out.write(f"verdict: {verdict}\n")
    return code


def run_build(out: TextIO) -> int:
    """`kernelforge build`: build every CUDA extension now, so no first call pays for it."""
    from kernelforge.cuda.compiler import EXTENSIONS, why_toolchain_unavailable

    reason = why_toolchain_unavailable()
    if reason is not None:
        out.write(f"kernelforge build: cannot build CUDA extensions here: {reason}\n")
        return 1
    ok = all([_check(f"cuda extension {name}", _extension_smoke(name), out) for name in EXTENSIONS])
    return 0 if ok else 1
