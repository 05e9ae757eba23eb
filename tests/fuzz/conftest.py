"""The fuzz suite's hypothesis profiles.

Every test under tests/fuzz is marked `fuzz` and runs in every CPU run; the profile only sets how many
examples each one draws:

- short (the default, e.g. `pytest -m "not gpu"`): each test's own small budget for each backend
  (tests/fuzz/strategies.py: fuzz), from 6 examples (interpreted Triton rope) to 100 (the reference's
  cheap ones), so that the whole fuzz suite adds about a minute to the CPU suite on a 2-core machine
  running the Triton kernels through the interpreter.
- long: LONG_FACTOR times each budget, for nightly-style runs. Taken when the -m expression selects
  the fuzz tests and only them (`pytest -m fuzz`, `pytest -m "fuzz and not slow"`).

Environment overrides: KERNELFORGE_FUZZ_PROFILE=short|long picks the profile whatever -m says;
KERNELFORGE_FUZZ_EXAMPLES=N gives every fuzz test N examples (1 for a smoke run, 5000 for a night).

Both profiles: deadline=None (an interpreted Triton launch takes milliseconds to a second, and the
first call of a kernel more); database=None (no .hypothesis directory is written into the
repository); derandomize=False: every run draws fresh examples, as the rest of the suite draws fresh
seeds (tests/conftest.py). A failure is reproducible from what hypothesis prints: the falsifying
example ("Draw 1 (case): Case(...)") holds every input (the tensors are made from its drawn seed:
tests/fuzz/strategies.py, Maker), to paste into the test file's REGRESSIONS (explicit cases that
every run checks) once shrunk and understood; print_blob adds a @reproduce_failure(...) line, and
`--hypothesis-seed=N` replays a whole run's draws.

A failure that is a kernelforge bug is kept as an xfail(strict=True) test beside the fuzz test, and
the strategy steers around it (with a comment naming that test) so that the fuzzing goes on finding
other things.
"""
from __future__ import annotations

import importlib.util
import os

LONG_FACTOR = 20

if importlib.util.find_spec("hypothesis") is None:
    # requirements-test.txt installs it; an environment without it (a GPU machine's own Python
    # running `pytest -m gpu`) collects no fuzz test rather than failing the whole run
    collect_ignore_glob = ["test_*.py"]
    strategies = None
else:
    from hypothesis import HealthCheck, settings

    from tests.fuzz import strategies

    settings.register_profile(
        "kernelforge-fuzz",
        deadline=None,
        database=None,
        derandomize=False,
        print_blob=True,
        # too_slow: the Triton interpreter makes slow examples by design; data_too_large: the
        # strategies draw many small choices (a layout per operand)
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def _selects_only_fuzz(markexpr: str) -> bool:
    """Whether `-m markexpr` selects a test marked fuzz (alone) but not an unmarked one."""
    if not markexpr:
        return False
    from _pytest.mark.expression import Expression

    expression = Expression.compile(markexpr)
    return (expression.evaluate(lambda name, **kwargs: name == "fuzz")
            and not expression.evaluate(lambda name, **kwargs: False))


def pytest_configure(config):
    if strategies is None:
        return
    profile = os.environ.get("KERNELFORGE_FUZZ_PROFILE")
    if profile is None:
        profile = "long" if _selects_only_fuzz(config.getoption("markexpr", "")) else "short"
    if profile not in ("short", "long"):
        raise ValueError(f"KERNELFORGE_FUZZ_PROFILE must be 'short' or 'long', got {profile!r}")
    examples = os.environ.get("KERNELFORGE_FUZZ_EXAMPLES")
    strategies.configure(profile, LONG_FACTOR if profile == "long" else 1, int(examples) if examples else None)
    settings.load_profile("kernelforge-fuzz")


def pytest_report_header(config):
    if strategies is None:
        return "kernelforge fuzz suite: not collected (hypothesis is not installed)"
    return f"kernelforge fuzz profile: {strategies.PROFILE['name']} ({strategies.describe_budget()})"
