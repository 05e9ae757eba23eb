"""The oldest torch and Triton kernelforge is tested with, and the checks that name them.

Tested (README, "Compatibility"): torch 2.11 (GPU suite) and 2.13 (CPU suite); Triton 3.6 (both
suites) and 3.7.1 / 3.8.0 / 3.9.0 (the CPU suite's Triton tests, under the interpreter). Older
releases lack pieces the ops rely on (torch.library's triton_op and register_autograd as used
here, Triton's interpreter fixes); rather than fail somewhere inside a kernel, kernelforge refuses
them by name: an older torch at import, an older Triton as a backend that is unavailable (the
reference still runs).
"""
from __future__ import annotations

import re
from typing import Optional

OLDEST_TORCH = (2, 11)
OLDEST_TRITON = (3, 6)


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "2.13.0+cpu" -> (2, 13), "2.11.0a0+git1234" -> (2, 11)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def torch_problem(version: str) -> Optional[str]:
    """Why this torch cannot run kernelforge, or None."""
    if release(version) < OLDEST_TORCH:
        return (f"kernelforge needs torch >= {'.'.join(map(str, OLDEST_TORCH))} (tested with 2.11 and 2.13), "
                f"found torch {version}: upgrade torch")
    return None


def triton_problem(version: str) -> Optional[str]:
    """Why kernelforge's Triton kernels cannot run with this Triton, or None."""
    if release(version) < OLDEST_TRITON:
        return (f"Triton {version} is older than {'.'.join(map(str, OLDEST_TRITON))}, the oldest kernelforge's "
                f"kernels are tested with: upgrade triton")
    return None
