"""The documentation holds together: every relative link in the README, docs/, examples/ and the
benchmarks' READMEs (the results index included)
resolves to a file of the repository (and a #section to a heading of it), and nothing in the
repository points at documents outside it."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "notes").glob("*.md")),
         *sorted((ROOT / "examples").glob("*.md")), ROOT / "benchmarks" / "README.md",
         *sorted((ROOT / "benchmarks" / "results").rglob("README.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Phrases that point outside the repository: the planning documents the project started from.
OUTSIDE = re.compile(r"design documents?|TARGETS\.md|DESIGN\.md|\.\./shared/", re.IGNORECASE)


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to '-'."""
    anchors = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def links(page: Path):
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code:
            yield from LINK.findall(line)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.relative_to(ROOT)})")
        elif not resolved.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_nothing_points_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    if not tracked:
        pytest.fail("git ls-files listed nothing: run from a checkout")
    text_files = [f for f in tracked if f.endswith((".py", ".md", ".cu", ".cuh", ".h", ".cpp", ".sh", ".toml", ".txt",
                                                     ".yml", ".yaml", ".ipynb")) or f in ("Makefile", "Dockerfile")]
    found = []
    for name in text_files:
        if name == "tests/test_docs.py" or not (ROOT / name).exists():  # the phrases' own list; a file being removed
            continue
        for number, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not found, "references to documents outside the repository:\n" + "\n".join(found)
