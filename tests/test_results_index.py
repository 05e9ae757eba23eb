"""benchmarks/results/ keeps the layout its index describes: <gpu>/<release>/<area>/<folder>/, every
folder listed in benchmarks/results/README.md, and the index naming only folders that exist.
Pure file checks (no GPU)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "README.md"
VERSION = re.compile(r"\d+\.\d+\.\d+([.-]?[0-9A-Za-z.]+)?")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def layout_problems(results: Path) -> tuple[list[str], set[str]]:
    """What sits outside the layout, and the result folders (gpu/release/area/folder) found."""
    problems, folders = [], set()
    for gpu in sorted(results.iterdir()):
        if gpu.name == "README.md":
            continue
        if not gpu.is_dir() or not gpu.name.startswith("nvidia-"):
            problems.append(f"{gpu.relative_to(results)}: not a <gpu> folder")
            continue
        for release in sorted(gpu.iterdir()):
            if not release.is_dir() or not VERSION.fullmatch(release.name):
                problems.append(f"{release.relative_to(results)}: not a <release> folder (a version string)")
                continue
            for area in sorted(release.iterdir()):
                if not area.is_dir():
                    problems.append(f"{area.relative_to(results)}: a file where an <area> folder belongs")
                    continue
                for entry in sorted(area.iterdir()):
                    if entry.is_dir():
                        folders.add(entry.relative_to(results).as_posix())
                    elif entry.name != "README.md":
                        problems.append(f"{entry.relative_to(results)}: a file outside a result folder")
    return problems, folders


def indexed_folders(index_text: str) -> set[str]:
    """The folders the index links to: gpu/release/area/folder/ (area READMEs are not folders)."""
    return {target.rstrip("/") for target in LINK.findall(index_text)
            if not target.endswith(".md") and not re.match(r"[a-z]+:", target) and not target.startswith("../")}


def index_problems(results: Path) -> list[str]:
    problems, folders = layout_problems(results)
    index = results / "README.md"
    if not index.exists():
        return problems + ["README.md: the index is missing"]
    text = index.read_text()
    listed = indexed_folders(text)
    for name in sorted(listed - folders):
        if (results / name).is_dir() and len(Path(name).parts) != 4:
            problems.append(f"index names {name}: not a <gpu>/<release>/<area>/<folder> path")
        else:
            problems.append(f"index names {name}, which does not exist")
    for name in sorted(folders - listed):
        problems.append(f"{name}: missing from the index")
    for target in LINK.findall(text):
        path = target.partition("#")[0]
        if path and not re.match(r"[a-z]+:", path) and not (results / path).exists():
            problems.append(f"index link {target} does not resolve")
    return problems


def test_results_follow_the_layout_and_the_index_lists_them():
    problems = index_problems(RESULTS)
    assert not problems, "benchmarks/results/:\n" + "\n".join(problems)


def test_every_release_is_a_version_string():
    releases = [r.name for gpu in RESULTS.iterdir() if gpu.is_dir() for r in gpu.iterdir()]
    assert releases and all(VERSION.fullmatch(r) for r in releases), releases


@pytest.mark.parametrize("damage", ["unlisted", "missing", "release", "loose"])
def test_the_checks_find_what_they_look_for(tmp_path, damage):
    run = tmp_path / "nvidia-h200" / "0.1.0" / "gemm" / "abc1234-gemm"
    run.mkdir(parents=True)
    (run / "bench.md").write_text("rows\n")
    index = tmp_path / "README.md"
    index.write_text("| [gemm/abc1234-gemm](nvidia-h200/0.1.0/gemm/abc1234-gemm/) | gemm | abc1234 | current |\n")
    assert index_problems(tmp_path) == []
    if damage == "unlisted":
        (run.parent / "def5678-gemm").mkdir()
    elif damage == "missing":
        index.write_text(index.read_text() + "| [gemm/gone](nvidia-h200/0.1.0/gemm/gone/) | x | y | history |\n")
    elif damage == "release":
        (tmp_path / "nvidia-h200" / "latest" / "gemm").mkdir(parents=True)
    else:
        (tmp_path / "nvidia-h200" / "bench.md").write_text("loose\n")
    assert index_problems(tmp_path)
