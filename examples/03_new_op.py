"""Writing a new op with `kernelforge new-op`: from the scaffold to a tested reference and Triton kernel.

`kernelforge new-op NAME` writes everything an op needs (the PyTorch reference, Triton kernels,
CUDA kernels and their registration, the op with autograd and backend choice, its tests and a
benchmark script) with TODO(new-op) markers where the math goes. This example does it for
softplus, y = log(1 + exp(x)), in a scratch copy of the checkout in a temporary directory, so
running it leaves nothing in the repository:

  1. scaffold the op (the command line's own code, `kernelforge new-op softplus --root SCRATCH`)
  2. list the TODO(new-op) sites, and run the generated tests: they fail, the math is missing
  3. write the math: the reference first, then the same formulas in the Triton (and CUDA) kernels
  4. run the generated tests again (they pass), and call the new op on each backend

    python examples/03_new_op.py               # a few generated tests, ~20 s on a CPU
    python examples/03_new_op.py --all-tests   # all of them (torch.compile's too)
    python examples/03_new_op.py --keep        # keep the scratch checkout to look at
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kernelforge.cli import main as kernelforge_command
from kernelforge.scaffold import plan, project_root

CHECKOUT = project_root()

# softplus at each TODO(new-op) site: (file, the placeholder statement's start, the math written in).
# The same formulas three times: PyTorch (the definition and CPU path), Triton, CUDA.
SOFTPLUS_MATH = [
    ("kernelforge/reference/{name}.py", "raise NotImplementedError(\"TODO(new-op): {name}'s forward math",
     "return torch.clamp(x, min=0) + torch.log1p(torch.exp(-x.abs()))  # log(1 + e^x), no overflow"),
    ("kernelforge/reference/{name}.py", "raise NotImplementedError(\"TODO(new-op): {name}'s backward math",
     "return grad_y * torch.sigmoid(x)  # d/dx log(1 + e^x) = sigmoid(x)"),
    ("kernelforge/triton/{name}.py", 'return x * float("nan")',
     "return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))"),
    ("kernelforge/triton/{name}.py", 'return x * grad_y * float("nan")', "return grad_y * tl.sigmoid(x)"),
    ("kernelforge/cuda/csrc/{name}_cuda.cu", "return x * CUDART_NAN_F;",
     "return fmaxf(x, 0.f) + log1pf(expf(-fabsf(x)));"),
    ("kernelforge/cuda/csrc/{name}_cuda.cu", "return x * grad_y * CUDART_NAN_F;", "return grad_y / (1.f + expf(-x));"),
]


def scratch_checkout(parent: Path) -> Path:
    """What `new-op` and the generated tests need of a checkout: the package, pyproject.toml and
    the test suite's shared helpers (its fixtures and the tolerance rule), none of the tests."""
    root = parent / "checkout"
    shutil.copytree(CHECKOUT / "kernelforge", root / "kernelforge",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (root / "tests" / "ops").mkdir(parents=True)
    for helper in ("__init__.py", "conftest.py", "numerics.py", "ops/__init__.py"):
        shutil.copy(CHECKOUT / "tests" / helper, root / "tests" / helper)
    shutil.copy(CHECKOUT / "pyproject.toml", root / "pyproject.toml")
    return root


def scaffold(root: Path, name: str) -> None:
    """`kernelforge new-op NAME --root ROOT`, run in this process; it prints what it wrote and what next."""
    status = kernelforge_command(["new-op", name, "--root", str(root)])
    if status != 0:
        raise RuntimeError(f"kernelforge new-op {name} failed ({status})")


def todo_sites(root: Path, name: str) -> list[str]:
    """`grep -n "TODO(new-op)"` over the files new-op wrote: where the math goes, and what it should be."""
    sites = []
    for _, path in plan(name, root):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "TODO(new-op)" in line:
                sites.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return sites


def _environment(root: Path) -> dict:
    # the scratch copy first on the path: it, not the installed kernelforge, has the new op;
    # Triton kernels on CPU tensors through Triton's interpreter; no __pycache__ left behind
    return dict(os.environ, PYTHONPATH=str(root), TRITON_INTERPRET="1", PYTHONDONTWRITEBYTECODE="1")


def run_generated_tests(root: Path, name: str, select: str | None = None) -> tuple[int, str]:
    """pytest on tests/ops/test_NAME.py in the scratch checkout (-k `select`); (exit status, its last lines)."""
    command = [sys.executable, "-m", "pytest", "-q", "--color=no", "-p", "no:cacheprovider", "-m", "not gpu",
               "-o", "addopts=", "-W", "ignore::RuntimeWarning", f"tests/ops/test_{name}.py"]
    command += ["-k", select] if select else []
    result = subprocess.run(command, cwd=root, env=_environment(root), capture_output=True, text=True, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    interesting = [line for line in lines if "Error" in line and "TODO(new-op)" in line][:1] + lines[-2:]
    return result.returncode, "\n".join(interesting)


def write_math(root: Path, name: str, sites=SOFTPLUS_MATH) -> None:
    """Replace each placeholder statement (with its continuation lines) by the math, keeping its
    indent, and drop the TODO comment above it."""
    for relative, start, math in sites:
        path = root / relative.format(name=name)
        lines = path.read_text().splitlines(keepends=True)
        start = start.format(name=name)
        (first,) = [i for i, line in enumerate(lines) if line.lstrip().startswith(start)]
        end = first + 1
        while lines[first].count("(") > sum(line.count(")") for line in lines[first:end]):
            end += 1  # a call spread over several lines ends where its parentheses balance
        indent = lines[first][:len(lines[first]) - len(lines[first].lstrip())]
        lines[first:end] = [indent + math + "\n"]
        if "TODO(new-op)" in lines[first - 1] and lines[first - 1].lstrip().startswith(("#", "//")):
            del lines[first - 1]  # the kernels' note of what goes here: done
        path.write_text("".join(lines))
        print(f"  {path.relative_to(root)}: {math}")


USE_THE_OP = """
import torch, torch.nn.functional as F, kernelforge as kf
from kernelforge.ops.{name} import {name}
x = torch.randn(3, 1000, requires_grad=True)
print(kf.explain("{name}", x))
for backend in ("reference", "triton"):
    with kf.use_backend(backend):
        y = {name}(x)
        (dx,) = torch.autograd.grad(y.sum(), x)
    (expected_dx,) = torch.autograd.grad(F.softplus(x).sum(), x)
    torch.testing.assert_close(y, F.softplus(x))
    torch.testing.assert_close(dx, expected_dx)
    print(f"{{backend}}: {name}(x) and its gradient match F.softplus")
print("registered as torch.ops.kernelforge.{name}:", torch.ops.kernelforge.{name}.default._schema)
"""


def use_the_op(root: Path, name: str) -> str:
    """Import the new op from the scratch checkout (in a fresh Python) and check it against torch."""
    result = subprocess.run([sys.executable, "-c", USE_THE_OP.format(name=name)], cwd=root, env=_environment(root),
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return result.stdout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="softplus",
                        help="the op's name (default softplus; the math written in is softplus's)")
    parser.add_argument("--all-tests", action="store_true",
                        help="run every generated test (torch.compile's takes longer)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch checkout and print where it is")
    args = parser.parse_args(argv)

    scratch = Path(tempfile.mkdtemp(prefix="kernelforge-new-op-"))
    try:
        root = scratch_checkout(scratch)
        print(f"1. kernelforge new-op {args.name} --root {root}\n")
        scaffold(root, args.name)
        print("\n2. the math is missing at:")
        print("\n".join("  " + site for site in todo_sites(root, args.name)))
        status, summary = run_generated_tests(root, args.name, select="forward_matches_oracle and reference")
        print(f"\n   the generated forward test, before the math (exit {status}):\n{summary}")
        assert status == 1, "the generated tests should fail until the math is written"

        print("\n3. the math:")
        write_math(root, args.name)
        select = None if args.all_tests else "not compiled"
        status, summary = run_generated_tests(root, args.name, select)
        print(f"\n4. the generated tests{'' if args.all_tests else ' (all but torch.compile)'}, "
              f"after the math (exit {status}):\n{summary}")
        assert status == 0, "the generated tests should pass once the math is written"
        print(use_the_op(root, args.name))
    finally:
        if args.keep:
            print(f"the scratch checkout: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
