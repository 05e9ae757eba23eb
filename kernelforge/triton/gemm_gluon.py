"""Hopper GEMM in Gluon with warp specialization: c = a @ b, 16-bit operands (experimental).

Why a second GEMM next to gemm_kernels.gemm_tma_kernel: Triton 3.6's persistent TMA kernel
reaches 0.93-0.97x cuBLAS at 4096^3 on an H200, and no tile, stage count or programs-an-SM
closes the gap (benchmarks/results/nvidia-h200/gemm/sweep/). There the same warps issue
the TMA loads, wait for them, run the MMAs and the epilogue. Here, as cuBLAS's Hopper
kernels do, one loader warp only streams A and B tiles through a ring of shared-memory
stages (TMA, mbarrier completion), and two consumer warpgroups only multiply (async wgmma,
one group in flight) and store: a stage is handed back to the loader as soon as the MMA
that read it retires, and the loader runs ahead into the next tile while the consumers run
the epilogue, whose TMA store in turn drains under the next tile's K loop.

Work per output tile (BLOCK_M x BLOCK_N): 2 * BLOCK_M * BLOCK_N * K FLOPs; bytes: A's
BLOCK_M x K and B's K x BLOCK_N panels (from L2 for all but the first tile of a group:
GROUP_M tile rows walk one column panel of b, as gemm_kernels._tile_coordinates), c once.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernelforge.triton._launch import cdiv, launch

DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
LOADER_REGISTERS = gl.constexpr(40)  # the loader warp only computes coordinates: the rest go to the consumers


@gluon.jit
def _tile_coordinates(tile, tiles_m, tiles_n, GROUP_M: gl.constexpr):
    """(tile row, tile column) of a linear tile index, GROUP_M tile rows walked column by column
    (consecutive tiles share b's column panel in L2)."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    rows_in_group = gl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % rows_in_group, (tile % per_group) // rows_in_group


@gluon.jit
def _loader(a_desc, b_desc, a_ring, b_ring, ready, empty, tiles_m, tiles_n, k_tiles,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
            STAGES: gl.constexpr, A_M_MAJOR: gl.constexpr, B_K_MAJOR: gl.constexpr):
    """The loader warp: every (tile, K step) of this program in order, each into the next ring
    stage once the consumers have handed it back (empty), completing on its ready barrier."""
    step = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
        for kk in range(k_tiles):
            stage = step % STAGES
            # a fresh barrier counts as having completed the phase before its first: the
            # first pass over the ring does not wait
            mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(stage), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            if A_M_MAJOR:  # a^T stored (K, M) row-major, as the weight gradient's a^T @ dz reads it
                tma.async_copy_global_to_shared(a_desc, [kk * BLOCK_K, pid_m * BLOCK_M], ready.index(stage),
                                                a_ring.index(stage))
            else:
                tma.async_copy_global_to_shared(a_desc, [pid_m * BLOCK_M, kk * BLOCK_K], ready.index(stage),
                                                a_ring.index(stage))
            if B_K_MAJOR:  # b^T stored (N, K) row-major, as a Linear weight
                tma.async_copy_global_to_shared(b_desc, [pid_n * BLOCK_N, kk * BLOCK_K], ready.index(stage),
                                                b_ring.index(stage))
            else:
                tma.async_copy_global_to_shared(b_desc, [kk * BLOCK_K, pid_n * BLOCK_N], ready.index(stage),
                                                b_ring.index(stage))
            step += 1


@gluon.jit
def _consumer(c_desc, a_ring, b_ring, ready, empty, c_smem, tiles_m, tiles_n, k_tiles,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
              A_M_MAJOR: gl.constexpr, B_K_MAJOR: gl.constexpr, num_warps: gl.constexpr):
    """The consumer warpgroups: per tile, the K loop of async wgmma (one group in flight; the
    stage of the group that retired goes back to the loader), then c through shared memory
    by TMA, left draining under the next tile's K loop."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    step = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        previous = 0
        for kk in range(k_tiles):
            stage = step % STAGES
            mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
            if A_M_MAJOR:
                a = a_ring.index(stage).permute((1, 0))
            else:
                a = a_ring.index(stage)
            if B_K_MAJOR:
                b = b_ring.index(stage).permute((1, 0))
            else:
                b = b_ring.index(stage)
            acc = warpgroup_mma(a, b, acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            # the group issued one step ago has retired: its stage is free
            mbarrier.arrive(empty.index(previous), count=1, pred=kk > 0)
            previous = stage
            step += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(previous), count=1)
        tma.store_wait(0)  # the last tile's store has left c_smem
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], c_smem)
    tma.store_wait(0)


@gluon.jit
def gemm_ws_kernel(a_desc, b_desc, c_desc, M, N, K, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                   A_M_MAJOR: gl.constexpr, B_K_MAJOR: gl.constexpr, num_warps: gl.constexpr):
    """Persistent: program p takes tiles p, p + programs, ... (grouped order)."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = b_desc.block_type.shape[1] if B_K_MAJOR else b_desc.block_type.shape[0]
    dtype: gl.constexpr = a_desc.dtype
    a_ring = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=1)
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    gl.warp_specialize([
        (_consumer, (c_desc, a_ring, b_ring, ready, empty, c_smem, tiles_m, tiles_n, k_tiles, BLOCK_M, BLOCK_N,
                     GROUP_M, STAGES, A_M_MAJOR, B_K_MAJOR, num_warps)),
        (_loader, (a_desc, b_desc, a_ring, b_ring, ready, empty, tiles_m, tiles_n, k_tiles, BLOCK_M, BLOCK_N,
                   BLOCK_K, GROUP_M, STAGES, A_M_MAJOR, B_K_MAJOR)),
    ], [1], [LOADER_REGISTERS])
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(st))
        mbarrier.invalidate(empty.index(st))


def _descriptor(t: torch.Tensor, block: list) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, DTYPES[t.dtype])
    return TensorDescriptor.from_tensor(t, block, layout)


def arguments(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, block_m: int = 128, block_n: int = 256,
              block_k: int = 64, group_m: int = 8, stages: int = 3):
    """(positional arguments, constexprs) of gemm_ws_kernel for out = a @ b: a (M, K) and b (K, N)
    either way round (rows where TMA can read them so, else their transposes' rows: a Linear
    weight's transpose reads K-major), out (M, N) row-major."""
    M, K = a.shape
    N = b.shape[1]
    a_m_major = not _tma_readable(a, 1)
    b_k_major = not _tma_readable(b, 1)
    a_desc = _descriptor(a.t(), [block_k, block_m]) if a_m_major else _descriptor(a, [block_m, block_k])
    b_desc = _descriptor(b.t(), [block_n, block_k]) if b_k_major else _descriptor(b, [block_k, block_n])
    values = (a_desc, b_desc, _descriptor(out, [block_m, block_n]), M, N, K)
    return values, dict(GROUP_M=group_m, STAGES=stages, A_M_MAJOR=a_m_major, B_K_MAJOR=b_k_major, num_warps=8)


def _tma_readable(t: torch.Tensor, unit_dim: int) -> bool:
    """A 2-D t that TMA reads with dim `unit_dim` contiguous: unit stride there, 16-byte
    aligned start and rows."""
    other = 1 - unit_dim
    return (t.stride(unit_dim) == 1 and t.data_ptr() % 16 == 0 and t.stride(other) * t.element_size() % 16 == 0
            and t.stride(other) >= t.shape[unit_dim])


def takes(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, capability, sms: int, any_size: bool = False) -> bool:
    """Whether gemm_ws_kernel computes out = a @ b (a (M, K), b (K, N), out (M, N), one matrix):
    sm_90 (wgmma), 16-bit operands and output of one dtype, a and b either way round, all
    TMA-readable; and (unless any_size) enough 128 x 256 tiles to give every SM one: smaller
    products keep the Triton kernels' smaller tiles. The kernel has no epilogue: the caller
    sends plain products only."""
    if tuple(capability)[0] != 9 or a.dtype not in DTYPES or not a.dtype == b.dtype == out.dtype:
        return False
    if not ((_tma_readable(a, 1) or _tma_readable(a, 0)) and (_tma_readable(b, 1) or _tma_readable(b, 0))
            and _tma_readable(out, 1)):
        return False
    M, N = out.shape
    return any_size or cdiv(M, 128) * cdiv(N, 256) >= sms


def gemm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, sms: int, **config) -> torch.Tensor:
    """out = a @ b by gemm_ws_kernel (what `takes` accepts), `sms` persistent programs at most."""
    values, constexprs = arguments(a, b, out, **config)
    tiles = cdiv(a.shape[0], config.get("block_m", 128)) * cdiv(b.shape[1], config.get("block_n", 256))
    launch(gemm_ws_kernel, (max(1, min(sms, tiles)),), *values, **constexprs)
    return out


def gemm(a: torch.Tensor, b: torch.Tensor, sms: int, **config) -> torch.Tensor:
    """out = a @ b into a new tensor (benchmarks/gluon_gemm_experiment.py)."""
    return gemm_into(a, b, torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device), sms, **config)


def compile_for_sm90(a_m_major: bool = False, b_k_major: bool = True, **config) -> dict:
    """Registers, spills and shared memory of gemm_ws_kernel built for sm_90a (no GPU needed)."""
    from kernelforge.triton.attention_gluon import sm90_usage
    a = torch.zeros(512, 512, dtype=torch.bfloat16)
    b = torch.zeros(512, 512, dtype=torch.bfloat16)
    return sm90_usage(gemm_ws_kernel, *arguments(a.t() if a_m_major else a, b.t() if b_k_major else b,
                                                 torch.zeros_like(a), **config))
