"""The command line, end to end on this machine."""
import subprocess
import sys

import pytest
import torch

from kernelforge.cli import main


def test_doctor_reports_versions_and_a_verdict(capsys):
    code = main(["doctor"])
    out = capsys.readouterr().out
    for needle in ("torch ", "triton ", "nvcc ", "python "):
        assert needle in out
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("verdict: ") and verdict.split(": ")[1].split(":")[0] in ("READY", "CPU ONLY", "PROBLEM")
    assert code == (1 if "PROBLEM" in verdict else 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_build_without_gpu_fails_clearly(capsys):
    assert main(["build"]) == 1
    assert "cannot build CUDA extensions here:" in capsys.readouterr().out


def test_demo_checks_and_times(capsys):
    assert main(["demo", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "kernelforge[reference]" in out and "torch eager" in out
    assert "all results match the float64 reference" in out
    rows = [line for line in out.splitlines() if " ok " in line]
    assert len(rows) >= 4 and all(float(r.split()[-1]) > 0 for r in rows)


def test_console_entry_point():
    out = subprocess.run([sys.executable, "-m", "kernelforge.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "doctor" in out.stdout and "demo" in out.stdout
