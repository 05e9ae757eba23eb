"""The oldest torch and Triton kernelforge runs with: refused by name, not somewhere inside a kernel."""
import subprocess
import sys

import pytest
import torch

import kernelforge.triton as kf_triton
from kernelforge._versions import release, torch_problem, triton_problem


def test_release_reads_major_and_minor():
    assert release("2.13.0+cpu") == (2, 13)
    assert release("2.11.0a0+git1234abc") == (2, 11)
    assert release("3.9.0") == (3, 9)
    with pytest.raises(ValueError, match="not a version"):
        release("main")


def test_tested_versions_pass_and_older_ones_are_named():
    for version in ("2.11.0", "2.11.0a0+gitabc", "2.13.0+cpu", "2.15.0", "3.0.0"):
        assert torch_problem(version) is None, version
    message = torch_problem("2.10.1")
    assert "torch >= 2.11" in message and "found torch 2.10.1" in message
    for version in ("3.6.0", "3.9.0", "4.0.0"):
        assert triton_problem(version) is None, version
    assert "Triton 3.5.1 is older than 3.6" in triton_problem("3.5.1")


def test_an_older_torch_is_refused_at_import():
    code = "import torch; torch.__version__ = '2.10.0'; import kernelforge"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0
    assert "ImportError: kernelforge needs torch >= 2.11" in done.stderr and "found torch 2.10.0" in done.stderr


def test_an_older_triton_leaves_the_triton_backend_unavailable(monkeypatch):
    monkeypatch.setattr(kf_triton, "_triton_version_problem", lambda: triton_problem("3.5.0"))
    assert kf_triton.why_unavailable(torch.device("cuda")).startswith("Triton 3.5.0 is older than 3.6")
