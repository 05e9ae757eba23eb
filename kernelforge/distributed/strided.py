"""A whole tensor from a _StridedShard DTensor and back, on a 1-D mesh, without DTensor's
redistribution.

tensor_parallel's fused column-wise weights (QKV: [q | k | v]; [gate | up]) are _StridedShard(0,
split_factor) DTensors: the weight cut into split_factor blocks along dim 0, each rank holding its
chunk of every block, one after the other. torch 2.11's redistribution cannot plan the gather of
such a placement on a 1-D mesh (full_tensor() raises "use_strided_shard_as_shard_order is True,
but placements ... is unable to be interpreted into a corresponding shard_order"); later releases
can. The layout is simple enough to gather by hand: one all_gather of the local tensors, then the
blocks put back in order. Any other DTensor goes through torch's own full_tensor() /
distribute_tensor().

    full = full_tensor(model.layers[0].attn.qkv.weight)          # (3C, C) on every rank
    again = distribute_like(full, model.layers[0].attn.qkv.weight)
"""
from __future__ import annotations

import torch

from kernelforge.ops._common import is_dtensor


def _strided_1d(t):
    """(dim, split_factor) of a 1-D-mesh DTensor placed as _StridedShard with even chunks, else None."""
    from torch.distributed.tensor.placement_types import _StridedShard

    if not is_dtensor(t) or t.device_mesh.ndim != 1 or not isinstance(t.placements[0], _StridedShard):
        return None
    placement, ranks = t.placements[0], t.device_mesh.size()
    if t.shape[placement.dim] % (placement.split_factor * ranks):
        return None  # uneven chunks: torch's own gather
    return placement.dim, placement.split_factor


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor on every rank (detached); a plain tensor as it is."""
    if not is_dtensor(t):
        return t
    strided = _strided_1d(t)
    if strided is None:
        return t.detach().full_tensor()
    import torch.distributed as dist

    dim, split_factor = strided
    local = t.detach().to_local().contiguous()
    gathered = [torch.empty_like(local) for _ in range(t.device_mesh.size())]
    dist.all_gather(gathered, local, group=t.device_mesh.get_group())
    pieces = [rank_part.chunk(split_factor, dim) for rank_part in gathered]  # [rank][block]
    return torch.cat([pieces[rank][block] for block in range(split_factor) for rank in range(len(gathered))], dim)


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
