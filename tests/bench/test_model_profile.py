"""benchmarks/tools/model_profile.py on the CPU: the small workloads' ops per level, the decode workload
one step at a time after a prefill."""
import pytest

from tests.bench.scripts import load_script


def _script():
    return load_script("model_profile")


def test_decode_steps_and_a_forward_are_profiled_per_family(capsys):
    _script().main(["--device", "cpu", "--workloads", "LM decode,GNN forward", "--levels", "native",
                    "--steps", "2", "--top", "2"])
    printed = capsys.readouterr().out
    assert "## LM decode: CPU ms per decode step by kernel family" in printed
    assert "## GNN forward: CPU ms per call by kernel family" in printed
    totals = [line for line in printed.splitlines() if line.startswith("| total |")]
    assert len(totals) == 2 and all(float(line.split("|")[2]) > 0 for line in totals)


def test_more_steps_than_the_decode_tokens_is_refused():
    script = _script()
    with pytest.raises(ValueError, match="exceed its"):
        script.main(["--device", "cpu", "--workloads", "LM decode", "--levels", "native", "--steps", "100"])
