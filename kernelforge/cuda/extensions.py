"""The CUDA extensions the package ships, and how each is built: shared by the JIT compiler
(kernelforge/cuda/compiler.py) and the ahead-of-time build (setup.py), so both produce the
same binary from the same flags. Standard library only: setup.py imports this file by path
before torch is known to be importable.

An extension is found by a naming convention, not listed by hand: `csrc/<name>_binding.cpp`
(the thin torch binding) makes extension <name>, whose kernel files are `csrc/<name>_*.cu`
(plain CUDA). So an op added with `kernelforge new-op` is built, cached, prebuilt by
`kernelforge build` and compiled ahead of time with no registry to edit.

Environment:
    KERNELFORGE_DEBUG=1          compile with -g (host) and -g -lineinfo (device)
    KERNELFORGE_CUDA_ARCHS       architectures of an ahead-of-time build ("9.0", "8.0;9.0",
                                 "sm_90,sm_100"); default: the GPUs visible at build time
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

CSRC = Path(__file__).resolve().parent / "csrc"
# Where the ahead-of-time build puts the libraries (kernelforge.cuda._aot.<name>) and, next to
# each, <name>.json: what it was built from (see aot_record).
AOT_DIR = Path(__file__).resolve().parent / "_aot"
AOT_PACKAGE = "kernelforge.cuda._aot"
HEADER_SUFFIXES = (".h", ".cuh")
BINDING_SUFFIX = "_binding.cpp"
DEBUG_ENV = "KERNELFORGE_DEBUG"
ARCHS_ENV = "KERNELFORGE_CUDA_ARCHS"
BUILD_ENV = "KERNELFORGE_BUILD_CUDA"


@dataclass(frozen=True)
class Extension:
    """One loadable module: its sources (file names in csrc/), kernel files first, binding last."""

    name: str
    sources: tuple[str, ...]


def discover(source_dir: Path = CSRC) -> dict[str, Extension]:
    """Every extension in `source_dir` by the naming convention (module docstring). A kernel file
    whose name fits two extensions ("softmax_ce_cuda.cu" with both softmax and softmax_ce)
    belongs to the longer name."""
    names = sorted((p.name[: -len(BINDING_SUFFIX)] for p in source_dir.glob("*" + BINDING_SUFFIX)),
                   key=lambda n: (-len(n), n))
    claimed: set[str] = set()
    found = {}
    for name in names:
        kernels = sorted(p.name for p in source_dir.glob(f"{name}_*.cu") if p.name not in claimed)
        claimed.update(kernels)
        found[name] = Extension(name, (*kernels, name + BINDING_SUFFIX))
    return dict(sorted(found.items()))


def debug_requested(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(DEBUG_ENV) == "1"


def compile_flags(debug: bool, extra_cuda_cflags=()) -> tuple[list[str], list[str]]:
    """(host flags, nvcc flags): -O3 C++17, and -g / -g -lineinfo for a debug build."""
    host = ["-O3", "-std=c++17"] + (["-g"] if debug else [])
    device = ["-O3", "-std=c++17"] + (["-g", "-lineinfo"] if debug else []) + list(extra_cuda_cflags)
    return host, device


def parse_archs(text: str) -> str:
    """KERNELFORGE_CUDA_ARCHS as TORCH_CUDA_ARCH_LIST spells it: "sm_90, 8.0;100a" -> "8.0;9.0;10.0a".
    Entries are separated by commas, semicolons or spaces; each is major.minor, sm_XY or XY, with
    an optional suffix (a, f, +PTX)."""
    archs = []
    for entry in filter(None, re.split(r"[,;\s]+", text.strip())):
        m = re.fullmatch(r"(?:sm_|compute_)?(\d+)\.?(\d)([af]?)(\+PTX)?", entry, flags=re.IGNORECASE)
        if m is None:
            raise ValueError(f"{ARCHS_ENV}: cannot read architecture {entry!r}; expected e.g. 9.0, sm_90 or 90a")
        major, minor, suffix, ptx = m.groups()
        arch = f"{int(major)}.{minor}{suffix.lower()}" + ("+PTX" if ptx else "")
        if arch not in archs:
            archs.append(arch)
    if not archs:
        raise ValueError(f"{ARCHS_ENV} is set but names no architecture: {text!r}")
    return ";".join(sorted(archs, key=lambda a: tuple(int(x) for x in re.findall(r"\d+", a))))


def visible_capabilities(torch) -> list[tuple[int, int]]:
    """The distinct compute capabilities of the visible GPUs, ascending (torch passed in: this
    module imports nothing outside the standard library)."""
    return sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})


def arch_list(capabilities) -> str:
    """Compute capabilities as TORCH_CUDA_ARCH_LIST spells them: [(8, 0), (9, 0)] -> "8.0;9.0"."""
    return ";".join(f"{major}.{minor}" for major, minor in capabilities)


def arch_covers(archs: str, capability: tuple[int, int]) -> bool:
    """Whether a library built for `archs` (a TORCH_CUDA_ARCH_LIST) runs on a GPU of `capability`:
    cubins run on their own major version at an equal or higher minor; PTX (+PTX) is compiled by
    the driver for any newer GPU. Arch-specific targets (9.0a) run only on their own GPU."""
    for arch in archs.split(";"):
        m = re.fullmatch(r"(\d+)\.(\d)([af]?)(\+PTX)?", arch.strip())
        if m is None:
            continue
        major, minor, suffix, ptx = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        if suffix == "a" and (major, minor) != capability:
            continue
        if ptx and capability >= (major, minor):
            return True
        if capability[0] == major and capability[1] >= minor:
            return True
    return False


def source_digest(sources, source_dir: Path = CSRC) -> str:
    """sha256 of `sources` (paths) and of every header in source_dir (a header edit must rebuild
    every extension that might include it)."""
    h = hashlib.sha256()
    headers = sorted(p for p in source_dir.iterdir() if p.suffix in HEADER_SUFFIXES)
    for p in list(sources) + headers:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def aot_record(ext: Extension, archs: str, host_flags, device_flags, torch_version: str,
               cuda_version: Optional[str], python_version: str, source_dir: Path = CSRC) -> dict:
    """What an ahead-of-time library was built from; the loader uses it only if all of it still
    holds (same sources, flags, torch, CUDA and Python, and an architecture that runs here)."""
    digest = source_digest([source_dir / s for s in ext.sources], source_dir)
    return {"name": ext.name, "sources": list(ext.sources), "digest": digest,
            "archs": archs, "host_flags": list(host_flags), "device_flags": list(device_flags),
            "torch": torch_version, "cuda": cuda_version, "python": python_version}


def read_aot_record(name: str, aot_dir: Path = AOT_DIR) -> Optional[dict]:
    path = aot_dir / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        return {"unreadable": f"{path}: {err}"}


def aot_mismatch(record: Optional[dict], expected: dict, capability: tuple[int, int]) -> Optional[str]:
    """None when the ahead-of-time library described by `record` may be loaded instead of a JIT
    build that would be made from `expected` (an aot_record of this process), else why not."""
    if record is None:
        return "not built ahead of time"
    if "unreadable" in record:
        return f"its build record is unreadable ({record['unreadable']})"
    for key, what in (("digest", "the sources changed"), ("host_flags", "the compile flags differ"),
                      ("device_flags", "the compile flags differ"), ("torch", "torch is another version"),
                      ("cuda", "torch's CUDA is another version"), ("python", "Python is another version")):
        if record.get(key) != expected[key]:
            return f"{what} since the ahead-of-time build ({key}: built {record.get(key)!r}, now {expected[key]!r})"
    if not arch_covers(record.get("archs", ""), capability):
        return (f"it was built for {record.get('archs')!r}, which does not run on compute capability "
                f"{capability[0]}.{capability[1]}")
    return None
