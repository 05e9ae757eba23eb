"""Triton kernels, one module per op family. Importing this package does not import Triton."""
from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """Triton runs kernels on the CPU through its interpreter when TRITON_INTERPRET=1
    is set before Triton is imported (how the CPU test suite runs our kernels)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def why_unavailable(device: torch.device):
    """None when Triton kernels can run on tensors of `device`, else the reason."""
    if not _triton_installed():
        return "Triton is not installed"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        return None if interpreter_enabled() else "Triton runs CPU tensors only with TRITON_INTERPRET=1"
    return f"Triton kernels do not run on {device.type} tensors"
