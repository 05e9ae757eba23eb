"""The spawn harness of the distributed tests: one gloo job (by default 2 processes, a 1-D mesh of 2
CPU ranks; `mesh_shape` / `mesh_dim_names` for another mesh, e.g. (2, 2) named ("dp", "tp"); over
NCCL, one GPU a rank, with KERNELFORGE_DIST_BACKEND=nccl) runs every case of a module and writes
each case's failure (or None) to a file; the module's tests read them, one test a case (a
module-scoped fixture calling `run_job`, `case_names`, `assert_passed`). `check` compares an op on
DTensors with the op on the full tensors; `assert_same_step` a training step with one process's."""
from __future__ import annotations

import gc
import json
import math
import os
import socket
import sys
import time
import traceback
from typing import Callable, Optional

import pytest
import torch

WORLD_SIZE = 2
TIMEOUT_S = 240  # the whole job: a hang fails the module instead of blocking CI

skip_without_gloo = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo")


def check(mesh, fn, inputs, placements, expected, *, grad=True, grad_atol=1e-5):
    """fn on DTensors `inputs` placed as `placements` (one a tensor; None: a non-tensor argument
    passed as is) against fn on the full tensors: values, output placements (`expected`: one per
    output; None: not checked), and with `grad` the inputs' gradients for the same random output
    gradients."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    needs_grad = [grad and isinstance(t, torch.Tensor) and t.is_floating_point() for t in inputs]
    full = [t.clone().requires_grad_(g) if p is not None else t for t, p, g in zip(inputs, placements, needs_grad)]
    dist = [distribute_tensor(t.detach(), mesh, [p]).requires_grad_(g) if p is not None else t
            for t, p, g in zip(inputs, placements, needs_grad)]
    ref = fn(*full)
    out = fn(*dist)
    ref, out = (ref, out) if isinstance(ref, tuple) else ((ref,), (out,))
    for i, (r, o, e) in enumerate(zip(ref, out, expected)):
        if e is not None:
            assert tuple(o.placements) == (e,), f"output {i}: placements {o.placements}, expected ({e},)"
        torch.testing.assert_close(o.full_tensor(), r, msg=lambda m: f"output {i}: {m}")
    if not grad:
        return
    grads = [torch.randn_like(r) for r in ref]  # the same on every rank: the seed is shared
    torch.autograd.backward(ref, grads)
    # a Partial output's gradient comes Replicate (as DTensor's backward normalizes it)
    torch.autograd.backward(out, [distribute_tensor(g, mesh, [Replicate() if p.is_partial() else p for p in o.placements])
                                  for g, o in zip(grads, out)])
    for i, (f, d) in enumerate(zip(full, dist)):
        if isinstance(f, torch.Tensor) and f.requires_grad:
            torch.testing.assert_close(d.grad.full_tensor(), f.grad, rtol=1e-5, atol=grad_atol,
                                       msg=lambda m: f"gradient of input {i}: {m}")


def _worker(rank: int, port: int, out_dir: str, cases: Callable[[], dict], mesh_shape: tuple,
            mesh_dim_names: Optional[tuple]) -> None:
    import faulthandler

    import torch.distributed as dist

    # a rank killed by a signal (SIGABRT from a C++ std::terminate, SIGSEGV) prints every
    # thread's Python stack to stderr, which pytest shows with the failing test
    faulthandler.enable(all_threads=True)
    backend = job_backend()
    if backend == "nccl":  # one GPU a rank; the cases' tensors made on it (their code names no device)
        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=math.prod(mesh_shape))
    try:
        from kernelforge import use_backend
        from kernelforge.distributed import enable
        from torch.distributed.device_mesh import init_device_mesh

        assert enable()  # importing kernelforge.distributed registered the rules: this finds them there
        mesh = init_device_mesh("cuda" if backend == "nccl" else "cpu", mesh_shape, mesh_dim_names=mesh_dim_names)
        results = {}
        with use_backend("reference"):
            for name, case in cases().items():
                _write_results(out_dir, rank, results, running=name)  # a rank that dies names its case
                torch.manual_seed(0)  # the same full tensors on every rank
                try:
                    case(mesh)
                    results[name] = None
                except Exception:
                    results[name] = traceback.format_exc()
                dist.barrier()  # a case failing on one rank only must not leave the other in a collective
        _write_results(out_dir, rank, results, running=None)
    finally:
        # Over NCCL a job whose cases had all passed once hung past its time limit here (a case had
        # compiled a model): compiled code let go too, and every thread's stack printed if the
        # teardown takes a minute
        faulthandler.dump_traceback_later(60)
        torch._dynamo.reset()
        gc.collect()  # the cases' models, stages and meshes go while their groups are alive
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()
    # The results are on disk and the process group is gone: leave without the interpreter's
    # finalization. A rank that had run pipeline P2P over gloo once died there in CI with a C++
    # std::terminate (SIGABRT) after every case had passed, which failed the whole module.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _write_results(out_dir: str, rank: int, results: dict, running: Optional[str]) -> None:
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"results": results, "running": running}, f)
    os.replace(path + ".tmp", path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_backend() -> str:
    """gloo on CPU processes; KERNELFORGE_DIST_BACKEND=nccl runs the same jobs over NCCL, one GPU a
    rank (a machine with at least as many GPUs as the job's ranks; NVLink multicast off unless
    NCCL_NVLS_ENABLE is set), the ops still at the reference backend, in float64, so the cases
    check the sharding rules and plans over NCCL against the same float64 results."""
    backend = os.environ.get("KERNELFORGE_DIST_BACKEND", "gloo")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"KERNELFORGE_DIST_BACKEND must be gloo or nccl, got {backend!r}")
    return backend


def run_job(out_dir, cases: Callable[[], dict], mesh_shape: tuple = (WORLD_SIZE,),
            mesh_dim_names: Optional[tuple] = None) -> dict:
    """Run `cases()` (a module-level function: the spawned processes import it) in the job, one
    process per rank of a mesh of `mesh_shape` (each case gets the mesh); the cases' names -> None
    (passed) or the failure, with its rank."""
    import torch.multiprocessing as mp

    world_size = math.prod(mesh_shape)
    if job_backend() == "nccl":
        if torch.cuda.device_count() < world_size:
            pytest.skip(f"KERNELFORGE_DIST_BACKEND=nccl: the job needs {world_size} GPUs, found "
                        f"{torch.cuda.device_count()}")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # inherited by the spawned ranks
    context = mp.start_processes(_worker, args=(_free_port(), str(out_dir), cases, tuple(mesh_shape), mesh_dim_names),
                                 nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    died = None
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                died = f"the {world_size}-process job did not finish in {TIMEOUT_S} s"
                break
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as error:  # a rank died or raised outside a case
        died = str(error)
    return merged_results(out_dir, world_size, list(cases()), died)


def merged_results(out_dir, world_size: int, names: list, died: Optional[str]) -> dict:
    """Every rank's results -> one per case: a case fails on any rank's failure, and, when a
    rank died (or the job hung), every case not finished on all ranks fails with the cause and the
    case each rank was in."""
    records = []
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.json"
        records.append(json.loads(path.read_text()) if path.exists() else {"results": {}, "running": None})
    merged = {}
    for rank, record in enumerate(records):
        for name, failure in record["results"].items():
            if failure is not None:
                merged[name] = f"rank {rank}: {failure}"
            else:
                merged.setdefault(name, None)
    if died is None:
        return merged
    unfinished = [name for name in names if any(name not in record["results"] for record in records)]
    if not unfinished:
        pytest.fail(f"every case finished on every rank, then: {died}")
    where = "; ".join(f"rank {rank} was in case {record['running']!r}" for rank, record in enumerate(records)
                      if record["running"] is not None) or "no rank was in a case"
    for name in unfinished:
        merged[name] = f"{died} ({where})"
    return merged


def case_names(cases: Callable[[], dict]) -> list[str]:
    # the cases' names need no process group: build them here (the DTensor imports are cheap enough)
    if not torch.distributed.is_available():
        return []
    return list(cases())


def assert_passed(results: dict, name: str) -> None:
    """One case of a job: it ran, and on every rank without a failure."""
    assert name in results, f"the job ran no case {name!r}"
    assert results[name] is None, results[name]


def assert_same_step(got, expected) -> None:
    """One training step's (loss, {name: gradient}, {name: parameter after the optimizer step})
    equal the one-process run's, in float64."""
    (loss, grads, params), (loss_ref, grads_ref, params_ref) = got, expected
    torch.testing.assert_close(loss, loss_ref, rtol=1e-10, atol=1e-12)
    assert grads.keys() == grads_ref.keys(), (sorted(grads), sorted(grads_ref))
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-9, atol=1e-12,
                                   msg=lambda m: f"gradient of {name}: {m}")
        torch.testing.assert_close(params[name], params_ref[name], rtol=1e-9, atol=1e-12,
                                   msg=lambda m: f"updated {name}: {m}")
