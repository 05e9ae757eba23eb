"""The examples run as a reader runs them, so none can rot: every script examples/NN_name.py at
its small default (`python examples/NN_name.py` from the checkout's root, in a fresh Python), and
every notebook examples/notebooks/NN_name.ipynb top to bottom in a Jupyter kernel of this Python
(nbclient, ipykernel). Both are found on disk, so a new example is tested without a change here;
an example that writes a file into the repository fails. examples/README.md lists each one.

Each example runs in a fresh copy of the checkout, its package imported from there (PYTHONPATH), so a
file it writes beside itself, into the package or into its working directory lands in the copy,
where it is found: the checkout itself stays untouched even by a failing example, and edits made to
the checkout while the tests run are not taken for an example's."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
NOTEBOOK_DIR = EXAMPLES / "notebooks"
SCRIPTS = sorted(EXAMPLES.glob("[0-9][0-9]_*.py"))
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
TIMEOUT_S = 600  # a whole example; each runs in seconds to tens of seconds on a 2-core CPU
# Examples whose run takes long on a 2-core CPU (compiling, subprocesses of pytest): the twin of
# each (its notebook or script, calling the same functions) stays in the quick run (-m "not slow").
SLOW = {"03_new_op.py", "04_optimization_levels.py"}
# Caches and environments that tools write on their own; anything else new or changed is an example's doing.
NOT_THE_REPOSITORY = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "build"}


def _marked(paths):
    return [pytest.param(p, id=p.name, marks=[pytest.mark.slow] if p.name in SLOW else []) for p in paths]


def _not_copied(directory: str, names: list[str]) -> list[str]:
    return [n for n in names if n in NOT_THE_REPOSITORY or n.endswith(".egg-info")]


def files_under(root: Path) -> dict[str, tuple[int, int]]:
    """{path relative to root: (size, mtime_ns)} of the files under root, caches left out."""
    files = {}
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in _not_copied(directory, subdirectories)]
        for name in names:
            path = Path(directory, name)
            stat = path.stat()
            files[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns)
    return files


class Checkout(NamedTuple):
    root: Path  # a copy of the checkout
    files: dict  # its files as copied, files_under(root)


@pytest.fixture
def checkout(tmp_path):
    """A copy of the checkout to run one example in (removed after: ~20 MB an example)."""
    copy = tmp_path / "checkout"
    shutil.copytree(ROOT, copy, ignore=_not_copied, symlinks=True)
    yield Checkout(copy, files_under(copy))
    shutil.rmtree(copy, ignore_errors=True)


def assert_nothing_written(checkout: Checkout, example: str) -> None:
    written = sorted(path for path, stamp in files_under(checkout.root).items() if checkout.files.get(path) != stamp)
    assert not written, f"{example} wrote into the repository: {written}"


def example_environment(copy: Path) -> dict:
    # kernelforge from the copy; Triton's interpreter for CPU tensors (chosen before Triton loads);
    # no __pycache__ beside the examples (a notebook imports its script); plots on matplotlib's file-only backend
    return dict(os.environ, PYTHONPATH=str(copy), TRITON_INTERPRET="1", PYTHONDONTWRITEBYTECODE="1",
                MPLBACKEND="Agg")


@pytest.mark.parametrize("script", _marked(SCRIPTS))
def test_script_runs_at_its_default(script, checkout):
    copy = checkout.root
    result = subprocess.run([sys.executable, str(script.relative_to(ROOT))], cwd=copy, env=example_environment(copy),
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{script.name} exited {result.returncode}:\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-5000:]}"
    assert result.stdout.strip(), f"{script.name} printed nothing"
    assert_nothing_written(checkout, script.name)


def this_python_kernel(kernel_dirs: Path):
    """A Jupyter kernel manager for ipykernel in this very Python (the venv's): a kernel spec of our
    own, so no other "python3" kernel registered on the machine (another Python, without torch) is
    picked."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    spec = kernel_dirs / "kernelforge-examples"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "kernelforge examples", "language": "python"}))
    specs = KernelSpecManager(kernel_dirs=[str(kernel_dirs)], ensure_native_kernel=False)
    return AsyncKernelManager(kernel_name="kernelforge-examples", kernel_spec_manager=specs)


@pytest.mark.parametrize("notebook", _marked(NOTEBOOKS))
def test_notebook_runs_top_to_bottom(notebook, checkout, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    copy = checkout.root
    nb = nbformat.read(notebook, as_version=4)
    # the kernel starts in the notebook's directory, as Jupyter and `jupyter nbconvert --execute` start it
    client = NotebookClient(nb, km=this_python_kernel(tmp_path / "kernels"), timeout=TIMEOUT_S,
                            resources={"metadata": {"path": str(copy / notebook.relative_to(ROOT).parent)}})
    client.execute(env=example_environment(copy))  # raises CellExecutionError, with the cell and traceback
    errors = [o for cell in nb.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    assert_nothing_written(checkout, notebook.name)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(notebook):
    # outputs hold this machine's paths and timings, and make every rerun a diff
    cells = json.loads(notebook.read_text())["cells"]
    assert not [c for c in cells if c["cell_type"] == "code" and (c["outputs"] or c["execution_count"])]


def test_the_readme_lists_every_example():
    readme = (EXAMPLES / "README.md").read_text()
    missing = [str(p.relative_to(EXAMPLES)) for p in SCRIPTS + NOTEBOOKS if str(p.relative_to(EXAMPLES)) not in readme]
    assert not missing, f"examples/README.md does not list {missing}"


def test_every_notebook_narrates_a_script():
    scripts = {p.stem for p in SCRIPTS}
    assert NOTEBOOKS and all(p.stem in scripts for p in NOTEBOOKS), [p.name for p in NOTEBOOKS]
