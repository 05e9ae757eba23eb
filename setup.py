"""Packaging (metadata in pyproject.toml). By default `pip install .` compiles nothing: the CUDA
extensions are built on first use (JIT) and cached. With KERNELFORGE_BUILD_CUDA=1 every
extension (kernelforge/cuda/extensions.py finds them) is compiled now (or only those named:
KERNELFORGE_BUILD_CUDA=softmax,convrnn), into
kernelforge/cuda/_aot/, and the loader prefers those libraries to a JIT build:

    KERNELFORGE_BUILD_CUDA=1 pip install --no-build-isolation .     # or -e . for a checkout
    KERNELFORGE_CUDA_ARCHS="8.0;9.0"   architectures (default: the GPUs visible now)
    KERNELFORGE_DEBUG=1                adds -g (host) and -g -lineinfo (device)

--no-build-isolation: the build compiles against the torch already installed. An isolated
build would install the newest torch from the index (a multi-gigabyte CUDA build, perhaps not
the one you run), so torch is deliberately not a build requirement.
"""
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _extensions_module():
    # By path: importing the kernelforge package would import torch, which a plain install
    # must not need.
    spec = importlib.util.spec_from_file_location("_kernelforge_extensions", ROOT / "kernelforge/cuda/extensions.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _archs(exts, torch) -> str:
    text = os.environ.get(exts.ARCHS_ENV)
    if text:
        return exts.parse_archs(text)
    if not torch.cuda.is_available():
        raise SystemExit(f"{exts.BUILD_ENV}=1: no GPU is visible to pick architectures from; set "
                         f"{exts.ARCHS_ENV} (e.g. {exts.ARCHS_ENV}=9.0 for H100/H200)")
    return exts.arch_list(exts.visible_capabilities(torch))


def _wanted(exts, request: str) -> dict:
    found = exts.discover()
    if request in ("1", "all"):
        return found
    names = [n for n in request.replace(",", " ").split() if n]
    unknown = sorted(set(names) - set(found))
    if unknown:
        raise SystemExit(f"{exts.BUILD_ENV}={request!r}: no extension named {unknown}; expected 1, all, or names "
                         f"from {sorted(found)}")
    return {n: found[n] for n in names}


def cuda_build_options() -> dict:
    """setup() keywords: nothing unless KERNELFORGE_BUILD_CUDA is 1 or all (every extension) or
    a comma-separated list of extension names."""
    exts = _extensions_module()
    request = os.environ.get(exts.BUILD_ENV, "0").strip()
    if request in ("", "0"):
        return {}
    found = _wanted(exts, request)
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError as err:
        raise SystemExit(f"{exts.BUILD_ENV}=1 compiles against the installed torch, which did not import ({err}). "
                         "Install a CUDA build of torch first, then: pip install --no-build-isolation .") from None
    if torch.version.cuda is None:
        raise SystemExit(f"{exts.BUILD_ENV}=1: this torch ({torch.__version__}) is a CPU build; the CUDA extensions "
                         "need a CUDA build of torch")
    archs = _archs(exts, torch)
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs  # read by BuildExtension when it compiles
    host, device = exts.compile_flags(exts.debug_requested())
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    csrc = exts.CSRC.relative_to(ROOT)
    modules = [
        CUDAExtension(f"{exts.AOT_PACKAGE}.{ext.name}", [str(csrc / s) for s in ext.sources],
                      include_dirs=[str(exts.CSRC)], extra_compile_args={"cxx": host, "nvcc": device})
        for ext in found.values()
    ]

    class BuildWithRecords(BuildExtension):
        """Writes <name>.json next to each library: what it was built from (the loader checks it)."""

        def _record_path(self, ext, directory: Path) -> Path:
            return directory / (ext.name.rsplit(".", 1)[1] + ".json")

        def build_extension(self, ext):
            super().build_extension(ext)
            record = exts.aot_record(found[ext.name.rsplit(".", 1)[1]], archs, host, device, torch.__version__,
                                     torch.version.cuda, python)
            path = self._record_path(ext, Path(self.get_ext_fullpath(ext.name)).parent)
            path.write_text(exts.json.dumps(record, indent=1) + "\n")

        def copy_extensions_to_source(self):  # --inplace and editable installs: the records too
            super().copy_extensions_to_source()
            for ext in self.extensions:
                built = Path(self.build_lib) / Path(self.get_ext_filename(self.get_ext_fullname(ext.name))).parent
                shutil.copyfile(self._record_path(ext, built), self._record_path(ext, exts.AOT_DIR))

    return {"ext_modules": modules, "cmdclass": {"build_ext": BuildWithRecords}}


if __name__ == "__main__":  # also under pip: setuptools' build backend runs this file as __main__
    setup(**cuda_build_options())
