"""`kernelforge new-op`: the scaffold writes an op whose tests fail until its math is written
and pass after (shown here on softplus, written into a scratch copy of the checkout), whose
CUDA kernel file compiles, and which refuses bad names and overwrites."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernelforge.scaffold import FILES, ScaffoldError, new_op, project_root, render

ROOT = project_root()
NVCC = shutil.which("nvcc")

# The math of softplus at every TODO(new-op) site: (file, placeholder line, its replacement).
SOFTPLUS = [
    ("kernelforge/reference/{name}.py", '    raise NotImplementedError("TODO(new-op): {name}\'s forward math',
     "    return torch.clamp(x, min=0) + torch.log1p(torch.exp(-x.abs()))\n"),
    ("kernelforge/reference/{name}.py", '    raise NotImplementedError("TODO(new-op): {name}\'s backward math',
     "    return grad_y * torch.sigmoid(x)\n"),
    ("kernelforge/triton/{name}.py", '    return x * float("nan")',
     "    return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))\n"),
    ("kernelforge/triton/{name}.py", '    return x * grad_y * float("nan")', "    return grad_y * tl.sigmoid(x)\n"),
    ("kernelforge/cuda/csrc/{name}_cuda.cu", "  return x * CUDART_NAN_F;",
     "  return fmaxf(x, 0.f) + log1pf(expf(-fabsf(x)));\n"),
    ("kernelforge/cuda/csrc/{name}_cuda.cu", "  return x * grad_y * CUDART_NAN_F;",
     "  return grad_y / (1.f + expf(-x));\n"),
]


def fill_in(root: Path, name: str, sites=SOFTPLUS) -> None:
    """Replace each placeholder statement (and the continuation lines of a multi-line one)."""
    for rel, start, replacement in sites:
        path = root / rel.format(name=name)
        lines = path.read_text().splitlines(keepends=True)
        start = start.format(name=name)
        (i,) = [k for k, line in enumerate(lines) if line.startswith(start)]
        end = i + 1
        while lines[i].count("(") > sum(lines[k].count(")") for k in range(i, end)):
            end += 1
        lines[i:end] = [replacement]
        path.write_text("".join(lines))


def _checkout_copy(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "kernelforge", root / "kernelforge", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (root / "tests").mkdir()
    for name in ("__init__.py", "conftest.py", "numerics.py"):
        shutil.copy(ROOT / "tests" / name, root / "tests" / name)
    shutil.copytree(ROOT / "tests" / "ops", root / "tests" / "ops", ignore=lambda d, names: [
        n for n in names if n.startswith("test_")])
    for name in ("pyproject.toml", "setup.py"):
        shutil.copy(ROOT / name, root / name)
    return root


def _pytest(root: Path, test_file: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root), TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
                           "-o", "addopts=", test_file], cwd=root, env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow
def test_a_new_op_fails_until_its_math_is_written_then_passes(tmp_path):
    root = _checkout_copy(tmp_path)
    written = new_op("softplus_demo", root)
    assert [p.relative_to(root).as_posix() for p in written] == [dest.format(name="softplus_demo")
                                                                  for _, dest in FILES]
    before = _pytest(root, "tests/ops/test_softplus_demo.py")
    assert before.returncode == 1, before.stdout[-3000:]
    assert "NotImplementedError: TODO(new-op)" in before.stdout
    fill_in(root, "softplus_demo")
    assert "TODO(new-op)" not in (root / "kernelforge/reference/softplus_demo.py").read_text().split('"""')[-1]
    after = _pytest(root, "tests/ops/test_softplus_demo.py")
    assert after.returncode == 0, after.stdout[-5000:] + after.stderr[-3000:]
    assert " passed" in after.stdout and "failed" not in after.stdout
    # the extension is found by its file names: nothing to register
    code = "from kernelforge.cuda.compiler import EXTENSIONS; print(EXTENSIONS['softplus_demo'].sources)"
    found = subprocess.run([sys.executable, "-c", code], cwd=root, env=dict(os.environ, PYTHONPATH=str(root)),
                           capture_output=True, text=True, timeout=300)
    assert found.stdout.strip() == "('softplus_demo_cuda.cu', 'softplus_demo_binding.cpp')", found.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on the PATH")
def test_the_kernel_template_compiles_before_and_after_the_math(tmp_path):
    root = _checkout_copy(tmp_path)
    new_op("softplus_demo", root)
    csrc = root / "kernelforge/cuda/csrc"
    for stage in ("template", "filled"):
        if stage == "filled":
            fill_in(root, "softplus_demo", [s for s in SOFTPLUS if s[0].endswith(".cu")])
        result = subprocess.run([NVCC, "-O3", "-std=c++17", "-arch=sm_90", "-Werror", "all-warnings", "-c",
                                 str(csrc / "softplus_demo_cuda.cu"), "-o", str(tmp_path / "k.o")],
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, (stage, result.stderr)


def test_the_templates_are_whole_files_with_the_placeholder():
    for template, _ in FILES:
        text = (ROOT / "kernelforge/templates" / template).read_text()
        assert "my_op" in text, template
        assert render(text, "fused_thing").count("fused_thing") == text.count("my_op")
    for math_site in ("reference_template.py", "triton_template.py", "kernel_template.cu"):
        assert "TODO(new-op)" in (ROOT / "kernelforge/templates" / math_site).read_text(), math_site


@pytest.mark.parametrize("name", ["Softplus", "1op", "class", "my-op", "x_", "softmax"])
def test_bad_names_are_refused(name, tmp_path):
    root = _checkout_copy(tmp_path)
    with pytest.raises(ScaffoldError, match="lower-case Python identifier|already registered"):
        new_op(name, root)


def test_it_refuses_to_overwrite_and_to_write_outside_a_checkout(tmp_path):
    root = _checkout_copy(tmp_path)
    new_op("twice", root)
    with pytest.raises(ScaffoldError, match="refusing to overwrite .*twice.py"):
        new_op("twice", root)
    assert new_op("twice", root, force=True)
    with pytest.raises(ScaffoldError, match="not a kernelforge source checkout"):
        new_op("elsewhere", tmp_path / "empty")
    (root / "tests" / "numerics.py").unlink()  # the generated test imports it
    with pytest.raises(ScaffoldError, match=r"no tests/numerics\.py there"):
        new_op("without_numerics", root)


def test_the_command_line_writes_and_says_what_next(tmp_path, capsys):
    from kernelforge.cli import main

    root = _checkout_copy(tmp_path)
    assert main(["new-op", "cli_op", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "tests/ops/test_cli_op.py" in out and "TODO(new-op)" in out
    assert main(["new-op", "cli_op", "--root", str(root)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
