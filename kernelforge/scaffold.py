"""`kernelforge new-op NAME`: write the files a new op needs, in the project's layout, from the
templates in kernelforge/templates/ (valid Python, C++ and CUDA themselves, with the op called
my_op; the name is substituted).

What comes out is a working elementwise op y = f(x) with its backward, on three backends
(reference, Triton, CUDA registered from C++), with its tests and benchmark script; only the
math is missing. Each math site is marked TODO(new-op): the reference raises
NotImplementedError there and the kernels return NaN, so every accuracy test fails until the
math is written, and passes after (docs/adding_an_op.md walks through it).
"""
from __future__ import annotations

import keyword
import re
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"
PLACEHOLDER = "my_op"
# template -> where its copy goes, relative to the project root ({name}: the op's name)
FILES = (
    ("reference_template.py", "kernelforge/reference/{name}.py"),
    ("triton_template.py", "kernelforge/triton/{name}.py"),
    ("kernel_template.h", "kernelforge/cuda/csrc/{name}_cuda.h"),
    ("kernel_template.cu", "kernelforge/cuda/csrc/{name}_cuda.cu"),
    ("binding_template.cpp", "kernelforge/cuda/csrc/{name}_binding.cpp"),
    ("cuda_template.py", "kernelforge/cuda/{name}.py"),
    ("ops_template.py", "kernelforge/ops/{name}.py"),
    ("op_test_template.py", "tests/ops/test_{name}.py"),
    ("bench_template.py", "benchmarks/bench_{name}.py"),
)


class ScaffoldError(ValueError):
    """The op cannot be written as asked (bad name, files in the way, no project here)."""


def project_root() -> Path:
    """The source checkout kernelforge is imported from (where pyproject.toml and tests/ are)."""
    return Path(__file__).resolve().parent.parent


def _check_name(name: str) -> None:
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name) or name.endswith("_"):
        raise ScaffoldError(f"op name must be a lower-case Python identifier such as fused_gelu (letters, digits, "
                            f"underscores, starting with a letter, not a keyword), got {name!r}")
    import kernelforge.ops  # noqa: F401  (registers every op)
    from kernelforge import backends

    try:
        backends.implementations(name)
    except KeyError:
        return
    raise ScaffoldError(f"an op named {name!r} is already registered (kernelforge.ops)")


def render(text: str, name: str) -> str:
    return text.replace(PLACEHOLDER, name)


CHECKOUT_PARTS = ("pyproject.toml", "kernelforge", "tests/conftest.py", "tests/numerics.py")


def plan(name: str, root: Path) -> list[tuple[Path, Path]]:
    """(template, destination) pairs for `name` under `root`."""
    return [(TEMPLATES / template, root / dest.format(name=name)) for template, dest in FILES]


def new_op(name: str, root: Path | str | None = None, force: bool = False) -> list[Path]:
    """Write the op's files under `root` (default: this checkout) and return their paths.
    Refuses to overwrite unless `force`."""
    _check_name(name)
    root = Path(root) if root is not None else project_root()
    # what the written files need beside them: the package, and the tests' helpers the generated
    # test imports (tests/conftest.py's backend cases, tests/numerics.py's error model)
    missing = [part for part in CHECKOUT_PARTS if not (root / part).exists()]
    if missing:
        raise ScaffoldError(f"{root} is not a kernelforge source checkout (no {', '.join(missing)} there); "
                            "pass --root with the checkout to write into")
    pairs = plan(name, root)
    existing = [str(dest) for _, dest in pairs if dest.exists()]
    if existing and not force:
        raise ScaffoldError(f"refusing to overwrite {', '.join(existing)} (pass --force to replace them)")
    for template, dest in pairs:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(render(template.read_text(), name))
    return [dest for _, dest in pairs]


def next_steps(name: str, written: list[Path], root: Path) -> str:
    files = "\n".join(f"  {p.relative_to(root)}" for p in written)
    return f"""wrote the op {name!r}:
{files}
next:
  1. write the math at each TODO(new-op) (grep -n "TODO(new-op)" on the files above): the reference
     first, then the Triton and CUDA kernels with the same formulas
  2. run its tests: TRITON_INTERPRET=1 python -m pytest tests/ops/test_{name}.py   (GPU: add -m gpu)
  3. export it if it is public: `from kernelforge.ops.{name} import {name}` in kernelforge/__init__.py
  4. measure: python benchmarks/bench_{name}.py, and order the backends in kernelforge/ops/{name}.py
     (_preference) by what you measured
the CUDA extension {name!r} needs no registration: kernelforge/cuda/extensions.py finds
csrc/{name}_binding.cpp (docs/adding_an_op.md)
"""
