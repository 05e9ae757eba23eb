"""Loading a script of benchmarks/tools/ as a module, for the tests that run it on the CPU."""
import importlib.util
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "benchmarks" / "tools"


def load_script(name: str) -> ModuleType:
    """benchmarks/tools/<name>.py, imported afresh (its module-level state is the test's own)."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
