"""The package's structure, read from its source (kernelforge/**.py in packages: the templates
of `kernelforge new-op` are not modules): no module imports another module's private name, the
modules' import-time imports form no cycle, and `import kernelforge` stays light."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional

PACKAGE = Path(__file__).resolve().parents[1] / "kernelforge"

# Private names one kernelforge module may take from another, as {(importer, "module.name"): why}.
# Empty: a helper shared across modules gets a public name (or a shared module).
ALLOWED_PRIVATE_IMPORTS: dict[tuple[str, str], str] = {}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a directory without __init__.py, as
    kernelforge/templates, holds no modules)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if not all((package.parent.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts))):
            continue
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _source_module(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute name `from ... import` reads from (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _import_time_nodes(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a module that run when it is imported: its body, into if / try / with /
    loop blocks and class bodies, not into functions (nor `if TYPE_CHECKING:`)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _import_time_nodes(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody"):
            yield from _import_time_nodes(getattr(node, field, []))
        for handler in getattr(node, "handlers", []):
            yield from _import_time_nodes(handler.body)


def _imports(module: str, path: Path, known: dict[str, Path], import_time_only: bool):
    """(line, module, name, local) of each kernelforge import: `import a.b` gives (a.b, None) with
    local None (it binds a), `import a.b as c` local c; `from a import b [as c]` gives (a.b, None)
    when a.b is a module, else (a, "b"), local c or b."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = _import_time_nodes(tree.body) if import_time_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kernelforge":
                    yield node.lineno, alias.name, None, alias.asname
        elif isinstance(node, ast.ImportFrom):
            source = _source_module(module, path, node)
            if source.split(".")[0] != "kernelforge":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in known:
                    yield node.lineno, sub, None, alias.asname or alias.name
                else:
                    yield node.lineno, source, alias.name, alias.asname or alias.name


def private_imports(package: Path = PACKAGE) -> list[str]:
    """`from kernelforge.x import _name` (a private name, not a private module) and
    `x._name` on a kernelforge module bound by an import, across modules, anywhere in a file."""
    known = modules(package)
    found = []
    for module, path in known.items():
        bound = {}  # local name -> the kernelforge module it names
        for line, target, name, local in _imports(module, path, known, import_time_only=False):
            where = f"{path.relative_to(package.parent)}:{line}"
            if name is None:
                if local is None:  # `import a.b.c` binds a
                    bound[target.split(".")[0]] = target.split(".")[0]
                else:
                    bound[local] = target
            elif _is_private(name) and target != module and (module, f"{target}.{name}") not in ALLOWED_PRIVATE_IMPORTS:
                found.append(f"{where}: from {target} import {name}")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            chain, base = [], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if not (isinstance(base, ast.Name) and base.id in bound):
                continue
            target = ".".join([bound[base.id], *reversed(chain)])
            if (target in known and target != module and f"{target}.{node.attr}" not in known
                    and (module, f"{target}.{node.attr}") not in ALLOWED_PRIVATE_IMPORTS):
                found.append(f"{path.relative_to(package.parent)}:{node.lineno}: {target}.{node.attr}")
    return found


def import_graph(package: Path = PACKAGE, import_time_only: bool = True) -> dict[str, set[str]]:
    """Module -> the kernelforge modules its import-time statements import (a parent package
    that Python imports first is not an edge unless named: it is running, or done, by then).
    With import_time_only=False, the imports inside functions too, less those of the module's
    own parent packages (imported before the module itself, so done by the time a function runs)."""
    known = modules(package)
    graph = {m: set() for m in known}
    for module, path in known.items():
        for _, target, _, _ in _imports(module, path, known, import_time_only):
            if target in known and target != module and (import_time_only or not module.startswith(target + ".")):
                graph[module].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> Optional[list[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_no_module_imports_a_private_name_of_another():
    assert private_imports() == []


def test_no_import_cycle_among_modules():
    graph = import_graph()
    assert "kernelforge.bench.suite_types" in graph["kernelforge.bench.attention_suites"]  # the graph sees edges
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_no_function_level_import_closes_a_cycle():
    # An import inside a function that closes a cycle of the import-time graph dodges it rather
    # than removing it: the shared names belong in a module both sides import (as
    # kernelforge.bench.suite_types for the suites, kernelforge.demo's own entry point).
    cycle = find_cycle(import_graph(import_time_only=False))
    assert cycle is None, " -> ".join(cycle)


def test_the_checks_find_what_they_look_for(tmp_path):
    # A planted package: a private import, a private attribute of a module, a cycle through a
    # `from package import submodule`, then one closed by an import inside a function (an edge of
    # the stricter graph only), and a package importing its module that imports from the package
    # inside a function (no cycle: the package is imported by the time the function runs).
    pkg = tmp_path / "kernelforge"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from kernelforge.sub import b\n\n\ndef f():\n    from kernelforge.c import g\n")
    (pkg / "sub" / "b.py").write_text("from kernelforge import a\nfrom kernelforge.c import _helper\n")
    (pkg / "c.py").write_text("import kernelforge.a as a\n\n\ndef g():\n    return a._x\n\n\n"
                              "def _helper():\n    pass\n")
    assert private_imports(pkg) == ["kernelforge/c.py:5: kernelforge.a._x",
                                    "kernelforge/sub/b.py:2: from kernelforge.c import _helper"]
    graph = import_graph(pkg)
    assert graph["kernelforge.a"] == {"kernelforge.sub.b"}
    assert find_cycle(graph) == ["kernelforge.a", "kernelforge.sub.b", "kernelforge.a"]
    (pkg / "sub" / "b.py").write_text("VALUE = 1\n")  # no import-time cycle left; a's f still closes one
    assert find_cycle(import_graph(pkg)) is None
    assert import_graph(pkg, import_time_only=False)["kernelforge.a"] == {"kernelforge.sub.b", "kernelforge.c"}
    assert find_cycle(import_graph(pkg, import_time_only=False)) == [
        "kernelforge.a", "kernelforge.c", "kernelforge.a"]
    (pkg / "a.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from kernelforge.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def h():\n    from kernelforge.sub import VALUE\n")
    assert find_cycle(import_graph(pkg, import_time_only=False)) is None


def test_import_kernelforge_is_light():
    # Registering the ops needs torch only: Triton (kernelforge.triton's backends load it on first
    # use), Dynamo, transformers and matplotlib load when something asks for them.
    heavy = ("triton", "torch._dynamo", "transformers", "matplotlib")
    code = f"import sys, kernelforge; print(' '.join(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == []
