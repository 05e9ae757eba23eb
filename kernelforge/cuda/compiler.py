"""JIT builds of the CUDA extensions, cached by source hash, and the loader that prefers an
ahead-of-time build.

Each extension is a plain-CUDA kernel file (no torch headers: compiles anywhere nvcc
exists) plus a thin binding file that talks to torch; kernelforge/cuda/extensions.py finds
them (csrc/<name>_binding.cpp + csrc/<name>_*.cu) and holds the flags. `CUDACompiler.load`
first looks for a library built ahead of time (`KERNELFORGE_BUILD_CUDA=1 pip install`, see
setup.py) in kernelforge/cuda/_aot/ and uses it when its build record matches this process
(sources, flags, torch, CUDA, Python, an architecture that runs on the visible GPUs).
Otherwise it builds with `torch.utils.cpp_extension.load` (ninja, -O3, architectures from
TORCH_CUDA_ARCH_LIST or the visible GPUs) into a directory named by a hash of everything
that affects the binary, so a second process imports the built library directly and does
not even run ninja. `aot_status` says, per extension, which way it was loaded and why.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Iterable, Optional, Sequence

import torch

from kernelforge._eager_plans import recording
from kernelforge.cuda.extensions import (
    AOT_DIR, AOT_PACKAGE, CSRC, Extension, aot_mismatch, aot_record, arch_list, compile_flags, debug_requested,
    discover, read_aot_record, source_digest, visible_capabilities,
)

CACHE_ENV = "KERNELFORGE_CACHE_DIR"
AOT_LOADED = "ahead-of-time build"

# Every extension the package ships (by the csrc/ naming convention); `kernelforge build`
# prebuilds all of them. Loading convrnn registers torch.ops.kernelforge.convrnn_cuda_* from C++.
EXTENSIONS: dict[str, Extension] = discover()


@functools.lru_cache(maxsize=None)
def _limits_of(index: int) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), int(getattr(props, "shared_memory_per_block_optin", 0))


def device_limits(device: torch.device) -> tuple[tuple[int, int], int]:
    """(compute capability, shared memory a block may opt into, 0 if unknown) of a CUDA device,
    cached: the launchers' support checks ask on every call."""
    return _limits_of(device.index if device.index is not None else torch.cuda.current_device())


class CUDABuildError(RuntimeError):
    """An extension failed to build; the message carries the compiler's output."""


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kernelforge"
    )
    return Path(root) / "cuda"


def visible_arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST if set, else the compute capabilities of the visible GPUs
    ("9.0" on an H100), so nothing is compiled for GPUs that are not here."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return env
    if not torch.cuda.is_available():
        raise CUDABuildError("no CUDA GPU is visible and TORCH_CUDA_ARCH_LIST is not set: no architecture to build for")
    return arch_list(visible_capabilities(torch))


@functools.lru_cache(maxsize=None)
def why_toolchain_unavailable() -> Optional[str]:
    """None when CUDA extensions can be built and run here, else the reason (checked once
    per process: backend selection asks on every call)."""
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return "no CUDA toolkit found (nvcc); set CUDA_HOME"
    return None


@contextlib.contextmanager
def _env(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _import_library(module_name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(module_name, str(path))
    spec = importlib.util.spec_from_file_location(module_name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[module_name] = module
    return module


class CUDACompiler:
    """Builds and loads CUDA extensions from a source directory into a hashed cache."""

    def __init__(
        self,
        source_dir: Path | str = CSRC,
        cache_dir: Path | str | None = None,
        extra_cuda_cflags: Sequence[str] = (),
        verbose: bool = False,
        aot_dir: Path | str | None = AOT_DIR,
    ):
        self.source_dir = Path(source_dir)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.verbose = verbose
        # None: never load ahead-of-time builds (they are built from the package's csrc/ only)
        self.aot_dir = Path(aot_dir) if aot_dir is not None else None
        self.cflags, self.cuda_cflags = compile_flags(debug_requested(), extra_cuda_cflags)
        # extension name -> AOT_LOADED, or why it was built JIT instead (for `kernelforge doctor`)
        self.aot_status: dict[str, str] = {}
        self._loaded: dict[str, ModuleType] = {}
        self._by_extension: dict[str, ModuleType] = {}
        self._lock = threading.Lock()
        # name -> first line of the error of a build that failed in this process, so the
        # backend registry stops choosing that extension instead of failing every call.
        self.failures: dict[str, str] = {}

    # -- public API ------------------------------------------------------------------
    def compile_from_file(self, filename: str, name: Optional[str] = None) -> ModuleType:
        """Build the extension whose kernel file is `filename` (e.g. "softmax_cuda.cu"),
        together with its binding file, as a module named after `name`."""
        for ext in EXTENSIONS.values():
            if filename in ext.sources:
                return self.compile(name or ext.name, ext.sources)
        known = sorted(s for e in EXTENSIONS.values() for s in e.sources)
        raise FileNotFoundError(f"{filename!r} is not a source of any kernelforge extension; known: {known}")

    def load(self, extension: str) -> ModuleType:
        """The module of a named extension (see EXTENSIONS), built on first use.

        This is on every kernel call's path, so after the first call it is one dict lookup
        (sources are hashed once per process; edit them and restart to rebuild). An eager plan's
        recording (kernelforge._eager_plans) learns of it: an extension's launches cannot be replayed."""
        plan_recording = recording()
        if plan_recording is not None:
            plan_recording.fail(f"it calls the CUDA extension {extension!r}")
        module = self._by_extension.get(extension)
        if module is not None:
            return module
        try:
            ext = EXTENSIONS[extension]
        except KeyError:
            raise KeyError(f"unknown CUDA extension {extension!r}; known: {sorted(EXTENSIONS)}") from None
        module = self._load_ahead_of_time(ext)
        if module is None:
            module = self.compile(ext.name, ext.sources)
        self._by_extension[extension] = module
        return module

    def ready(self, extension: str) -> bool:
        """Whether loading `extension` needs no build: loaded in this process, or its library is in
        the JIT cache (an ahead-of-time build counts once loaded). Hashes the sources: not for a
        kernel call's path (kernelforge.tuning asks before timing a CUDA candidate)."""
        if extension in self._by_extension:
            return True
        ext = EXTENSIONS.get(extension)
        if ext is None:
            return False
        try:
            archs = visible_arch_list()
        except CUDABuildError:  # no GPU and no TORCH_CUDA_ARCH_LIST: nothing could be built or loaded
            return False
        module_name = f"{ext.name}_{self.cache_key([self.source_dir / s for s in ext.sources], archs)[:16]}"
        return module_name in self._loaded or (self.cache_dir / module_name / f"{module_name}.so").is_file()

    def _load_ahead_of_time(self, ext: Extension) -> Optional[ModuleType]:
        """The ahead-of-time library of `ext` if its record matches this process, else None (and
        the reason in aot_status)."""
        if self.aot_dir is None or self.source_dir != CSRC:
            self.aot_status[ext.name] = "ahead-of-time builds are off for this compiler"
            return None
        if torch.version.cuda is None or not torch.cuda.is_available():
            self.aot_status[ext.name] = "no CUDA GPU is visible"
            return None
        python = f"{sys.version_info.major}.{sys.version_info.minor}"
        expected = aot_record(ext, "", self.cflags, self.cuda_cflags, torch.__version__, torch.version.cuda, python,
                              self.source_dir)
        record = read_aot_record(ext.name, self.aot_dir)
        why = next(filter(None, (aot_mismatch(record, expected, cap) for cap in visible_capabilities(torch))), None)
        suffixes = importlib.machinery.EXTENSION_SUFFIXES
        libraries = [p for suffix in suffixes for p in self.aot_dir.glob(ext.name + suffix)]
        if why is None and not libraries:
            why = f"its build record exists but no library {ext.name}.<abi>.so is in {self.aot_dir}"
        if why is not None:
            self.aot_status[ext.name] = why
            return None
        with self._lock:
            module = _import_library(f"{AOT_PACKAGE}.{ext.name}", libraries[0])
        self.aot_status[ext.name] = AOT_LOADED
        return module

    def compile(self, name: str, sources: Iterable[str]) -> ModuleType:
        """Build (or load from the cache) a module from `sources`, file names in source_dir."""
        paths = [self.source_dir / s for s in sources]
        for p in paths:
            if not p.is_file():
                raise FileNotFoundError(f"CUDA source {p} does not exist")
        archs = visible_arch_list()
        key = self.cache_key(paths, archs)
        module_name = f"{name}_{key[:16]}"
        with self._lock:
            if module_name in self._loaded:
                return self._loaded[module_name]
            build_dir = self.cache_dir / module_name
            library = build_dir / f"{module_name}.so"
            if library.is_file():
                module = _import_library(module_name, library)
            else:
                try:
                    module = self._build(module_name, paths, build_dir, archs)
                except CUDABuildError as err:
                    self.failures[name] = str(err).splitlines()[0]
                    from kernelforge.backends import forget_choices

                    forget_choices()  # cached choices may name this extension
                    raise
            self._loaded[module_name] = module
            return module

    def cache_key(self, paths: Sequence[Path], archs: str) -> str:
        h = hashlib.sha256(source_digest(paths, self.source_dir).encode())
        for part in (
            archs, " ".join(self.cflags), " ".join(self.cuda_cflags), torch.__version__,
            str(torch.version.cuda), sys.version.split()[0],
        ):
            h.update(b"\0" + part.encode())
        return h.hexdigest()

    # -- building --------------------------------------------------------------------
    def _build(self, module_name: str, paths: Sequence[Path], build_dir: Path, archs: str) -> ModuleType:
        reason = why_toolchain_unavailable()
        if reason is not None:
            raise CUDABuildError(f"cannot build CUDA extension {module_name}: {reason}")
        from torch.utils.cpp_extension import load

        build_dir.mkdir(parents=True, exist_ok=True)
        try:
            with _env(TORCH_CUDA_ARCH_LIST=archs):
                return load(
                    name=module_name,
                    sources=[str(p) for p in paths],
                    extra_cflags=self.cflags,
                    extra_cuda_cflags=self.cuda_cflags,
                    extra_include_paths=[str(self.source_dir)],
                    build_directory=str(build_dir),
                    verbose=self.verbose,
                )
        except Exception as err:  # torch raises RuntimeError with ninja's output
            raise CUDABuildError(f"building CUDA extension {module_name} in {build_dir} failed:\n{err}") from err


@functools.lru_cache(maxsize=None)
def get_cuda_compiler() -> CUDACompiler:
    """The process-wide compiler (default source and cache directories)."""
    return CUDACompiler()
