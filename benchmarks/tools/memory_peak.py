"""What is alive on the GPU at a step's peak: the caching allocator's history replayed to the moment
of the most memory allocated, the live blocks grouped by where they were allocated.

    from benchmarks.tools.memory_peak import recording
    with recording() as report:                # torch.cuda.memory._record_memory_history inside
        for _ in range(10): step()
    print(report[0])

    python benchmarks/tools/memory_peak.py --tiny   (a made-up history on the CPU: checks the replay)

The allocator's trace (torch.cuda.memory._snapshot()["device_traces"]) holds an event per
allocation and per free, with the Python frames of the call that allocated. Memory allocated before
the recording began (parameters, optimizer state, gradients kept between steps) appears only when
freed; it is the report's baseline. The replay adds each allocation and takes away each free, finds
the largest total and lists what is alive there that was allocated during the recording: by size
and stack, largest first. Allocations made on autograd's backward thread carry no Python frames:
their stack reads "(no Python frame)", and their sizes say which tensors they are.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import sys
from typing import Iterable

MiB = 2 ** 20
# frames from these paths are the machinery, not the code that asked for memory
MACHINERY = ("torch/", "torch\\", "<frozen", "contextlib.py", "functools.py")


def _where(frames: list[dict], depth: int) -> str:
    """The innermost `depth` frames outside torch's own machinery, innermost first."""
    kept = [f for f in frames if not any(part in f.get("filename", "") for part in MACHINERY)]
    if not kept:
        return "(no Python frame)" if not frames else f"torch: {frames[0].get('name', '?')}"
    return " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in kept[:depth])


def peak_report(events: Iterable[dict], baseline_bytes: int, depth: int = 3, top: int = 25) -> str:
    """The live allocations at the largest total of `events` (one device's trace), over a baseline
    of `baseline_bytes` allocated before the trace began."""
    # a free is counted at its request (free_completed follows once the block's streams are done with
    # it); a block from before the trace has only its frees here
    events = [e for e in events if e.get("action") in ("alloc", "free_requested")]
    total = peak = baseline_bytes
    peak_index = -1
    for index, event in enumerate(events):
        total += event["size"] if event["action"] == "alloc" else -event["size"]
        if total > peak:
            peak, peak_index = total, index
    live: dict[int, dict] = {}  # replayed up to the peak
    for event in events[:peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        else:
            live.pop(event["addr"], None)
    groups: dict[tuple, list[int]] = collections.defaultdict(list)
    for event in live.values():
        groups[(_where(event.get("frames", []), depth), event["size"])].append(event["size"])
    rows = sorted(groups.items(), key=lambda item: -sum(item[1]))
    grown = sum(e["size"] for e in live.values())
    lines = [f"peak {peak / MiB:.0f} MiB allocated: {baseline_bytes / MiB:.0f} MiB from before the recording "
             f"(less what it freed by then: {(peak - grown - baseline_bytes) / MiB:+.0f} MiB), "
             f"{grown / MiB:.0f} MiB in {len(live)} blocks allocated during it, "
             f"event {peak_index + 1} of {len(events)}",
             f"{'MiB':>9} {'blocks':>6} {'each MiB':>9}  allocated at (innermost first)"]
    for (where, size), sizes in rows[:top]:
        lines.append(f"{sum(sizes) / MiB:9.1f} {len(sizes):6d} {size / MiB:9.2f}  {where}")
    if len(rows) > top:
        rest = sum(sum(sizes) for _, sizes in rows[top:])
        blocks = sum(len(s) for _, s in rows[top:])
        lines.append(f"{rest / MiB:9.1f} {blocks:6d} {'':9}  ({len(rows) - top} more groups)")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def recording(device=None, max_entries: int = 1_000_000):
    """Record the allocator's history (Python frames) inside the block; yields a list that holds,
    after the block, the report of the block's peak. The recording costs host time per allocation:
    time nothing inside it that is compared with a run outside it."""
    import torch

    device = torch.device(device if device is not None else "cuda")
    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    report: list[str] = []
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield report
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    report.append(peak_report(snapshot["device_traces"][index], baseline))


def _tiny_events() -> list[dict]:
    """A made-up step: activations kept for the backward, a transient, gradients; one block from
    before the trace freed."""
    frame = lambda name, line: [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
                                {"filename": "/x/model.py", "line": line, "name": name}]
    events = [dict(action="alloc", addr=100 + i, size=4 * MiB, frames=frame("forward", 10)) for i in range(3)]
    events += [dict(action="alloc", addr=200, size=64 * MiB, frames=frame("head", 20)),
               dict(action="free_requested", addr=200, size=64 * MiB),
               dict(action="free_completed", addr=200, size=64 * MiB),
               dict(action="free_requested", addr=7, size=2 * MiB),  # from before the trace
               dict(action="alloc", addr=300, size=8 * MiB, frames=[])]
    events += [dict(action="free_requested", addr=100 + i, size=4 * MiB) for i in range(3)]
    return events


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="replay a made-up history on the CPU")
    args = parser.parse_args(argv)
    if not args.tiny:
        parser.error("on a GPU use recording() from a script (hf_train_step.py --memory-dir does)")
    sys.stdout.write(peak_report(_tiny_events(), baseline_bytes=10 * MiB))
    return 0


if __name__ == "__main__":
    sys.exit(main())
