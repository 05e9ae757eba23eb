"""The spawn harness itself: a rank that dies inside a case (here by SIGABRT, as a C++
std::terminate would) fails that case and the ones after it with the signal and the case each rank
was in, while the cases finished before it keep their own results."""
from __future__ import annotations

import os

import pytest

from tests.distributed._harness import merged_results, run_job, skip_without_gloo

pytestmark = skip_without_gloo


def _passes(mesh):
    assert mesh.size() == 2


def _rank1_aborts(mesh):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.abort()


def _cases():
    return {"passes": _passes, "rank1-aborts": _rank1_aborts, "after": _passes}


def test_a_rank_dying_in_a_case_is_reported_against_that_case(tmp_path):
    results = run_job(tmp_path, _cases)
    assert results["passes"] is None
    for name in ("rank1-aborts", "after"):
        assert "SIGABRT" in results[name], results[name]
        assert "rank 1 was in case 'rank1-aborts'" in results[name], results[name]


def test_a_job_failing_after_its_cases_fails_the_module(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.json").write_text('{"results": {"passes": null}, "running": null}')
    with pytest.raises(pytest.fail.Exception, match="every case finished on every rank, then: boom"):
        merged_results(tmp_path, 2, ["passes"], "boom")
