"""The command line, end to end on this machine."""
import json
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
    # the test suite turns measurement off (tests/conftest.py): the line says so, and where the cache is
    assert "measured choice        off (KERNELFORGE_TUNING='0')" in out and "tuning.json" in out
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("verdict: ") and verdict.split(": ")[1].split(":")[0] in ("READY", "CPU ONLY", "PROBLEM")
    assert code == (1 if "PROBLEM" in verdict else 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_build_without_gpu_fails_clearly(capsys):
    assert main(["build"]) == 1
    assert "cannot build CUDA extensions here:" in capsys.readouterr().out


def test_demo_checks_times_and_plots(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the triton level must say it needs a GPU here
    out_dir = tmp_path / "demo"
    assert main(["demo", "--device", "cpu", "--levels", "native,torchscript,reference,triton,cuda", "--repeat", "1",
                 "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "every level that ran matches the reference" in out
    for workload in ("LM forward", "LM train step", "ViT forward", "GNN forward"):
        rows = [line for line in out.splitlines() if line.startswith(f"| {workload} ")]
        assert [r.split("|")[2].strip() for r in rows] == ["native", "torchscript", "reference", "triton", "cuda"]
        assert all(" ok " in r and float(r.split("|")[6]) > 0 for r in rows[:3])
        assert "not run: the triton level runs Triton kernels: Triton runs CPU tensors only with TRITON_INTERPRET=1" \
            in rows[3]
        assert "not run: the cuda level runs kernelforge's CUDA C++ kernels, which need a CUDA GPU" in rows[4]
    ran = json.loads((out_dir / "demo.json").read_text())["rows"]
    reference = [r for r in ran if r["level"] == "reference"]
    assert all(any(k.endswith(":reference") for k in r["backends"]) for r in reference)  # kernelforge ops ran
    assert {p.name for p in out_dir.iterdir()} == {"demo.md", "demo.json", "demo.png"}
    assert (out_dir / "demo.png").read_bytes()[:4] == b"\x89PNG"


def test_demo_refuses_unknown_levels_and_workloads(capsys):
    assert main(["demo", "--workloads", "lm-forward,lm-backward"]) == 2
    assert "unknown workload(s) ['lm backward']" in capsys.readouterr().err
    assert main(["demo", "--levels", "native,fast"]) == 2
    assert "unknown level(s) ['fast']" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["kernelforge.cli", "kernelforge"])
def test_console_entry_point(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "doctor" in out.stdout and "demo" in out.stdout
    # an unknown command fails with argparse's exit status, through python -m as through the script
    bad = subprocess.run([sys.executable, "-m", module, "no-such-command"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
