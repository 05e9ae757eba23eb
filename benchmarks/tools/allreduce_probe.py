"""All-reduce bandwidth between this host's GPUs (NCCL, one process a GPU) at the sizes a data-parallel
step reduces: what a DDP step's gradients cost, and whether the GPUs talk over NVLink or PCIe.

    torchrun --standalone --nproc_per_node 2 benchmarks/tools/allreduce_probe.py [--sizes-mib 25,200,1024]
    python benchmarks/tools/allreduce_probe.py --tiny        # two CPU processes over gloo, small sizes

Rank 0 prints, per size: the median time of an all-reduce (CUDA events on a GPU, after warm-up),
the algorithm bandwidth (bytes / time) and the bus bandwidth (x 2 (n - 1) / n, the figure NCCL's
own tests print: comparable across GPU counts); and `nvidia-smi topo -m` where it exists (NV# links
are NVLink, PIX / PHB / SYS are PCIe paths). bf16 elements, as a bf16 model's gradients.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import time

import torch
import torch.distributed as dist


def measure(sizes_mib: list[float], repeats: int, device: torch.device) -> list[tuple[float, float, float, float]]:
    """(MiB, median ms, algorithm GB/s, bus GB/s) per size, on this process's group."""
    world = dist.get_world_size()
    rows = []
    for mib in sizes_mib:
        elements = max(1, int(mib * 2 ** 20 / 2))
        tensor = torch.ones(elements, dtype=torch.bfloat16, device=device)
        for _ in range(3):  # warm-up: NCCL's communicators and buffers
            dist.all_reduce(tensor)
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dist.all_reduce(tensor)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                dist.all_reduce(tensor)
                times.append(time.perf_counter() - begin)
        seconds = statistics.median(times)
        algorithm = elements * 2 / seconds / 1e9
        rows.append((mib, seconds * 1e3, algorithm, algorithm * 2 * (world - 1) / world))
    return rows


def report(rows, world: int, backend: str) -> str:
    lines = [f"all-reduce, {world} ranks, {backend}, bf16",
             f"{'MiB':>8} {'median ms':>10} {'alg GB/s':>9} {'bus GB/s':>9}"]
    lines += [f"{mib:8.1f} {ms:10.3f} {alg:9.1f} {bus:9.1f}" for mib, ms, alg, bus in rows]
    if shutil.which("nvidia-smi"):
        topology = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True)
        lines += ["", "nvidia-smi topo -m:", topology.stdout.rstrip() or topology.stderr.rstrip()]
    return "\n".join(lines)


def _cpu_worker(rank: int, world: int, port: int, sizes: list[float], repeats: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    run(sizes, repeats, cuda=False)


def run(sizes: list[float], repeats: int, cuda: bool) -> None:
    """In a torchrun (or spawned) process: join the group, measure, rank 0 prints."""
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rows = measure(sizes, repeats, device)
        if dist.get_rank() == 0:
            print(report(rows, dist.get_world_size(), dist.get_backend()), flush=True)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", default="1,25,200,1024", help="comma-separated message sizes in MiB")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="two CPU processes over gloo at small sizes")
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.sizes_mib.split(",")]
    if args.tiny:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_cpu_worker, args=(2, port, [0.25, 1.0], 3), nprocs=2, join=True)
        return 0
    run(sizes, args.repeats, cuda=torch.cuda.is_available())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
