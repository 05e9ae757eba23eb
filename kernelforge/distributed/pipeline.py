"""Pipeline parallelism for the example LanguageModel (kernelforge.models.LanguageModel) on
torch.distributed.pipelining: the model's layers split into consecutive stages, one stage a rank
of the pipeline group (two or more with an interleaved schedule), the batch cut into
micro-batches that flow through the stages on a GPipe, 1F1B or interleaved 1F1B schedule.

    mesh = init_device_mesh("cuda", (world_size,), mesh_dim_names=("pp",))
    pipe = pipeline_parallel(model, mesh, n_microbatches=4, schedule="1f1b")
    optimizer = torch.optim.AdamW(pipe.parameters())      # this rank's stage(s) only
    loss = pipe.step(ids)      # forward + backward: the batch's loss on the last stage, else None
    optimizer.step(); pipe.zero_grad()
    pipe.eval_loss(ids)        # forward only, no gradients

    # with data parallelism: a 2-D mesh, each stage module sharded (FSDP2) or replicated (DDP)
    # over the "dp" dimension; each dp rank passes its own part of the global batch
    mesh = init_device_mesh("cuda", (pp, dp), mesh_dim_names=("pp", "dp"))
    pipe = pipeline_parallel(model, mesh, n_microbatches=4, data_parallel="fsdp2")

The stages. Every rank passes the same model (same seed), as for kernelforge.distributed.plans;
each keeps only its stage's parts of it, shared, not copied (the rest can be dropped): the first
stage the token and position embeddings, every stage its slice of `model.layers`, the last the
final norm and the head, and the loss (the model's cross-entropy at the model's level) runs on the
last stage's logits. The stage's parameters keep the model's names ("layers.2.attn.qkv.weight").
With data_parallel, fully_shard / DDP wrap those shared parts in place: train through the
pipeline from then on, not through `model`.
The layers split as evenly as they go, the earlier stages taking one more where they do not
divide; `stage_layers` gives the count per stage instead (0 allowed on the first and the last
stage, which hold the embeddings or the head anyway).

The loss. The model's loss is the mean over the batch's B * (T - 1) next-token targets. Every
micro-batch holds the same number of sequences of the same length, and no target is ignored
(the targets are token ids, never the cross-entropy's ignore_index), so each micro-batch's mean
weighs its targets exactly as the full batch's mean does: step returns the mean of the
micro-batch losses, and the schedule divides the accumulated gradients by the number of
micro-batches (its scale_grads). That is the full batch's loss and gradient, up to rounding.
With data parallelism, the returned loss is also averaged over the dp ranks (equal parts of the
global batch) and DDP / FSDP2 average the gradients over them.

Tied embeddings. The LanguageModel ties its head to the token embedding. Across stages the first
stage's tok_emb.weight and the last stage's head.weight are two copies of that one parameter:
after the backward their gradients are summed (an all-reduce between the first and the last
stage's ranks, per dp rank), so each copy gets the tied parameter's full gradient, and the same
optimizer step keeps the copies equal. The last stage names its copy "head.weight".

Gradients accumulate across steps as usual (each step's gradient is added to what is there:
zero_grad between optimizer steps). Levels: every level but "fastest" (its CUDA graphs reuse a
call's outputs at the next call, while the schedule still holds earlier micro-batches' outputs).
Training only: the pipeline has no generate.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from kernelforge.models.levels import FASTEST, LevelledModel

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
DATA_PARALLEL = (None, "ddp", "fsdp2")


class LanguageModelStage(LevelledModel):
    """One pipeline stage of a LanguageModel: `model`'s layers `layer_indices` (kept under their
    model names, "layers.<i>"), with the embeddings on the first stage and the final norm and head
    on the last. It runs at the model's level and shares the model's kernel set (its components
    already point at it). forward: token ids (first stage) or the residual stream (B, T, C) ->
    the residual stream, or the logits (B, T, vocab) on the last stage."""

    def __init__(self, model, layer_indices: Sequence[int], is_first: bool, is_last: bool):
        super().__init__()
        self.kernels = model.kernels  # the model's components share this one: _init_level leaves them as they are
        self.config = model.config
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_indices})
        if is_last:
            self.norm, self.head = model.norm, model.head
        self.activation_checkpointing = model.activation_checkpointing
        self._init_level(model.level)

    def compute(self, x):
        if self.is_first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers.values():
            x = self.layer_call(layer, x)
        return self.head(self.norm(x)) if self.is_last else x

    def compute_loss_from_logits(self, logits, targets):
        """logits (B, T, vocab), targets (B, T) -> the mean loss, as LanguageModel.compute_loss."""
        return self.kernels.ops.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def loss_from_logits(self, logits, targets):
        return self.run("compute_loss_from_logits", logits, targets)


def balanced_split(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage, as even as they go; the earlier stages take the remainder."""
    if n_layers < n_stages:
        raise ValueError(f"pipeline_parallel: {n_layers} layers cannot fill {n_stages} stages (one layer a stage "
                         f"at least; pass stage_layers to leave the first or last stage without layers)")
    base, extra = divmod(n_layers, n_stages)
    return [base + (i < extra) for i in range(n_stages)]


def _check_stage_layers(stage_layers, n_layers: int, n_stages: int) -> list[int]:
    counts = [int(c) for c in stage_layers]
    if len(counts) != n_stages:
        raise ValueError(f"pipeline_parallel: stage_layers has {len(counts)} entries for {n_stages} stages")
    if sum(counts) != n_layers or any(c < 0 for c in counts):
        raise ValueError(f"pipeline_parallel: stage_layers {counts} must be counts >= 0 adding up to the model's "
                         f"{n_layers} layers")
    empty_middle = [i for i, c in enumerate(counts) if c == 0 and 0 < i < n_stages - 1]
    if empty_middle:
        raise ValueError(f"pipeline_parallel: stages {empty_middle} would hold no layer (only the first and the "
                         f"last stage, with the embeddings or the head, may)")
    return counts


def _groups(mesh_or_group, data_parallel):
    """(pp group, the DeviceMesh's "dp" sub-mesh or None, the 2-D mesh or None) from a process
    group (None: the default one), a 1-D mesh or a 2-D ("pp", "dp") mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh_or_group, DeviceMesh):
        import torch.distributed as dist

        if data_parallel is not None:
            raise ValueError("pipeline_parallel: data_parallel needs a 2-D DeviceMesh with dims ('pp', 'dp')")
        return (dist.group.WORLD if mesh_or_group is None else mesh_or_group), None, None
    if mesh_or_group.ndim == 1:
        if data_parallel is not None:
            raise ValueError("pipeline_parallel: data_parallel needs a 2-D DeviceMesh with dims ('pp', 'dp'), "
                             "got a 1-D mesh")
        return mesh_or_group.get_group(), None, None
    names = mesh_or_group.mesh_dim_names or ()
    if mesh_or_group.ndim != 2 or set(names) != {"pp", "dp"}:
        raise ValueError(f"pipeline_parallel: a 2-D mesh must name its dims ('pp', 'dp'), got {names}")
    if data_parallel is None:
        raise ValueError("pipeline_parallel: a ('pp', 'dp') mesh needs data_parallel='ddp' or 'fsdp2'")
    return mesh_or_group["pp"].get_group(), mesh_or_group["dp"], mesh_or_group


def _tied_group(mesh, pp_group, n_pp: int):
    """The group of the first and the last pipeline rank that hold this rank's data-parallel
    part (None on the other ranks). new_group is collective over the whole world: every rank
    creates every pair's group (a process group given as the pipeline group must then span the
    world, unless it has 2 ranks: it is the pair)."""
    import torch.distributed as dist

    if mesh is None:
        if n_pp == 2:
            return pp_group
        pair = [dist.get_global_rank(pp_group, 0), dist.get_global_rank(pp_group, n_pp - 1)]
        group = dist.new_group(pair)
        return group if dist.get_rank() in pair else None
    pp_dim = mesh.mesh_dim_names.index("pp")
    ranks = mesh.mesh if pp_dim == 0 else mesh.mesh.t()  # (pp, dp) global ranks
    mine = None
    for column in ranks.t().tolist():
        pair = [column[0], column[-1]]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine


class LanguageModelPipeline:
    """What pipeline_parallel returns: this rank's stage modules (`stages`, in stage order) and
    the schedule that runs them. `step(ids)` trains (forward and backward), `eval_loss(ids)`
    evaluates; both return the batch's loss on the rank of the last stage, None elsewhere."""

    def __init__(self, stages, modules, schedule, pp_group, dp_mesh, tied_group, n_microbatches: int):
        self.stages = stages  # LanguageModelStage modules (FSDP2-sharded in place where asked)
        self.modules = modules  # what the PipelineStages run: the stages, or their DDP wrappers
        self.schedule = schedule
        self.pp_group, self.dp_mesh, self.tied_group = pp_group, dp_mesh, tied_group
        self.n_microbatches = n_microbatches
        self.is_first = any(s.is_first for s in stages)
        self.is_last = any(s.is_last for s in stages)

    def named_parameters(self):
        """This rank's parameters under the model's names (the last stage's tied head as
        "head.weight"), each once."""
        seen = set()
        for stage in self.stages:
            for name, param in stage.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def parameters(self):
        return (param for _, param in self.named_parameters())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for stage in self.stages:
            stage.zero_grad(set_to_none=set_to_none)

    def kernel_scope(self):
        return self.stages[0].kernel_scope()

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.dim() != 2 or ids.shape[1] < 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"LanguageModelPipeline: ids must be (batch, seq >= 2) int64/int32 token ids, got shape "
                             f"{tuple(ids.shape)} of {ids.dtype}")
        if ids.shape[0] % self.n_microbatches:
            raise ValueError(f"LanguageModelPipeline: a batch of {ids.shape[0]} sequences does not split into "
                             f"{self.n_microbatches} equal micro-batches (the loss would weigh them unevenly)")
        if ids.shape[1] - 1 > self.stages[0].config.max_seq_len:
            raise ValueError(f"LanguageModelPipeline: {ids.shape[1] - 1} positions exceed max_seq_len "
                             f"{self.stages[0].config.max_seq_len}")

    def _run(self, ids: torch.Tensor, train: bool):
        self._check_ids(ids)
        # every rank passes its ids: only the first stage reads the inputs, only the last the targets.
        # Contiguous: torch 2.11's pipelining compares a micro-batch's strides with the stage's
        # expected input, (T - 1, 1), and a slice of the (B, T) ids has (T, 1)
        args = (ids[:, :-1].contiguous(),) if self.is_first else ()
        target = ids[:, 1:].contiguous() if self.is_last else None
        losses: list = []
        with self.kernel_scope():
            if train:
                self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
            else:
                with torch.no_grad():
                    self.schedule.eval(*args, target=target, losses=losses)
        if not self.is_last:
            return None
        loss = torch.stack([l.detach() for l in losses]).mean()  # equal micro-batches: the batch's mean
        if self.dp_mesh is not None:
            import torch.distributed as dist

            dist.all_reduce(loss, group=self.dp_mesh.get_group())  # equal dp parts: the global batch's mean
            loss = loss / self.dp_mesh.size()
        return loss

    def step(self, ids: torch.Tensor) -> Optional[torch.Tensor]:
        """Forward and backward of ids (B, T) (with data parallelism, this dp rank's part) through
        the schedule, the gradients added to this rank's parameters' .grad; the mean next-token
        loss (detached) on the last stage's rank, None elsewhere."""
        # the schedule divides every .grad of its stages by the micro-batch count after the
        # backward, the earlier steps' gradients too: those are set aside and added back after
        earlier = {param: param.grad for param in self.parameters()}
        for param in earlier:
            param.grad = None
        loss = self._run(ids, train=True)
        self._sum_tied_gradient()
        for param, grad in earlier.items():
            if grad is not None:
                param.grad = grad if param.grad is None else param.grad + grad
        return loss

    def eval_loss(self, ids: torch.Tensor) -> Optional[torch.Tensor]:
        """The mean next-token loss of ids (B, T), forward only; None off the last stage's rank."""
        return self._run(ids, train=False)

    def _sum_tied_gradient(self) -> None:
        if self.tied_group is None:
            return
        import torch.distributed as dist

        stage = self.stages[0] if self.is_first else self.stages[-1]
        param = stage.tok_emb.weight if self.is_first else stage.head.weight
        if param.grad is None:  # a stage whose backward did not run: nothing to pair
            param.grad = torch.zeros_like(param)
        # with FSDP2 both copies are sharded alike over the same dp size: the local shards pair up
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        dist.all_reduce(grad, group=self.tied_group)


def _wrap_data_parallel(stage, dp_mesh, data_parallel):
    if data_parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in stage.layers.values():
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(stage, mesh=dp_mesh)
        return stage
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(stage, process_group=dp_mesh.get_group())


def pipeline_parallel(model, mesh_or_group, n_microbatches: int, schedule: str = "1f1b", *,
                      stage_layers: Optional[Sequence[int]] = None, stages_per_rank: Optional[int] = None,
                      data_parallel: Optional[str] = None) -> LanguageModelPipeline:
    """Split `model` (a LanguageModel, the same on every rank) into pipeline stages over
    `mesh_or_group` (a process group, a 1-D DeviceMesh, or a 2-D DeviceMesh with dims ("pp",
    "dp") and `data_parallel` "ddp" or "fsdp2") and return this rank's LanguageModelPipeline
    (module docstring). schedule: "gpipe", "1f1b" or "interleaved-1f1b" (stages_per_rank stages
    on each rank, 2 by default, stage s on pipeline rank s % ranks); n_microbatches must divide
    each batch that step and eval_loss get. stage_layers: layers per stage (all stages, in order)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline_parallel: schedule must be one of {SCHEDULES}, got {schedule!r}")
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"pipeline_parallel: data_parallel must be one of {DATA_PARALLEL}, got {data_parallel!r}")
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"pipeline_parallel: n_microbatches must be a positive int, got {n_microbatches!r}")
    if model.level == FASTEST:
        raise ValueError("pipeline_parallel: the 'fastest' level's CUDA graphs reuse a call's outputs at the next "
                         "call, which the schedule's held micro-batches cannot allow; pick another level")
    interleaved = schedule == "interleaved-1f1b"
    if stages_per_rank is None:
        stages_per_rank = 2 if interleaved else 1
    if interleaved and stages_per_rank < 2 or not interleaved and stages_per_rank != 1:
        raise ValueError(f"pipeline_parallel: schedule {schedule!r} runs "
                         f"{'2 or more stages' if interleaved else 'one stage'} a rank, got stages_per_rank="
                         f"{stages_per_rank}")
    pp_group, dp_mesh, mesh2d = _groups(mesh_or_group, data_parallel)
    n_pp, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    n_stages = n_pp * stages_per_rank
    n_layers = model.config.n_layers
    counts = (balanced_split(n_layers, n_stages) if stage_layers is None
              else _check_stage_layers(stage_layers, n_layers, n_stages))
    starts = [sum(counts[:i]) for i in range(n_stages)]
    device = model.tok_emb.weight.device
    # read before FSDP2 replaces the stages' parameters (and so unties the model's two names)
    tied = model.head.weight is model.tok_emb.weight and n_pp > 1
    stages, modules, pipeline_stages = [], [], []
    for index in range(pp_rank, n_stages, n_pp):  # this rank's stages, in order (the interleaved placement)
        stage = LanguageModelStage(model, range(starts[index], starts[index] + counts[index]),
                                   is_first=index == 0, is_last=index == n_stages - 1)
        module = stage if data_parallel is None else _wrap_data_parallel(stage, dp_mesh, data_parallel)
        stages.append(stage)
        modules.append(module)
        pipeline_stages.append(PipelineStage(module, index, n_stages, device, group=pp_group))
    # the loss on the last stage's logits, at the model's level: the last stage of the pipeline
    # is this rank's last stage module (only it calls the loss)
    loss_fn = stages[-1].loss_from_logits
    if interleaved:
        runner = ScheduleInterleaved1F1B(pipeline_stages, n_microbatches, loss_fn=loss_fn)
    else:
        runner = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(pipeline_stages[0], n_microbatches,
                                                                          loss_fn=loss_fn)
    tied_group = _tied_group(mesh2d, pp_group, n_pp) if tied else None
    return LanguageModelPipeline(stages, modules, runner, pp_group, dp_mesh, tied_group, n_microbatches)


__all__ = ["LanguageModelPipeline", "LanguageModelStage", "SCHEDULES", "balanced_split", "pipeline_parallel"]
