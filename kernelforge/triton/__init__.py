"""Triton kernels, one module per op family. Importing this package does not import Triton."""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os

import torch


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def _triton_version_problem():
    """Why the installed Triton is too old for the kernels, or None (read from its metadata,
    without importing it)."""
    from kernelforge._versions import triton_problem

    try:
        return triton_problem(importlib.metadata.version("triton"))
    except importlib.metadata.PackageNotFoundError:  # a source build without metadata: trust it
        return None


def interpreter_enabled() -> bool:
    """Triton runs kernels on the CPU through its interpreter when TRITON_INTERPRET=1
    is set before Triton is imported (how the CPU test suite runs our kernels)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def why_unavailable(device: torch.device):
    """None when Triton kernels can run on tensors of `device`, else the reason."""
    if not _triton_installed():
        return "Triton is not installed"
    if _triton_version_problem():
        return _triton_version_problem()
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        return None if interpreter_enabled() else "Triton runs CPU tensors only with TRITON_INTERPRET=1"
    return f"Triton kernels do not run on {device.type} tensors"
