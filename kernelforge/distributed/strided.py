"""A whole tensor from a _StridedShard DTensor and back, without DTensor's redistribution.

tensor_parallel's fused column-wise weights (QKV: [q | k | v]; [gate | up]) are _StridedShard(0,
split_factor) DTensors: the weight cut into split_factor blocks along dim 0, each rank holding its
chunk of every block, one after the other (and FSDP2 over TP shards them further over dp, on dim
1: (Shard(1), _StridedShard(0, 3)) on the 2-D mesh). torch 2.11's redistribution cannot plan the
gather of such a placement (full_tensor() raises "use_strided_shard_as_shard_order is True, but
placements ... is unable to be interpreted into a corresponding shard_order"), on a 1-D mesh or a
2-D one; later releases can. The layout is simple enough to gather by hand: mesh dim by mesh dim,
the last first, one all_gather of the local tensors each, the blocks put back in order. Any other
DTensor goes through torch's own full_tensor() / distribute_tensor().

    full = full_tensor(model.layers[0].attn.qkv.weight)          # (3C, C) on every rank
    again = distribute_like(full, model.layers[0].attn.qkv.weight)
"""
from __future__ import annotations

import torch

from kernelforge.ops._common import is_dtensor


def _strided_1d(t):
    """(dim, split_factor) of a 1-D-mesh DTensor placed as _StridedShard with even chunks, else None."""
    layout = _gather_plan(t)
    if layout is None or t.device_mesh.ndim != 1:
        return None
    return layout[0][1:]


def _gather_plan(t):
    """[(mesh dim, tensor dim, split factor)] of a DTensor with a _StridedShard placement whose
    chunks are even and whose tensor dims are each split over one mesh dim at most (Replicate mesh
    dims left out; a plain Shard's split factor 1); None for any other tensor."""
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    if not is_dtensor(t) or not any(isinstance(p, _StridedShard) for p in t.placements):
        return None
    plan = []
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)) or placement.dim in {dim for _, dim, _ in plan}:
            return None  # a Partial, or two mesh dims splitting one tensor dim: torch's own gather
        factor = placement.split_factor if isinstance(placement, _StridedShard) else 1
        if t.shape[placement.dim] % (factor * t.device_mesh.size(mesh_dim)):
            return None  # uneven chunks
        plan.append((mesh_dim, placement.dim, factor))
    return plan


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor on every rank (detached); a plain tensor as it is."""
    if not is_dtensor(t):
        return t
    plan = _gather_plan(t)
    if plan is None:
        return t.detach().full_tensor()
    import torch.distributed as dist

    local = t.detach().to_local()
    for mesh_dim, dim, split_factor in reversed(plan):  # the last split undone first
        local = local.contiguous()
        gathered = [torch.empty_like(local) for _ in range(t.device_mesh.size(mesh_dim))]
        dist.all_gather(gathered, local, group=t.device_mesh.get_group(mesh_dim))
        pieces = [rank_part.chunk(split_factor, dim) for rank_part in gathered]  # [rank][block]
        local = torch.cat([pieces[rank][block] for block in range(split_factor) for rank in range(len(gathered))],
                          dim)
    return local


def distribute_like(full: torch.Tensor, like) -> torch.Tensor:
    """`full` (the same on every rank) as a DTensor placed as `like` is."""
    strided = _strided_1d(like)
    if strided is None:
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full, like.device_mesh, like.placements)
    from torch.distributed.tensor import DTensor

    dim, split_factor = strided
    mesh = like.device_mesh
    rank = mesh.get_local_rank()
    local = torch.cat([block.chunk(mesh.size(), dim)[rank] for block in full.chunk(split_factor, dim)], dim)
    return DTensor.from_local(local.contiguous(), mesh, like.placements, run_check=False, shape=full.shape,
                              stride=full.stride())


__all__ = ["distribute_like", "full_tensor"]
