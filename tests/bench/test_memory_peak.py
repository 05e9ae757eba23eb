"""benchmarks/tools/memory_peak.py: the allocator's history replayed to its peak (made-up traces)."""
from tests.bench.scripts import load_script

MiB = 2 ** 20


def _alloc(addr, mib, name="forward", line=1):
    frames = [{"filename": "/site/torch/nn/modules/module.py", "line": 9, "name": "_call_impl"},
              {"filename": "/repo/model.py", "line": line, "name": name}]
    return dict(action="alloc", addr=addr, size=mib * MiB, frames=frames)


def _free(addr, mib, completed=True):
    events = [dict(action="free_requested", addr=addr, size=mib * MiB)]
    return events + ([dict(action="free_completed", addr=addr, size=mib * MiB)] if completed else [])


def test_the_peak_lists_what_is_alive_there_by_stack_and_size():
    report = load_script("memory_peak").peak_report(
        [_alloc(1, 4), _alloc(2, 4), *_free(1, 4), _alloc(1, 16, "head", 7),  # an address used again
         _alloc(3, 2, "head", 7), *_free(99, 5),  # a block from before the recording
         *_free(1, 16), _alloc(4, 1)], baseline_bytes=10 * MiB)
    lines = report.splitlines()
    # 10 + 4 + 4 - 4 + 16 + 2 = 32 before the old block's free; after it 27, then 11 and 12
    assert lines[0].startswith("peak 32 MiB allocated: 10 MiB from before the recording (less what it freed by "
                               "then: +0 MiB), 22 MiB in 3 blocks allocated during it, event 5 of 8")
    assert lines[2].split() == ["16.0", "1", "16.00", "model.py:7", "head"]
    assert lines[3].split() == ["4.0", "1", "4.00", "model.py:1", "forward"]
    assert lines[4].split() == ["2.0", "1", "2.00", "model.py:7", "head"]
    assert len(lines) == 5
    short = load_script("memory_peak").peak_report(
        [_alloc(1, 4), _alloc(2, 16, "head", 7), _alloc(3, 2, "head", 7)], baseline_bytes=0, top=1).splitlines()
    assert short[2].split()[:2] == ["16.0", "1"] and short[3].split() == ["6.0", "2", "(2", "more", "groups)"]


def test_frees_of_older_blocks_lower_the_total_and_frameless_blocks_are_named():
    script = load_script("memory_peak")
    events = [*_free(50, 8, completed=False), dict(action="alloc", addr=5, size=3 * MiB, frames=[]),
              dict(action="alloc", addr=6, size=1 * MiB, frames=[{"filename": "/x/torch/autograd/graph.py",
                                                                  "line": 3, "name": "_engine_run_backward"}])]
    report = script.peak_report(events, baseline_bytes=20 * MiB)
    # 20 - 8 + 3 + 1 = 16 never passes the baseline: the peak is the start, nothing grown
    assert report.startswith("peak 20 MiB allocated: 20 MiB from before the recording (less what it freed by then: "
                             "+0 MiB), 0 MiB in 0 blocks allocated during it, event 0 of 3")
    report = script.peak_report(events, baseline_bytes=6 * MiB)  # 6 - 8 + 3 + 1 = 2: still the start
    assert "event 0 of 3" in report
    report = script.peak_report(events[1:], baseline_bytes=0)
    assert "(no Python frame)" in report and "torch: _engine_run_backward" in report
