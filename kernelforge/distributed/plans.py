"""Plans that parallelize the example LanguageModel (kernelforge.models.LanguageModel), kept apart
from the model as TorchTitan keeps its plans, on torch.distributed's own APIs.

    mesh = init_device_mesh("cuda", (world_size,))
    tensor_parallel(model, mesh, sequence_parallel=True)    # in place; model.loss(ids) as before
    ddp = data_parallel(model, "ddp")                      # ddp.loss(ids), ddp(ids)
    data_parallel(model, "fsdp2")                          # in place; model.loss(ids) as before

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))   # FSDP2 x TP
    tensor_parallel(model, mesh["tp"])                     # or the 2-D mesh: its "tp" dimension
    data_parallel(model, "fsdp2", mesh=mesh)               # or mesh["dp"]

tensor_parallel: torch.distributed.tensor.parallel.parallelize_module with a plan per block, the
parameters DTensors on the 1-D `mesh`:
  - the attention's fused QKV projection column-wise by heads: its weight (3C, C) is [q | k | v],
    so each rank holds its heads' rows of each of the three (a _StridedShard(0, split_factor=3)
    placement: full_tensor() is the weight as the model holds it), and the block's attention runs
    on the rank's heads as plain tensors (`num_heads` of each SelfAttention set to the local count,
    as torch's TP tutorial does: the model views the QKV output with it);
  - the MLP's fused [gate | up] GEMM likewise (split_factor=2; swiglu on the rank's columns), the
    output projection and the MLP's down projection row-wise (kernelforge's gemm rule gives a
    Partial output, reduced to Replicate, or scattered to Shard(1) with sequence parallelism);
  - the token and position embeddings row-wise (vocabulary / positions sharded), the head
    column-wise on the same (tied) vocabulary-sharded weight, its logits gathered (Replicate):
    kernelforge's cross_entropy rule never shards the classes;
  - sequence_parallel: the norms (and norm2's fused add + norm) on Shard(1) DTensor activations
    (SequenceParallel), where kernelforge's registered row-op rules run them on each rank's rows;
    the residual stream stays a Shard(1) DTensor between blocks.
Generation (model.generate) runs tensor-parallel without sequence parallelism: each rank's KV cache
holds its heads (new_cache follows the attention modules' head count), the logits come replicated,
so every rank samples the same tokens (greedy, or with the same generator seed).

data_parallel: "ddp" wraps the model in DistributedDataParallel (a DistributedLanguageModel, with
`loss` running through DDP's forward, so its gradients are averaged); "fsdp2" applies
torch.distributed.fsdp.fully_shard to each block, then to the root (with `loss` registered as a
forward method, so the root's parameters are gathered for it). On a tensor-parallel model only
"fsdp2" composes (as TorchTitan's FSDP2 x TP): `mesh` the 2-D (dp, tp) mesh or its "dp" sub-mesh,
fully_shard sharding each TP DTensor parameter further over dp (a 2-D DTensor on the mesh; the
fused QKV and [gate | up] weights on their columns, whose rows are strided blocks already). DDP
refuses a tensor-parallel model: torch's DDP x TP path swaps the DTensor parameters for local
tensors around every forward, which unties the tied embedding and head.
"""
from __future__ import annotations

from torch import nn

from kernelforge.ops._common import is_dtensor


def _linear_types():
    from kernelforge.models.transformer import Linear

    return (nn.Linear, Linear)


def _styles():
    """Torch's ColwiseParallel / RowwiseParallel taking kernelforge's Linear (the same (out, in)
    weight as nn.Linear; torch's styles accept nn.Linear and nn.Embedding only), and the fused
    column-wise style. Built here: torch.distributed may be unavailable at import."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, ParallelStyle
    from torch.distributed.tensor.placement_types import _StridedShard
    from functools import partial

    class Colwise(ColwiseParallel):
        def _apply(self, module, device_mesh):
            if not isinstance(module, _linear_types()):
                return super()._apply(module, device_mesh)
            return distribute_module(module, device_mesh, self._partition_linear_fn,
                                     partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                     partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    class Rowwise(RowwiseParallel):
        def _apply(self, module, device_mesh):
            if not isinstance(module, _linear_types()):
                return super()._apply(module, device_mesh)
            self.desired_input_layouts = (Shard(-1),)
            return distribute_module(module, device_mesh, self._partition_linear_fn,
                                     partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                     partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    class FusedColwise(ParallelStyle):
        """A kernelforge Linear whose output is `chunks` blocks side by side (QKV: 3, [gate | up]:
        2), each split column-wise over the mesh: the weight (and bias) a DTensor
        _StridedShard(0, split_factor=chunks), so that a rank's rows are its part of each block.
        The GEMM runs on the local weight; the input (a plain tensor laid out as `input_layout`, or
        a DTensor) is gathered to Replicate, its gradient a Partial sum reduced back to that layout;
        the output is the rank's local columns, [block 0's | block 1's | ...]."""

        def __init__(self, chunks: int, input_layout=None):
            super().__init__()
            self.chunks, self.input_layout = chunks, input_layout or Replicate()

        def _apply(self, module, device_mesh):
            placement = _StridedShard(0, split_factor=self.chunks)
            for name, param in list(module.named_parameters(recurse=False)):
                if param.shape[0] % (self.chunks * device_mesh.size()):
                    raise ValueError(f"FusedColwise: {name} has {param.shape[0]} rows, not {self.chunks} blocks "
                                     f"that split evenly over {device_mesh.size()} ranks")
                module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [placement]),
                                                             requires_grad=param.requires_grad))
            input_layout = self.input_layout

            def forward(x):
                if not isinstance(x, DTensor):
                    x = DTensor.from_local(x, device_mesh, [input_layout], run_check=False)
                x = x.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
                bias = module.bias.to_local() if module.bias is not None else None
                return module.kernels.ops.linear(x, module.weight.to_local(), bias, module.activation)

            module.forward = forward  # the module's own forward, on the local weight
            return module

    return Colwise, Rowwise, FusedColwise


def _sub_mesh(mesh, name: str, caller: str):
    """`mesh` if 1-D, else its dimension `name` (a mesh of named dimensions, e.g. ("dp", "tp"))."""
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 2 and name in names:
        return mesh[name]
    raise ValueError(f"{caller}: mesh must be 1-D or 2-D with a {name!r} dimension (mesh_dim_names=('dp', 'tp')), "
                     f"got a {mesh.ndim}-D mesh named {names}")


def _tensor_parallel_mesh(model):
    """The mesh of a tensor-parallel model's DTensor parameters; None if none is a DTensor."""
    from torch.distributed.tensor import DTensor

    return next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)


def tensor_parallel(model, mesh, sequence_parallel: bool = False):
    """Tensor-parallelize `model` (a LanguageModel) in place over `mesh`: 1-D, or 2-D with a "tp"
    dimension (that one) (module docstring); returns it. Every rank must pass the same model (same
    seed): each keeps its shards of it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    mesh = _sub_mesh(mesh, "tp", "tensor_parallel")
    Colwise, Rowwise, FusedColwise = _styles()
    tp = mesh.size()
    cfg = model.config
    if cfg.n_heads % tp:
        raise ValueError(f"tensor_parallel: {cfg.n_heads} heads do not split over {tp} ranks")
    tied = model.head.weight is model.tok_emb.weight
    sp = sequence_parallel
    # the residual stream: replicated plain tensors, or (sequence parallel) Shard(1) DTensors
    stream = dict(output_layouts=Shard(1), use_local_output=False) if sp else dict(output_layouts=Replicate())
    block_input = Shard(1) if sp else Replicate()
    for layer in model.layers:
        plan = {
            "attn.qkv": FusedColwise(3, block_input),
            "attn.proj": Rowwise(**stream),
            "mlp.fc1": FusedColwise(2 if layer.mlp.kind == "swiglu" else 1, block_input),
            "mlp.fc2": Rowwise(**stream),
        }
        if sp:
            plan.update({"norm1": SequenceParallel(), "norm2": SequenceParallel()})
        parallelize_module(layer, mesh, plan)
        layer.attn.num_heads //= tp  # the rank's heads: the model views the QKV output with it
    plan = {
        "tok_emb": Rowwise(input_layouts=Replicate(), **stream),
        # positions (T,) -> (T, C): the sequence is dim 0 here, broadcast over the batch after
        "pos_emb": Rowwise(input_layouts=Replicate(),
                           **(dict(output_layouts=Shard(0), use_local_output=False) if sp else stream)),
        "head": Colwise(input_layouts=block_input, output_layouts=Replicate(), use_local_output=True),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    parallelize_module(model, mesh, plan)
    if tied:  # both vocabulary-sharded Shard(0): one parameter again
        model.head.weight = model.tok_emb.weight
    return model


class _Methods(nn.Module):
    """The model's methods through one forward (DDP reduces the gradients of what its forward ran)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, method, *inputs):
        return self.model.run(method, *inputs)


def _ddp_class():
    from torch.nn.parallel import DistributedDataParallel

    class DistributedLanguageModel(DistributedDataParallel):
        """DDP over a LanguageModel: `self(ids)` the logits, `loss(ids)` the loss, both through DDP's
        forward; `model` the wrapped LanguageModel."""

        def __init__(self, model, **kwargs):
            super().__init__(_Methods(model), **kwargs)

        @property
        def model(self):
            return self.module.model

        def forward(self, *inputs):
            return super().forward("compute", *inputs)

        def loss(self, ids):
            return super().forward("compute_loss", ids)

        def kernel_scope(self):
            return self.module.model.kernel_scope()

    return DistributedLanguageModel


def _fsdp_placement_over_tp(param):
    """FSDP2's placement over dp of a tensor-parallel parameter: dim 1 for the fused column-wise
    weights (QKV, [gate | up]), whose rank rows are its part of each block: dim-0 chunks of those
    would cut across the blocks, a layout no DTensor placement describes (full_tensor() and the
    checkpoints would read it wrong); None (FSDP's default, dim 0) for the others."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(param, DTensor) and any(isinstance(p, _StridedShard) for p in param.placements):
        return Shard(1)
    return None


def data_parallel(model, mode: str = "ddp", mesh=None, **kwargs):
    """Data-parallelize `model` (a LanguageModel): mode "ddp" returns a DistributedLanguageModel
    (DDP, its gradients views of its buckets unless gradient_as_bucket_view=False is passed; `mesh`,
    if given, the mesh whose group it uses); "fsdp2" shards it in place (fully_shard
    on each block, then the root, over `mesh` or the default group's) and returns it. `mesh`: 1-D,
    or 2-D with a "dp" dimension (that one is used). A tensor-parallel model (tensor_parallel
    first) takes "fsdp2" only, with the dp mesh given (module docstring). kwargs go to DDP or
    fully_shard."""
    if mode not in ("ddp", "fsdp2"):
        raise ValueError(f"data_parallel: mode must be 'ddp' or 'fsdp2', got {mode!r}")
    if mesh is not None:
        mesh = _sub_mesh(mesh, "dp", "data_parallel")
    tp_mesh = _tensor_parallel_mesh(model)
    if tp_mesh is not None:
        if mode == "ddp":
            raise ValueError("data_parallel: DDP over a tensor-parallel model is not supported (torch's DDP x TP "
                             "unties the tied embedding and head); use mode 'fsdp2' with the (dp, tp) mesh")
        if mesh is None or mesh == tp_mesh:
            raise ValueError("data_parallel: the model is tensor-parallel: pass mesh, the 2-D (dp, tp) mesh or its "
                             "'dp' sub-mesh (not the tp mesh and not the default group's)")
    if mode == "ddp":
        if mesh is not None:
            kwargs.setdefault("process_group", mesh.get_group())
        # the gradients views of DDP's all-reduce buckets: no copy of every bucket into them after
        # its all-reduce (51 copies a step of the 8-layer LM, launched by the host while the device
        # waited) and one gradient-sized buffer less
        kwargs.setdefault("gradient_as_bucket_view", True)
        return _ddp_class()(model, **kwargs)
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if mesh is not None:
        kwargs.setdefault("mesh", mesh)
    if tp_mesh is not None:
        kwargs.setdefault("shard_placement_fn", _fsdp_placement_over_tp)
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    register_fsdp_forward_method(model, "loss")  # the root's parameters gathered for loss too
    return model


def optimizer_groups(parameters, **options) -> list[dict]:
    """`parameters` as torch.optim parameter groups: the DTensors in one, the plain tensors in the
    other (empty groups left out), each with `options`. Why: torch.optim's foreach kernels, the
    default on CUDA, take a group's tensors in one call and refuse a mix of DTensors and plain
    tensors, and a tensor-parallel model without sequence parallelism keeps its norms' weights
    plain (replicated activations, replicated gradients). Two groups, one call each.

        optimizer = torch.optim.AdamW(optimizer_groups(model.parameters()), lr=3e-4)
    """
    params = list(parameters)
    groups = [[p for p in params if is_dtensor(p)], [p for p in params if not is_dtensor(p)]]
    return [dict(params=group, **options) for group in groups if group]


__all__ = ["data_parallel", "optimizer_groups", "tensor_parallel"]
