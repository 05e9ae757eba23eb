"""Train the example LanguageModel on the text shipped with kernelforge on several processes
(torchrun), data-parallel (DDP, FSDP2), tensor-parallel (TP, TP with sequence parallelism), both
(FSDP2 x TP on a 2-D mesh) or pipeline-parallel, with checkpoints that a later run resumes from.

    python examples/08_train_distributed.py                      # one process, a few seconds on a CPU
    torchrun --standalone --nproc_per_node 2 examples/08_train_distributed.py --parallel ddp --steps 100
    torchrun --standalone --nproc_per_node 4 examples/08_train_distributed.py --parallel tp-sp \
        --level native --dim 256 --layers 4 --heads 8 --checkpoint-dir runs/ckpt --checkpoint-every 50
    torchrun ... (the same arguments) --resume                # continues from runs/ckpt's last checkpoint
    torchrun --standalone --nproc_per_node 4 examples/08_train_distributed.py --parallel fsdp2-tp --tp 2
    torchrun --standalone --nproc_per_node 2 examples/08_train_distributed.py --parallel pp --microbatches 4

The plans are kernelforge.distributed.plans': --parallel none (one process: no torchrun, or a world
of one), ddp and fsdp2 (each rank its slice of the global batch, --batch-size sequences a step
across all ranks), tp and tp-sp (every rank the whole batch; the heads split over the ranks),
fsdp2-tp and fsdp2-tp-sp (a (dp, tp) mesh, dp = world / --tp: the heads split over the --tp
ranks of a dp group, FSDP2 sharding each of their shards over dp; each dp group its slice of the
batch), pp (kernelforge.distributed.pipeline: the layers split into one stage a rank, the whole
batch cut into --microbatches on the --schedule; the loss is the last stage's, the checkpoint each
rank's stage).
Every rank builds the model from the same seed. The model runs at any level
(kernelforge.models.LEVELS: reference, native, compile, triton, ...); its backward runs inside
`model.kernel_scope()` at that level too. Backend: gloo on a CPU, nccl on CUDA (one GPU a rank,
LOCAL_RANK; NCCL_NVLS_ENABLE=0, NVLink multicast off, unless set).

Data: byte-level tokens (a vocabulary of 256) of the shipped text, cut into windows of
--seq-len + 1 bytes, visited in a shuffled order (a new order each pass, from --seed); the data
position is the number of windows consumed so far. Each step takes the next --batch-size windows.

A progress line every --log-every steps (and at the last), printed by rank 0:

    step 20/100  loss 3.512345678901  tok/s/rank 10512  peak mem/rank 402.1 MiB (max RSS)

the loss the mean over the global batch, tokens/s those of one rank (of one GPU on CUDA) since
the previous line, the peak memory of one rank (the largest over the ranks): on CUDA
torch.cuda.max_memory_allocated; on a CPU the process's peak resident set size (getrusage's
ru_maxrss), a proxy that counts Python, torch and the kernels' code as well as the tensors.

Checkpoints (torch.distributed.checkpoint): every --checkpoint-every steps and at the end, into
--checkpoint-dir/step_NNNNNNNN (default: a new temporary directory), the model's and AdamW's state
dicts through torch.distributed.checkpoint.state_dict.get_state_dict (the same keys for every
plan: the LanguageModel's own names, AdamW's flattened to one key per parameter; sharded DTensors
under FSDP2 and TP, each rank writing its shards; under pp each rank its stage's parameters) and
the step and data position. --resume loads the last complete one of --checkpoint-dir
(set_state_dict) and goes on from its step and data position to --steps.

--activation-checkpointing: each layer keeps only its input for the backward and runs again there
(LanguageModel(activation_checkpointing=True)): less memory a GPU for one more forward a step, what
lets FSDP2's sharding of the parameters and AdamW's state show in the peak; with every plan.

--profile-step N profiles step N on every rank (torch.profiler): rank 0 prints its ops by device
time, each rank writes a chrome trace to --profile-dir/rank<r>-step<N>.json, which
benchmarks/tools/timeline_gaps.py --trace reads for where the device waited (an all-reduce, the
host).
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import resource
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

PARALLEL = ("none", "ddp", "fsdp2", "tp", "tp-sp", "fsdp2-tp", "fsdp2-tp-sp", "pp")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
CHECKPOINT = re.compile(r"step_(\d{8})$")


class Windows:
    """The corpus as windows of seq_len + 1 bytes (at a stride of seq_len), in a shuffled order
    that changes each pass; `position` counts the windows taken so far (the data position)."""

    def __init__(self, data: torch.Tensor, seq_len: int, seed: int, position: int = 0):
        self.data, self.seq_len, self.seed, self.position = data, seq_len, seed, position
        self.count = (len(data) - 1) // seq_len
        if self.count < 1:
            raise ValueError(f"--seq-len {seq_len} is longer than the corpus ({len(data)} bytes)")
        self._order = {}

    def _window(self, index: int) -> torch.Tensor:
        epoch, i = divmod(index, self.count)
        if epoch not in self._order:
            self._order = {epoch: torch.randperm(self.count, generator=torch.Generator().manual_seed(self.seed + epoch))}
        start = int(self._order[epoch][i]) * self.seq_len
        return self.data[start: start + self.seq_len + 1]

    def next_batch(self, batch: int) -> torch.Tensor:
        """The next `batch` windows (batch, seq_len + 1); advances the position."""
        rows = [self._window(self.position + b) for b in range(batch)]
        self.position += batch
        return torch.stack(rows)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup(args):
    """Starts the process group (under torchrun, or a world of one for a plan without it) and
    picks the device; returns (rank, world_size, device)."""
    import torch.distributed as dist

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not under_torchrun and args.parallel == "none":
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                              ("cpu" if args.device == "auto" else args.device))
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
        return 0, 1, device
    if not under_torchrun:  # a plan in one process: a process group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device.startswith("cuda")
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(f"local rank {local_rank}: one GPU a rank, and this host has {torch.cuda.device_count()}: "
                             f"start at most that many processes a node (--nproc_per_node), or pass --device cpu")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.parallel == "none" and world > 1:
        raise SystemExit(f"--parallel none runs one process; torchrun started {world}: pick one of {PARALLEL[1:]}")
    return rank, world, device


def mesh_shape(args, world: int) -> tuple[int, int]:
    """(dp, tp): the ranks that split the batch, and those that split the heads."""
    if args.parallel in ("ddp", "fsdp2"):
        return world, 1
    if args.parallel in ("tp", "tp-sp"):
        return 1, world
    if args.parallel.startswith("fsdp2-tp"):
        if args.tp < 1 or world % args.tp:
            raise SystemExit(f"--tp {args.tp} does not divide the {world} ranks")
        return world // args.tp, args.tp
    return 1, 1


def build(args, world: int, device):
    """The LanguageModel (the same seed on every rank) parallelized by --parallel, and AdamW.
    Returns (model: what the checkpoints hold, the LanguageModel or (pp) this rank's stage modules;
    trainer: what runs the loss, or (pp) the pipeline; optimizer)."""
    from kernelforge.models import LanguageModel

    torch.manual_seed(args.seed)
    model = LanguageModel(vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                          max_seq_len=args.seq_len, mlp_ratio=args.mlp_ratio, level=args.level,
                          activation_checkpointing=args.activation_checkpointing)
    model = model.to(device, DTYPES[args.dtype])
    trainer = model
    if args.parallel != "none":
        from torch.distributed.device_mesh import init_device_mesh

        from kernelforge.distributed.plans import data_parallel, optimizer_groups, tensor_parallel

        if args.parallel == "pp":
            from kernelforge.distributed.pipeline import pipeline_parallel

            pipe = pipeline_parallel(model, init_device_mesh(device.type, (world,), mesh_dim_names=("pp",)),
                                     args.microbatches, args.schedule)
            optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=args.weight_decay)
            return stage_modules(pipe), pipe, optimizer
        mesh = init_device_mesh(device.type, mesh_shape(args, world), mesh_dim_names=("dp", "tp"))
        if args.parallel == "ddp":
            trainer = data_parallel(model, "ddp", mesh=mesh)
        elif args.parallel == "fsdp2":
            data_parallel(model, "fsdp2", mesh=mesh)
        else:  # TP on mesh["tp"], then (fsdp2-tp*) FSDP2 over mesh["dp"]
            tensor_parallel(model, mesh, sequence_parallel=args.parallel.endswith("-sp"))
            if args.parallel.startswith("fsdp2"):
                data_parallel(model, "fsdp2", mesh=mesh)
        # a DTensor group and a plain one: CUDA's default foreach AdamW refuses a mix (TP's norms stay plain)
        groups = optimizer_groups(model.parameters())
    else:
        groups = model.parameters()
    optimizer = torch.optim.AdamW(groups, lr=args.lr, weight_decay=args.weight_decay)
    return model, trainer, optimizer


def stage_modules(pipe) -> torch.nn.Module:
    """This rank's pipeline stages as one module whose parameters have the model's names (what its
    checkpoints hold): the stage, or the stages of an interleaved schedule merged (their layers
    are disjoint, and the embeddings and the head are on one stage each)."""
    if len(pipe.stages) == 1:
        return pipe.stages[0]
    merged, layers = torch.nn.Module(), torch.nn.ModuleDict()
    for stage in pipe.stages:
        for name, child in stage.named_children():
            if name == "layers":
                layers.update(child)
            else:
                merged.add_module(name, child)
    merged.layers = layers
    return merged


def checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints (DCP writes .metadata last) of `directory`, (step, path), oldest first."""
    found = []
    for path in directory.glob("step_*") if directory.is_dir() else ():
        match = CHECKPOINT.match(path.name)
        if match and (path / ".metadata").exists():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _leaves(state):
    """(container, key, value) for every value of the nested dicts and lists of `state`."""
    for key, value in list(state.items() if isinstance(state, dict) else enumerate(state)):
        if isinstance(value, (dict, list)):
            yield from _leaves(value)
        else:
            yield state, key, value


def _structure_copy(state):
    """`state`'s nested dicts and lists copied, the tensors in them not (an optimizer's state_dict
    holds its live per-parameter dicts: replacing an entry of the copy leaves the optimizer as is)."""
    if isinstance(state, dict):
        return {key: _structure_copy(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_structure_copy(value) for value in state]
    return state


def _strided(value) -> bool:
    """A DTensor with a _StridedShard placement (tensor_parallel's fused column-wise weights)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(value, DTensor) and any(isinstance(p, _StridedShard) for p in value.placements)


def state_dict_options():
    """The optimizer's state under one key per parameter and setting (flattened), not one
    param_groups list per rank: pipeline ranks hold different parameters, and DCP writes an entry
    that every rank has under the same key (a param_groups list) from one rank only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def save_checkpoint(directory: Path, model, optimizer, step: int, position: int) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from kernelforge.distributed.strided import full_tensor

    model_state, optim_state = get_state_dict(model, optimizer, options=state_dict_options())
    state = _structure_copy({"model": model_state, "optim": optim_state,
                             "train": {"step": torch.tensor(step), "data_position": torch.tensor(position)}})
    for container, key, value in _leaves(state):
        if _strided(value):  # DCP takes a shard for a contiguous block of rows: gathered whole instead
            container[key] = full_tensor(value)
    path = directory / f"step_{step:08d}"
    with warnings.catch_warnings():  # one process without a process group: DCP says it assumes so
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        dcp.save(state, checkpoint_id=str(path))
    return path


def load_checkpoint(path: Path, model, optimizer) -> tuple[int, int]:
    """Loads `path` into the model and optimizer; returns (step, data position)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from kernelforge.distributed.strided import distribute_like

    model_state, optim_state = get_state_dict(model, optimizer, options=state_dict_options())
    state = _structure_copy({"model": model_state, "optim": optim_state,
                             "train": {"step": torch.tensor(0), "data_position": torch.tensor(0)}})
    # the _StridedShard DTensors (TP's fused QKV and [gate | up] weights, their AdamW moments):
    # saved whole (save_checkpoint), so loaded into a whole tensor, then split again
    strided = [(container, key, value) for container, key, value in _leaves(state) if _strided(value)]
    for container, key, value in strided:
        container[key] = torch.empty(value.shape, dtype=value.dtype, device=value.to_local().device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, checkpoint_id=str(path))
    for container, key, value in strided:
        container[key] = distribute_like(container[key], value)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=state_dict_options())
    return int(state["train"]["step"]), int(state["train"]["data_position"])


def peak_memory_mib(device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "max RSS"  # KiB on Linux


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--parallel", choices=PARALLEL, default="none")
    parser.add_argument("--tp", type=int, default=2, help="fsdp2-tp*: the tensor-parallel ranks (dp = world / tp)")
    parser.add_argument("--microbatches", type=int, default=2, help="pp: micro-batches a step")
    parser.add_argument("--schedule", default="1f1b", help="pp: gpipe, 1f1b or interleaved-1f1b")
    parser.add_argument("--level", default="reference", help="the model's level (kernelforge.models.LEVELS)")
    parser.add_argument("--steps", type=int, default=10, help="train up to this step (a resumed run: in all)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences a step, over all ranks")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--mlp-ratio", type=float, default=4.0)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0, help="the model's (on every rank) and the data order's")
    parser.add_argument("--device", default="auto", help="auto: cuda (one GPU a rank) if there is one, else cpu")
    parser.add_argument("--log-every", type=int, default=5, help="a progress line every N steps (and at the last)")
    parser.add_argument("--checkpoint-dir", default=None, help="default: a new temporary directory")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="a checkpoint every K steps (0: at the end only)")
    parser.add_argument("--resume", action="store_true", help="go on from the last checkpoint of --checkpoint-dir")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="each layer keeps only its input and runs again in the backward")
    parser.add_argument("--profile-step", type=int, default=0,
                        help="profile this step on every rank (torch.profiler): rank 0 prints its kernels by device "
                             "time, every rank writes a chrome trace into --profile-dir (0: no profile)")
    parser.add_argument("--profile-dir", default=".", help="where the traces go (rank<r>-step<N>.json)")
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    return args


def start_profile(device):
    """A torch.profiler over the next step (CPU ops, and the device's kernels on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def end_profile(profiler, device, trace: Path, say) -> None:
    """Stop the step's profile: its chrome trace into `trace` (where the device waited:
    benchmarks/tools/timeline_gaps.py --trace), its ops by device time (CPU time on a CPU) printed."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    profiler.stop()
    trace.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(trace))
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    say(f"profile of the step (trace {trace}):\n"
        f"{profiler.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=70)}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.distributed as dist

    from kernelforge.models.training import load_corpus

    rank, world, device = setup(args)
    say = print if rank == 0 else (lambda *a, **k: None)
    dp, tp = mesh_shape(args, world)
    if args.batch_size % dp:
        raise SystemExit(f"--batch-size {args.batch_size} does not split over {dp} ranks")
    if args.parallel.endswith("-sp") and args.seq_len % tp:
        raise SystemExit(f"--seq-len {args.seq_len} does not split over {tp} ranks (sequence parallelism)")
    local_batch = args.batch_size // dp
    dp_rank = rank // tp  # the mesh is (dp, tp), row-major: the tp ranks of a dp group are consecutive

    model, trainer, optimizer = build(args, world, device)
    if args.checkpoint_dir:
        directory = Path(args.checkpoint_dir)
    else:  # one new directory, named by rank 0
        name = [tempfile.mkdtemp(prefix="kernelforge-dist-") if rank == 0 else None]
        if dist.is_initialized() and world > 1:
            dist.broadcast_object_list(name, src=0)
        directory = Path(name[0])
    step, position = 0, 0
    if args.resume:
        found = checkpoints(directory)
        if found:
            step, position = load_checkpoint(found[-1][1], model, optimizer)
            say(f"resumed from {found[-1][1]}: step {step}, data position {position}")
        else:
            say(f"no checkpoint in {directory}: starting afresh")
    data = Windows(load_corpus(), args.seq_len, args.seed, position)
    say(f"{args.parallel} on {world} process(es) ({device.type}, {dist.get_backend() if dist.is_initialized() else 'no'} "
        f"backend); a {sum(p.numel() for p in model.parameters())}-parameter "
        f"{'stage (rank 0' + chr(39) + 's)' if args.parallel == 'pp' else 'model'} at level {args.level!r} "
        f"({args.dtype}); {args.batch_size} x {args.seq_len} tokens a step")

    tok_label = "tok/s/gpu" if device.type == "cuda" else "tok/s/rank"
    model.train()
    last_time, last_step, last_saved = time.perf_counter(), step, None
    while step < args.steps:
        profiler = start_profile(device) if step + 1 == args.profile_step else None
        tokens = data.next_batch(args.batch_size)
        if dp > 1:
            tokens = tokens[dp_rank * local_batch: (dp_rank + 1) * local_batch]
        # to a GPU from pinned memory, not waiting: from pageable memory the copy waited for the last
        # step's kernels, and the device then for this step's launches (0.76 ms idle a DDP step)
        tokens = tokens.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tokens.to(device)
        with trainer.kernel_scope():
            if args.parallel == "pp":  # forward and backward through the schedule; the loss on the last stage
                loss = trainer.step(tokens)
            else:
                loss = trainer.loss(tokens)
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if profiler is not None:
            end_profile(profiler, device, Path(args.profile_dir) / f"rank{rank}-step{step}.json", say)
        if step % args.log_every == 0 or step == args.steps:
            if args.parallel == "pp":  # from the last stage's rank
                value = torch.zeros((), dtype=torch.float64, device=device) if loss is None else loss.double()
                dist.broadcast(value, src=world - 1)
            else:
                value = loss.detach().double()
            if dp > 1:  # the mean of equal slices' means (each tp rank of a slice holds it): the global batch's
                dist.all_reduce(value)
                value /= world
            value = value.item()  # waits for the device: the steps timed are the steps done, not launched
            elapsed = time.perf_counter() - last_time
            rate = local_batch * args.seq_len * (step - last_step) / elapsed
            memory, how = peak_memory_mib(device)
            if world > 1:
                peak = torch.tensor([memory], dtype=torch.float64, device=device)
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                memory = peak.item()
            say(f"step {step}/{args.steps}  loss {value:.12g}  {tok_label} {rate:.0f}  "
                f"peak mem/rank {memory:.1f} MiB ({how})", flush=True)
            last_time, last_step = time.perf_counter(), step
        if (args.checkpoint_every and step % args.checkpoint_every == 0) or step == args.steps:
            path = save_checkpoint(directory, model, optimizer, step, data.position)
            last_saved = path
            say(f"checkpoint {path}", flush=True)
    if last_saved is None:
        say(f"already at step {step} (--steps {args.steps}): nothing to train")
    if dist.is_initialized():
        # the model, its wrappers and the pipeline's stages hold process groups and communication
        # state: let them go while every group is alive, not in the interpreter's finalization
        # after the groups are destroyed (a pipeline rank over gloo once aborted there)
        del model, trainer, optimizer
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
