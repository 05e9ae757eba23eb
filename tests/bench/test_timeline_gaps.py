"""benchmarks/tools/timeline_gaps.py on a made-up chrome trace: the idle gaps and, per stream, the
busy time and the communication that no other kernel hid (what a data-parallel step waits for)."""
import json
import subprocess
import sys
from pathlib import Path

from tests.bench.scripts import TOOLS, load_script


def _kernel(name, stream, start, end):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": start, "dur": end - start,
            "args": {}}


# compute on stream 7 over [0, 10] and [12, 20]; all-reduces on stream 13 over [8, 15] and [20, 30]:
# 17 us of communication, [10, 12] and [20, 30] of it with no compute beside it (12 us exposed)
TRACE = {"traceEvents": [_kernel("gemm", 7, 0, 10), _kernel("gemm", 7, 12, 20),
                         _kernel("ncclDevKernel_AllReduce_Sum_bf16", 13, 8, 15),
                         _kernel("ncclDevKernel_AllReduce_Sum_bf16", 13, 20, 30)]}


def test_streams_and_exposed_communication(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    report = load_script("timeline_gaps").idle_report(str(path), min_gap_us=1.0)
    lines = report.splitlines()
    assert lines[0].startswith("device span 0.03 ms, busy 0.03 ms (100.0%)")  # one stream or the other always runs
    streams = lines[lines.index("by stream (device, stream): busy ms, operations, the longest operation's name") + 1:]
    assert streams[0].split()[:2] == ["0.018", "2"] and "(0, 7)" in streams[0]  # compute: 18 us
    assert streams[1].split()[:2] == ["0.017", "2"] and "(0, 13)" in streams[1] and "ncclDevKernel" in streams[1]
    assert streams[2] == ("communication (NCCL kernels): 0.017 ms, 0.012 ms of it with no other kernel running "
                          "(exposed), 0.005 ms beside compute")


def test_idle_time_the_profiler_caused(tmp_path):
    # idle over [10, 12]; the profiler's buffer request over [11, 40]: 1 us of the gap is its
    trace = {"traceEvents": [*TRACE["traceEvents"][:2], {"ph": "X", "cat": "overhead", "name": "Activity Buffer Request",
                                                          "pid": 0, "tid": 0, "ts": 11, "dur": 29}]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    report = load_script("timeline_gaps").idle_report(str(path), min_gap_us=1.0)
    assert "idle while the profiler did its own work (overhead events): 0.001 ms" in report.splitlines()


def test_interval_arithmetic():
    script = load_script("timeline_gaps")
    assert script._union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert script._minus([(0, 10)], [(2, 3), (5, 6), (9, 12)]) == 7
    assert script._minus([(0, 4), (6, 9)], [(3, 7)]) == 5  # [0, 3] and [7, 9]
    assert script._minus([(0, 4)], []) == 4 and script._minus([(1, 2)], [(0, 5)]) == 0


def test_a_saved_trace_from_the_command_line(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    done = subprocess.run([sys.executable, str(TOOLS / "timeline_gaps.py"), "--trace", str(path)], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and "0.012 ms of it with no other kernel running" in done.stdout, done.stderr
