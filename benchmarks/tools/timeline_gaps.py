"""Where the GPU sits idle in a profiled stretch of work, and what the host was doing then.

    from benchmarks.tools.timeline_gaps import idle_report
    with torch.profiler.profile(activities=[CPU, CUDA]) as prof: ...
    print(idle_report(prof))

    python benchmarks/tools/timeline_gaps.py [--tiny]   (an example: products with host stalls between them)
    python benchmarks/tools/timeline_gaps.py --trace rank0-step20.json   (a saved chrome trace)

Reads the profiler's trace (kernels, memcpys and memsets on the device; the runtime / driver calls
that launched them and the CPU ops around those calls on the host). For each gap between two
device operations longer than `min_gap_us`, the operation after the gap is followed to its launch:
- launched after the gap began: the device waited for the host (host-bound); the gap is charged to
  the CPU ops that enclose the launch (outermost first), which say which Python code was slow;
- launched before: the device waited on something else (an event, another stream).
Host synchronizations (stream / device / event syncs, device-to-host copies) are listed with their
enclosing ops: each one drains the device's queue, so the gaps after it are the host's to refill.
Then each stream's busy time, and the NCCL kernels' time with no other kernel running beside them
(a data-parallel step's exposed communication) against the part compute hid.
--tiny: the example's small products on the CPU (no device operations to report): checks that a
trace is read.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

import torch

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATEGORIES = {"cuda_runtime", "cuda_driver"}
SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
              "cuCtxSynchronize", "cudaMemcpy", "cudaMemcpyAsync")


def _load_events(prof) -> list[dict]:
    """The trace's events: of a profiler, or of a chrome trace it wrote (a path)."""
    if isinstance(prof, (str, os.PathLike)):
        with open(prof) as f:
            return json.load(f)["traceEvents"]
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def _enclosing(ops_by_thread: dict, tid, ts: float, depth: int) -> str:
    """The names of the CPU ops on thread `tid` that enclose the instant `ts`, outermost first."""
    names = [e["name"] for e in ops_by_thread.get(tid, ()) if e["ts"] <= ts <= e["ts"] + e.get("dur", 0)]
    if len(names) > depth:  # the outermost and the innermost say the most
        names = names[:depth // 2] + ["..."] + names[-(depth - depth // 2):]
    return " > ".join(names) or "(no CPU op)"


def idle_report(prof, min_gap_us: float = 20.0, top: int = 25, depth: int = 4) -> str:
    """The report of a profiler's trace, or of a chrome trace file (its path)."""
    events = [e for e in _load_events(prof) if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    ops_by_thread = collections.defaultdict(list)
    for e in sorted((e for e in events if e.get("cat") in ("cpu_op", "user_annotation")), key=lambda e: e["ts"]):
        ops_by_thread[e["tid"]].append(e)
    if not device:
        return "no device operations in the trace\n"
    span = device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]
    busy_until, busy, idle = device[0]["ts"], 0.0, []
    for e in device:
        start, end = e["ts"], e["ts"] + e["dur"]
        if start > busy_until:
            idle.append((busy_until, start, e))
        busy += max(0.0, end - max(start, busy_until))
        busy_until = max(busy_until, end)
    by_cause, counts, host_bound, other = collections.Counter(), collections.Counter(), 0.0, 0.0
    small = 0.0
    for gap_start, gap_end, after in idle:
        length = gap_end - gap_start
        if length < min_gap_us:
            small += length
            continue
        launch = launches.get(after.get("args", {}).get("correlation"))
        if launch is not None and launch["ts"] >= gap_start:
            host_bound += length
            cause = _enclosing(ops_by_thread, launch["tid"], launch["ts"], depth)
        else:
            other += length
            cause = "(launched before the gap) " + after["name"][:60]
        by_cause[cause] += length
        counts[cause] += 1
    lines = [f"device span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms ({busy / span:.1%}), idle "
             f"{(span - busy) / 1e3:.2f} ms: {host_bound / 1e3:.2f} ms in host-bound gaps >= {min_gap_us:g} us, "
             f"{other / 1e3:.2f} ms in other gaps >= {min_gap_us:g} us, {small / 1e3:.2f} ms in shorter gaps",
             f"idle by the CPU ops around the launch that ended it (top {top}; ms, gaps):"]
    lines += [f"  {t / 1e3:8.3f} {counts[c]:5d}  {c}" for c, t in by_cause.most_common(top)]
    # the profiler's own work (CUPTI's activity buffers, "overhead" events) stalls the host it
    # profiles: a gap it overlaps is partly the measurement's, not the program's
    gaps = _union([(start, end) for start, end, _ in idle])
    profiler = _union([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "overhead"])
    lines.append(f"idle while the profiler did its own work (overhead events): "
                 f"{(_length(gaps) - _minus(gaps, profiler)) / 1e3:.3f} ms")
    syncs = collections.Counter()
    for e in events:
        if e.get("cat") in LAUNCH_CATEGORIES and e["name"].startswith(SYNC_NAMES):
            syncs[f"{e['name']} in {_enclosing(ops_by_thread, e['tid'], e['ts'], depth)}"] += 1
    lines.append(f"host synchronizations and copies (count): {sum(syncs.values())}")
    lines += [f"  {n:5d}  {s}" for s, n in syncs.most_common(top)]
    lines += stream_lines(device)
    return "\n".join(lines) + "\n"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def _minus(intervals, other) -> float:
    """The length of `intervals` (a union) not covered by `other` (a union)."""
    uncovered, j = 0.0, 0
    for start, end in intervals:
        cursor = start
        while j < len(other) and other[j][1] <= cursor:
            j += 1
        k = j
        while k < len(other) and other[k][0] < end:
            if other[k][0] > cursor:
                uncovered += other[k][0] - cursor
            cursor = max(cursor, other[k][1])
            k += 1
        uncovered += max(0.0, end - cursor)
    return uncovered


def stream_lines(device: list[dict]) -> list[str]:
    """Each stream's busy time, and the communication (NCCL kernels) that ran with no other kernel
    beside it: the part of an all-reduce a data-parallel step waits for (exposed), against the part
    hidden behind compute."""
    streams = collections.defaultdict(list)
    for e in device:
        streams[(e.get("pid"), e.get("tid"))].append(e)
    lines = ["by stream (device, stream): busy ms, operations, the longest operation's name"]
    for key, ops in sorted(streams.items(), key=lambda item: -sum(e["dur"] for e in item[1])):
        busy = _length(_union([(e["ts"], e["ts"] + e["dur"]) for e in ops]))
        longest = max(ops, key=lambda e: e["dur"])["name"]
        lines.append(f"  {busy / 1e3:9.3f} {len(ops):6d}  {key}  {longest[:70]}")
    comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in device if e["name"].lower().startswith("nccl")])
    if comm:
        compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in device if not e["name"].lower().startswith("nccl")])
        exposed = _minus(comm, compute)
        lines.append(f"communication (NCCL kernels): {_length(comm) / 1e3:.3f} ms, {exposed / 1e3:.3f} ms of it with "
                     f"no other kernel running (exposed), {(_length(comm) - exposed) / 1e3:.3f} ms beside compute")
    return lines


def main(argv=None) -> None:
    """The report of an example: matrix products with a host stall before every fourth one, so on a
    GPU the idle time shows up as host-bound gaps charged to the stalled step."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small products on the CPU: checks the script runs")
    parser.add_argument("--trace", help="report this chrome trace instead (torch.profiler's export_chrome_trace)")
    args = parser.parse_args(argv)
    if args.trace:
        print(idle_report(args.trace))
        return
    on_gpu = torch.cuda.is_available() and not args.tiny
    x = torch.randn(*((64, 64) if args.tiny else (4096, 4096)), device="cuda" if on_gpu else "cpu")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        for step in range(16):
            with torch.profiler.record_function(f"step {step % 4}"):
                if step % 4 == 3:
                    time.sleep(0.002)  # the host falls behind: the device drains its queue and waits
                x = torch.tanh(x @ x) / 64
        if on_gpu:
            torch.cuda.synchronize()
    print(idle_report(prof))


if __name__ == "__main__":
    main()
