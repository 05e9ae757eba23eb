"""benchmarks/tools/host_overhead.py --tiny on the CPU: a row per op and direction with finite times for
kernelforge and torch, a breakdown that adds up, and the JSON."""
import json
import math

import pytest

from tests.bench.scripts import load_script


def _script():
    return load_script("host_overhead")


def test_tiny_run_times_every_op_and_writes_json(tmp_path, capsys):
    script = _script()
    result = script.main(["--tiny", "--out", str(tmp_path)])
    ops = list(script._cases(None, None, True))
    assert {(r["op"], r["mode"]) for r in result["rows"]} == {(op, m) for op in ops for m in ("fwd", "fwd+bwd")}
    for row in result["rows"]:
        assert not {k: v for k, v in row["errors"].items() if not v.startswith("n/a")}, row
        for label in ("kf", "reference", "torch"):
            assert math.isfinite(row["us"][label]) and row["us"][label] > 0, (row["op"], row["mode"], label)
        assert math.isfinite(row["ratio"]) and row["backends"] == "reference"
        parts = row["breakdown"]["us"]
        assert set(parts) == set(script.CATEGORIES) and all(math.isfinite(v) for v in parts.values())
        assert sum(parts.values()) == pytest.approx(row["breakdown"]["wrapped_total_us"], rel=1e-6)
        assert row["breakdown"]["functions"], row["op"]  # the probe saw the op's functions
        if row["mode"] == "fwd+bwd":
            assert "torch.autograd.backward" in row["breakdown"]["functions"], row["op"]
    assert json.loads((tmp_path / "host_overhead.json").read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    printed = capsys.readouterr().out
    assert all(f"== {op}:" in printed for op in ops)


def test_ops_filter_and_a_failing_op_is_a_row(tmp_path, monkeypatch):
    script = _script()
    cases = script._cases

    def broken(device, dtype, tiny):
        built = cases(device, dtype, tiny)
        kf_fn, torch_fn, inputs, grad = built["softmax"]()

        def fails(x):
            raise RuntimeError("boom")
        built["softmax"] = lambda: (fails, torch_fn, inputs, grad)
        return built

    monkeypatch.setattr(script, "_cases", broken)
    result = script.main(["--tiny", "--ops", "softmax,relu"])
    rows = {(r["op"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {("softmax", "fwd"), ("softmax", "fwd+bwd"), ("relu", "fwd"), ("relu", "fwd+bwd")}
    assert "boom" in rows["softmax", "fwd"]["errors"]["kf"] and math.isfinite(rows["softmax", "fwd"]["us"]["torch"])
    assert math.isfinite(rows["relu", "fwd+bwd"]["us"]["kf"])
