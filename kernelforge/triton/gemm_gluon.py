"""Hopper GEMM in Gluon with warp specialization: c = act(a @ b * scales + bias) + residual,
16-bit or e4m3 operands, one matrix.

Why a second GEMM next to gemm_kernels.gemm_tma_kernel: Triton 3.6's persistent TMA kernel
reaches 0.93-0.97x cuBLAS at 4096^3 on an H200 (bf16), 0.79-0.85x torch._scaled_mm for fp8
with cuBLAS's float32 promotion, and no tile, stage count or programs-an-SM closes the gap
(benchmarks/results/nvidia-h200/gemm/sweep/). There the same warps issue the TMA loads, wait
for them, run the MMAs and the epilogue. Here, as cuBLAS's Hopper kernels do, one loader warp
only streams A and B tiles through a ring of shared-memory stages (TMA, mbarrier completion),
and two consumer warpgroups only multiply (async wgmma) and run the epilogue: a stage is
handed back to the loader as soon as the MMA that read it retires, and the loader runs ahead
into the next tile while the consumers run the epilogue, whose TMA store in turn drains
under the next tile's K loop. For fp8 the consumers add each K tile's partial product into a
float32 accumulator while the tensor cores compute the next one (_accumulate_promoted).

Work per output tile (BLOCK_M x BLOCK_N): 2 * BLOCK_M * BLOCK_N * K FLOPs; bytes: A's
BLOCK_M x K and B's K x BLOCK_N panels (from L2 for all but the first tile of a group:
GROUP_M tile rows walk one column panel of b, as gemm_kernels._tile_coordinates), c once;
with the epilogue + BLOCK_N of bias, + BLOCK_M + BLOCK_N scales (fp8), + the residual tile
read and the pre-activation tile written (the backward's act' input).
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernelforge.triton._launch import arrival_counts, cdiv, launch
from kernelforge.triton.gemm_kernels import _bias_activation, _dequantized, _tile_coordinates

FP8 = torch.float8_e4m3fn
DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, FP8: gl.float8e4nv, torch.float32: gl.float32}
OPERAND_DTYPES = (torch.bfloat16, torch.float16, FP8)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # of e4m3 products
SHARED_BYTES = 227 * 1024 - 1024  # what one program may take on an H100 / H200, less the barriers
LOADER_REGISTERS = gl.constexpr(40)  # the loader warp only computes coordinates: the rest go to the consumers
STREAM_K = None  # None: stream_k_plan's rule; False: whole tiles only; True: stream-K wherever the tiles leave SMs idle
# The rule's bound: stream-K where the last wave of whole tiles leaves more than a tenth of the
# SMs idle. A split tile costs its partial's float32 write and read (128 KB each at 128 x 256)
# on the way to its epilogue, so a nearly full last wave gains less than it costs.
STREAM_K_MAX_TAIL = 0.9


@gluon.jit
def _stream_k_start(program, programs, sk_iters):
    """The first stream-K iteration of `program`: the sk_iters (tile, K step) iterations of the
    stream-K tiles, in order, split into `programs` ranges whose lengths differ by one at most."""
    return (program.to(gl.int64) * sk_iters // programs).to(gl.int32)


@gluon.jit
def _stream_k_pieces(k_tiles, sk_iters):
    """(first iteration, end, last tile, pieces) of this program's stream-K range: it covers the
    end of one tile, whole tiles, the start of another (pieces: the tiles it touches). Both
    partitions walk the pieces last tile first, so a program's piece that leaves a partial for
    another (the start of a tile, which ends in a later program's range) comes before its own
    pieces, and the program that ends a tile sums it last: peers' partials are ready by then."""
    program = gl.program_id(0)
    programs = gl.num_programs(0)
    start = _stream_k_start(program, programs, sk_iters)
    end = _stream_k_start(program + 1, programs, sk_iters)  # > start: stream_k_plan keeps sk_iters >= programs
    last_tile = (end - 1) // k_tiles
    return start, end, last_tile, last_tile - start // k_tiles + 1


@gluon.jit
def _load_k_steps(a_desc, b_desc, a_ring, b_ring, ready, empty, step, pid_m, pid_n, k_begin, k_end,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                  A_M_MAJOR: gl.constexpr, B_K_MAJOR: gl.constexpr):
    """K steps [k_begin, k_end) of one tile, each into the next ring stage once the consumers
    have handed it back (empty), completing on its ready barrier; returns the next step."""
    for kk in range(k_begin, k_end):
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
    return step


@gluon.jit
def _loader(a_desc, b_desc, a_ring, b_ring, ready, empty, tiles_m, tiles_n, k_tiles, dp_tiles, sk_iters,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
            STAGES: gl.constexpr, A_M_MAJOR: gl.constexpr, B_K_MAJOR: gl.constexpr, STREAM_K: gl.constexpr):
    """The loader warp: the K steps of this program's work in the consumers' order (its whole
    tiles, then its stream-K pieces), through the ring."""
    step = 0
    for tile in range(gl.program_id(0), dp_tiles, gl.num_programs(0)):
        _, pid_m, pid_n = _tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
        step = _load_k_steps(a_desc, b_desc, a_ring, b_ring, ready, empty, step, pid_m, pid_n, 0, k_tiles,
                             BLOCK_M, BLOCK_N, BLOCK_K, STAGES, A_M_MAJOR, B_K_MAJOR)
    if STREAM_K:
        start, end, last_tile, pieces = _stream_k_pieces(k_tiles, sk_iters)
        for i in range(pieces):
            t = last_tile - i
            _, pid_m, pid_n = _tile_coordinates(dp_tiles + t, tiles_m, tiles_n, GROUP_M)
            step = _load_k_steps(a_desc, b_desc, a_ring, b_ring, ready, empty, step, pid_m, pid_n,
                                 gl.maximum(start - t * k_tiles, 0), gl.minimum(end - t * k_tiles, k_tiles),
                                 BLOCK_M, BLOCK_N, BLOCK_K, STAGES, A_M_MAJOR, B_K_MAJOR)


@gluon.jit
def _operands(a_ring, b_ring, stage, A_M_MAJOR: gl.constexpr, B_K_MAJOR: gl.constexpr):
    """The shared-memory views of one ring stage as (BLOCK_M, BLOCK_K) and (BLOCK_K, BLOCK_N)."""
    if A_M_MAJOR:
        a = a_ring.index(stage).permute((1, 0))
    else:
        a = a_ring.index(stage)
    if B_K_MAJOR:
        b = b_ring.index(stage).permute((1, 0))
    else:
        b = b_ring.index(stage)
    return a, b


@gluon.jit
def _accumulate(a_ring, b_ring, ready, empty, step, k_tiles, acc_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, A_M_MAJOR: gl.constexpr, B_K_MAJOR: gl.constexpr):
    """(a @ b of one tile in float32, the next step): async wgmma into one accumulator, one
    group in flight; the stage of the group that retired goes back to the loader."""
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    previous = 0
    for kk in range(k_tiles):
        stage = step % STAGES
        mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
        a, b = _operands(a_ring, b_ring, stage, A_M_MAJOR, B_K_MAJOR)
        acc = warpgroup_mma(a, b, acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        # the group issued one step ago has retired: its stage is free
        mbarrier.arrive(empty.index(previous), count=1, pred=kk > 0)
        previous = stage
        step += 1
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index(previous), count=1)
    return acc, step


@gluon.jit
def _issue_partial(a_ring, b_ring, ready, step, partial, STAGES: gl.constexpr, A_M_MAJOR: gl.constexpr,
                   B_K_MAJOR: gl.constexpr):
    """The products of ring step `step` into `partial` (its old value ignored), asynchronously."""
    stage = step % STAGES
    mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
    a, b = _operands(a_ring, b_ring, stage, A_M_MAJOR, B_K_MAJOR)
    return warpgroup_mma(a, b, partial, use_acc=False, is_async=True)


@gluon.jit
def _promote(acc, partial, empty, step, STAGES: gl.constexpr, PENDING: gl.constexpr):
    """(acc + the partial of ring step `step` once its group retired (PENDING newer groups may
    stay in flight), that partial's registers for the next MMA); its stage goes back to the
    loader."""
    partial = warpgroup_mma_wait(PENDING, deps=(partial,))
    mbarrier.arrive(empty.index(step % STAGES), count=1)
    return acc + partial, partial


@gluon.jit
def _sum_of(acc, partial, empty, step, STAGES: gl.constexpr, PENDING: gl.constexpr):
    """_promote's sum alone (the partial is not needed again)."""
    total, _ = _promote(acc, partial, empty, step, STAGES, PENDING)
    return total


@gluon.jit
def _accumulate_promoted(a_ring, b_ring, ready, empty, step, k_tiles, acc_layout: gl.constexpr,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         A_M_MAJOR: gl.constexpr, B_K_MAJOR: gl.constexpr):
    """_accumulate for e4m3 at cuBLAS's accuracy: Hopper's fp8 wgmma adds its products into
    the accumulator at reduced precision (about 14 mantissa bits), so each K tile (BLOCK_K <=
    128 products an output, cuBLAS's promotion interval) goes into a fresh partial that the
    CUDA cores add to the float32 acc. Two partials alternate, so one K tile's MMAs run while
    the last one's partial is added: the addition (one FADD an element a tile) hides under
    the tensor cores. The loop takes K tiles in pairs with fixed roles, so no in-flight
    accumulator is ever copied (a copy would make ptxas serialize the wgmmas)."""
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    even = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    odd = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    first = step
    even = _issue_partial(a_ring, b_ring, ready, step, even, STAGES, A_M_MAJOR, B_K_MAJOR)
    step += 1
    for pair in range((k_tiles - 1) // 2):  # K tiles 1 + 2i (odd) and 2 + 2i (even)
        odd = _issue_partial(a_ring, b_ring, ready, step, odd, STAGES, A_M_MAJOR, B_K_MAJOR)
        acc, even = _promote(acc, even, empty, step - 1, STAGES, 1)
        even = _issue_partial(a_ring, b_ring, ready, step + 1, even, STAGES, A_M_MAJOR, B_K_MAJOR)
        acc, odd = _promote(acc, odd, empty, step, STAGES, 1)
        step += 2
    if (step - first) < k_tiles:  # an even count of K tiles: the last one is odd
        last = _issue_partial(a_ring, b_ring, ready, step, odd, STAGES, A_M_MAJOR, B_K_MAJOR)
        acc = _sum_of(acc, even, empty, step - 1, STAGES, 1)
        acc = _sum_of(acc, last, empty, step, STAGES, 0)
        step += 1
    else:
        acc = _sum_of(acc, even, empty, step - 1, STAGES, 0)
    return acc, step


@gluon.jit
def _epilogue(acc, off_m, off_n, c_desc, c_smem, res_desc, pre_desc, res_ready, res_phase, BIAS, SA, SB, M, N,
              ssam, ssbn, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
              SAVE_PREACT: gl.constexpr, SCALED: gl.constexpr, PRECISE: gl.constexpr, BF16_OUT: gl.constexpr):
    """c = act(acc * scales + bias) + residual of one tile, out through c_smem by TMA (left
    draining: the next tile's K loop hides it). The math is gemm_kernels' own. Bytes
    beyond the product: the bias slice (BLOCK_N), the residual tile read by TMA into c_smem
    (its latency shows once a tile), the pre-activation tile written through c_smem before c
    (the backward's act' input)."""
    layout: gl.constexpr = acc.type.layout
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    if SCALED:
        offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        acc = _dequantized(acc, SA, SB, offs_m, offs_n, M, N, ssam, ssbn)
    tma.store_wait(0)  # the last tile's store has left c_smem
    if SAVE_PREACT:
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(pre_desc, [off_m, off_n], c_smem)
    z = _bias_activation(acc, BIAS, offs_n, N, ACTIVATION, HAS_BIAS, PRECISE, BF16_OUT)
    if HAS_RESIDUAL:
        tma.store_wait(0)  # the pre-activation has left c_smem
        mbarrier.expect(res_ready, res_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(res_desc, [off_m, off_n], res_ready, c_smem)
        mbarrier.wait(res_ready, res_phase)
        # each thread reads the elements it then writes: no barrier between load and store
        z = z + c_smem.load(layout).to(gl.float32)
    elif SAVE_PREACT:
        tma.store_wait(0)
    c_smem.store(z.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)


@gluon.jit
def _k_steps(a_ring, b_ring, ready, empty, step, k_steps, acc_layout: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, A_M_MAJOR: gl.constexpr, B_K_MAJOR: gl.constexpr,
             PROMOTE: gl.constexpr):
    """(the float32 product of the next k_steps ring steps, the step after them)."""
    if PROMOTE:
        acc, step = _accumulate_promoted(a_ring, b_ring, ready, empty, step, k_steps, acc_layout, BLOCK_M, BLOCK_N,
                                         STAGES, A_M_MAJOR, B_K_MAJOR)
    else:
        acc, step = _accumulate(a_ring, b_ring, ready, empty, step, k_steps, acc_layout, BLOCK_M, BLOCK_N, STAGES,
                                A_M_MAJOR, B_K_MAJOR)
    return acc, step


@gluon.jit
def _partial_pointers(acc, PARTIALS, program):
    """Pointers to `program`'s row-major float32 partial tile, in acc's layout: each warp
    writes whole 32-byte sectors (8 rows x 8 columns a register pair). Made where they are
    used: held across the K loop next to the accumulator they would spill."""
    layout: gl.constexpr = acc.type.layout
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    return PARTIALS + program * (BLOCK_M * BLOCK_N) + rows[:, None] * BLOCK_N + cols[None, :]


@gluon.jit
def _publish_partial(acc, PARTIALS, FLAGS):
    """Leave this program's partial (the start of a tile another program ends) in its slot of
    PARTIALS and raise its flag: every consumer thread's stores, then (after the partition's
    barrier) one release at GPU scope, CUTLASS's stream-K / split-K pattern."""
    program = gl.program_id(0)
    gl.store(_partial_pointers(acc, PARTIALS, program), acc)
    gl.thread_barrier()
    gl.atomic_xchg(FLAGS + program, 1, sem="release", scope="gpu")


@gluon.jit
def _add_peer_partials(acc, PARTIALS, FLAGS, tile_start, sk_iters):
    """acc + the partials of the tile whose first stream-K iteration is tile_start, left by the
    programs before this one whose ranges meet it, in program order (a fixed order: the sum's
    bits do not depend on which program finished first). Each flag is waited for with acquire
    at GPU scope and set back to zero in the same atomic, for the next launch."""
    program = gl.program_id(0)
    programs = gl.num_programs(0)
    # the program whose range holds tile_start: the last q with _stream_k_start(q) <= tile_start
    first = ((tile_start.to(gl.int64) + 1) * programs - 1) // sk_iters
    for q in range(first.to(gl.int32), program):  # every range holds an iteration: each left a partial
        while gl.atomic_cas(FLAGS + q, 1, 0, sem="acquire", scope="gpu") != 1:
            pass
        acc += gl.load(_partial_pointers(acc, PARTIALS, q), cache_modifier=".cg")
    return acc


@gluon.jit
def _consumer(c_desc, res_desc, pre_desc, a_ring, b_ring, ready, empty, res_ready, c_smem, BIAS, SA, SB, PARTIALS,
              FLAGS, M, N, ssam, ssbn, tiles_m, tiles_n, k_tiles, dp_tiles, sk_iters, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, A_M_MAJOR: gl.constexpr,
              B_K_MAJOR: gl.constexpr, PROMOTE: gl.constexpr, STREAM_K: gl.constexpr, ACTIVATION: gl.constexpr,
              HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr, SAVE_PREACT: gl.constexpr, SCALED: gl.constexpr,
              PRECISE: gl.constexpr, BF16_OUT: gl.constexpr, num_warps: gl.constexpr):
    """The consumer warpgroups: per tile, the K loop of async wgmma, then the epilogue; then the
    stream-K pieces: a piece that ends its tile adds the peers' partials and runs the epilogue,
    one that does not leaves its partial for the program that ends the tile."""
    # wgmma's K step: 32 bytes of operands (16 bf16 / fp16, 32 e4m3)
    instr_k: gl.constexpr = 256 // a_ring.dtype.primitive_bitwidth
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, instr_k])
    step = 0
    done = 0
    for tile in range(gl.program_id(0), dp_tiles, gl.num_programs(0)):
        _, pid_m, pid_n = _tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
        acc, step = _k_steps(a_ring, b_ring, ready, empty, step, k_tiles, acc_layout, BLOCK_M, BLOCK_N, STAGES,
                             A_M_MAJOR, B_K_MAJOR, PROMOTE)
        _epilogue(acc, pid_m * BLOCK_M, pid_n * BLOCK_N, c_desc, c_smem, res_desc, pre_desc, res_ready, done & 1,
                  BIAS, SA, SB, M, N, ssam, ssbn, ACTIVATION, HAS_BIAS, HAS_RESIDUAL, SAVE_PREACT, SCALED, PRECISE,
                  BF16_OUT)
        done += 1
    if STREAM_K:
        start, end, last_tile, pieces = _stream_k_pieces(k_tiles, sk_iters)
        for i in range(pieces):
            t = last_tile - i
            k_begin = gl.maximum(start - t * k_tiles, 0)
            k_end = gl.minimum(end - t * k_tiles, k_tiles)
            acc, step = _k_steps(a_ring, b_ring, ready, empty, step, k_end - k_begin, acc_layout, BLOCK_M, BLOCK_N,
                                 STAGES, A_M_MAJOR, B_K_MAJOR, PROMOTE)
            if k_end == k_tiles:  # this piece ends the tile: this program finishes it
                if k_begin > 0:
                    acc = _add_peer_partials(acc, PARTIALS, FLAGS, t * k_tiles, sk_iters)
                _, pid_m, pid_n = _tile_coordinates(dp_tiles + t, tiles_m, tiles_n, GROUP_M)
                _epilogue(acc, pid_m * BLOCK_M, pid_n * BLOCK_N, c_desc, c_smem, res_desc, pre_desc, res_ready,
                          done & 1, BIAS, SA, SB, M, N, ssam, ssbn, ACTIVATION, HAS_BIAS, HAS_RESIDUAL, SAVE_PREACT,
                          SCALED, PRECISE, BF16_OUT)
                done += 1
            else:
                _publish_partial(acc, PARTIALS, FLAGS)
    tma.store_wait(0)


@gluon.jit
def gemm_ws_kernel(a_desc, b_desc, c_desc, res_desc, pre_desc, BIAS, SA, SB, PARTIALS, FLAGS, M, N, K, ssam, ssbn,
                   dp_tiles, sk_iters, GROUP_M: gl.constexpr, STAGES: gl.constexpr, A_M_MAJOR: gl.constexpr,
                   B_K_MAJOR: gl.constexpr, PROMOTE: gl.constexpr, STREAM_K: gl.constexpr, ACTIVATION: gl.constexpr,
                   HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr, SAVE_PREACT: gl.constexpr,
                   SCALED: gl.constexpr, PRECISE: gl.constexpr, BF16_OUT: gl.constexpr, num_warps: gl.constexpr):
    """Persistent: program p takes the whole tiles p, p + programs, ... below dp_tiles (grouped
    order); with STREAM_K the (tile, K step) iterations of the tiles after them, sk_iters of
    them, are then shared out evenly (stream_k_plan). res_desc and pre_desc (the residual
    read, the pre-activation written) and the BIAS / SA / SB pointers are only touched under
    their flags (the caller passes c's where they are not given); PARTIALS (programs float32
    tiles) and FLAGS (programs zeroed int32) only under STREAM_K."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = b_desc.block_type.shape[1] if B_K_MAJOR else b_desc.block_type.shape[0]
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    res_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=1)
    mbarrier.init(res_ready, count=1)
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    gl.warp_specialize([
        (_consumer, (c_desc, res_desc, pre_desc, a_ring, b_ring, ready, empty, res_ready, c_smem, BIAS, SA, SB,
                     PARTIALS, FLAGS, M, N, ssam, ssbn, tiles_m, tiles_n, k_tiles, dp_tiles, sk_iters, BLOCK_M,
                     BLOCK_N, GROUP_M, STAGES, A_M_MAJOR, B_K_MAJOR, PROMOTE, STREAM_K, ACTIVATION, HAS_BIAS,
                     HAS_RESIDUAL, SAVE_PREACT, SCALED, PRECISE, BF16_OUT, num_warps)),
        (_loader, (a_desc, b_desc, a_ring, b_ring, ready, empty, tiles_m, tiles_n, k_tiles, dp_tiles, sk_iters,
                   BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, A_M_MAJOR, B_K_MAJOR, STREAM_K)),
    ], [1], [LOADER_REGISTERS])
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(st))
        mbarrier.invalidate(empty.index(st))
    mbarrier.invalidate(res_ready)


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple, dtype: torch.dtype):
    """The swizzled shared-memory layout of a TMA block (computing it costs ~7 us of Python,
    a descriptor three of them a call)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), DTYPES[dtype])


def _descriptor(t: torch.Tensor, block: list) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, block, _shared_layout(tuple(block), t.dtype))


def tile(a_dtype: torch.dtype, out_dtype: torch.dtype, promote: bool, epilogue_reads: bool) -> dict:
    """block_m, block_n, block_k: 128 x 256 tiles with K tiles of 128 bytes (64 bf16 / fp16,
    128 e4m3); 128 x 128 for fp8 with the float32 promotion (its three 128 x N float32 register
    tiles, the accumulator and two partials, would not fit at N = 256), for a float32 output
    (whose 128 x 256 tile leaves shared memory for two stages and spills registers), and for
    fp8 with a bias or residual to read (next to the column scales they spill 96-640 bytes at
    128 x 256)."""
    narrow = promote or out_dtype.itemsize == 4 or (a_dtype == FP8 and epilogue_reads)
    return dict(block_m=128, block_n=128 if narrow else 256, block_k=128 // a_dtype.itemsize)


def _stages(block_m, block_n, block_k, a_dtype, out_dtype, most: int = 6) -> int:
    """As many ring stages as the shared memory holds next to the output tile, at most `most`
    (the H200 experiment, benchmarks/gluon_gemm_experiment.py: 3 at 128 x 256, all there is
    room for; fp8 promoted at 128 x 128 x 128 0.97-1.02x torch._scaled_mm with 4, 1.01-1.02x
    with 6)."""
    stage = (block_m + block_n) * block_k * a_dtype.itemsize
    return min(most, (SHARED_BYTES - block_m * block_n * out_dtype.itemsize) // stage)


def stream_k_plan(tiles: int, k_tiles: int, sms: int, mode=None) -> tuple[int, int, int]:
    """(programs, dp_tiles, sk_iters): whole tiles for the first dp_tiles (a multiple of the
    programs), the sk_iters (tile, K step) iterations of the rest shared out evenly (stream-K).

    Whole tiles alone leave the last wave's idle SMs idle: at 4096^3 (512 tiles of 128 x 256,
    132 SMs) every program runs 4 tiles' K loops where 3.88 would do, and a product of 112
    tiles uses 112 of 132 SMs. Stream-K splits the last tiles' K loops across all the
    programs; a program that ends a tile adds its peers' float32 partials before the epilogue.
    mode (None: STREAM_K): False never; True wherever the tiles do not divide evenly (a K step
    a program at least); None where the last wave leaves more than a tenth of the SMs idle,
    and below one wave only from half a wave of tiles (a tile in three pieces at most). A last
    wave of under half the SMs takes a whole wave with it, so each program's share stays over
    half a tile (CUTLASS's stream-K does the same)."""
    mode = STREAM_K if mode is None else mode
    whole = (min(sms, tiles), tiles, 0)
    tail = tiles % sms
    if mode is False or tail == 0:
        return whole
    if mode is None and (tail > STREAM_K_MAX_TAIL * sms or 2 * tiles < sms):
        return whole
    if tiles > sms and 2 * tail < sms:
        tail += sms
    if tail * k_tiles < sms:  # every program's range must hold an iteration (the kernel counts on it)
        return whole
    return sms, tiles - tail, tail * k_tiles


def arguments(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, sms: int, bias=None, residual=None, preact=None,
              scale_a=None, scale_b=None, activation=None, fast_accum: bool = False, block_m: int = 128,
              block_n: int = None, block_k: int = None, group_m: int = 8, stages: int = None, stream_k=None):
    """(positional arguments, constexprs, programs) of gemm_ws_kernel for out = act(a @ b * scales
    + bias) + residual, preact = a @ b * scales, on `sms` SMs (stream_k: stream_k_plan's mode):
    a (M, K) and b (K, N) either way round (rows where TMA can read them so, else their
    transposes' rows: a Linear weight's transpose reads K-major; e4m3 both K-major only), out,
    residual and preact (M, N) row-major, bias (N,), scale_a (M,) and scale_b (N,) float32
    (stride 0: one scale)."""
    M, K = a.shape
    N = b.shape[1]
    scaled = a.dtype == FP8
    promote = scaled and not fast_accum
    default = tile(a.dtype, out.dtype, promote, bias is not None or residual is not None)
    block_n = block_n or default["block_n"]
    block_k = block_k or default["block_k"]
    stages = stages or _stages(block_m, block_n, block_k, a.dtype, out.dtype)
    programs, dp_tiles, sk_iters = stream_k_plan(cdiv(M, block_m) * cdiv(N, block_n), cdiv(K, block_k), sms,
                                                 stream_k)
    # stream-K's ready flags (zeroed, and left so) and a float32 partial tile per program
    flags = arrival_counts(out.device, programs)
    partials = flags.view(torch.float32)  # never read without stream-K
    if sk_iters:
        partials = torch.empty(programs, block_m, block_n, device=out.device, dtype=torch.float32)
    a_m_major = not _tma_readable(a, 1)
    b_k_major = not _tma_readable(b, 1)
    a_desc = _descriptor(a.t(), [block_k, block_m]) if a_m_major else _descriptor(a, [block_m, block_k])
    b_desc = _descriptor(b.t(), [block_n, block_k]) if b_k_major else _descriptor(b, [block_k, block_n])
    c_desc = _descriptor(out, [block_m, block_n])
    res_desc = c_desc if residual is None else _descriptor(residual, [block_m, block_n])
    pre_desc = c_desc if preact is None else _descriptor(preact, [block_m, block_n])
    pointers = [t if t is not None else out for t in (bias, scale_a, scale_b)]
    values = (a_desc, b_desc, c_desc, res_desc, pre_desc, *pointers, partials, flags, M, N, K,
              scale_a.stride(0) if scaled else 0, scale_b.stride(0) if scaled else 0, dp_tiles, sk_iters)
    constexprs = dict(GROUP_M=group_m, STAGES=stages, A_M_MAJOR=a_m_major, B_K_MAJOR=b_k_major, PROMOTE=promote,
                      STREAM_K=sk_iters > 0, ACTIVATION=activation or "none", HAS_BIAS=bias is not None,
                      HAS_RESIDUAL=residual is not None, SAVE_PREACT=preact is not None, SCALED=scaled,
                      PRECISE=True, BF16_OUT=out.dtype == torch.bfloat16, num_warps=8)
    return values, constexprs, programs


def _tma_readable(t: torch.Tensor, unit_dim: int) -> bool:
    """A 2-D t that TMA reads with dim `unit_dim` contiguous: unit stride there, 16-byte
    aligned start and rows."""
    other = 1 - unit_dim
    return (t.stride(unit_dim) == 1 and t.data_ptr() % 16 == 0 and t.stride(other) * t.element_size() % 16 == 0
            and t.stride(other) >= t.shape[unit_dim])


def takes(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, capability, sms: int, bias=None, residual=None,
          fast_accum: bool = False, any_size: bool = False) -> bool:
    """Whether gemm_ws_kernel computes out = a @ b (a (M, K), b (K, N), out (M, N), one matrix,
    with any epilogue): sm_90 (wgmma); 16-bit operands with out in their dtype, or e4m3 ones
    (K-major: the caller's _k_major made them so) with a 16-bit or float32 out that fits the
    shared memory; a and b either way round, all TMA-readable, a residual too (in out's dtype);
    and (unless any_size) enough tiles to give every SM one, or stream-K's share of fewer
    (stream_k_plan): smaller products keep the Triton kernels' smaller tiles."""
    if tuple(capability)[0] != 9 or a.dtype not in OPERAND_DTYPES or a.dtype != b.dtype:
        return False
    if a.dtype == FP8:
        if out.dtype not in OUT_DTYPES or not (_tma_readable(a, 1) and _tma_readable(b, 0)):
            return False
    elif out.dtype != a.dtype or not ((_tma_readable(a, 1) or _tma_readable(a, 0))
                                      and (_tma_readable(b, 1) or _tma_readable(b, 0))):
        return False
    if not _tma_readable(out, 1) or (residual is not None and not (residual.dtype == out.dtype
                                                                   and _tma_readable(residual, 1))):
        return False
    config = tile(a.dtype, out.dtype, a.dtype == FP8 and not fast_accum, bias is not None or residual is not None)
    if _stages(config["block_m"], config["block_n"], config["block_k"], a.dtype, out.dtype) < 2:
        return False
    M, N = out.shape
    tiles = cdiv(M, config["block_m"]) * cdiv(N, config["block_n"])
    return any_size or tiles >= sms or stream_k_plan(tiles, cdiv(a.shape[1], config["block_k"]), sms)[2] > 0


def gemm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, sms: int, **options) -> torch.Tensor:
    """out = act(a @ b * scales + bias) + residual by gemm_ws_kernel (what `takes` accepts),
    `sms` persistent programs at most; options: arguments()'s keywords."""
    values, constexprs, programs = arguments(a, b, out, sms, **options)
    launch(gemm_ws_kernel, (programs,), *values, **constexprs)
    return out


def gemm(a: torch.Tensor, b: torch.Tensor, sms: int, out_dtype=None, **options) -> torch.Tensor:
    """out = a @ b (options: arguments()'s keywords) into a new tensor
    (benchmarks/gluon_gemm_experiment.py)."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype or a.dtype, device=a.device)
    return gemm_into(a, b, out, sms, **options)


def compile_for_sm90(a_m_major: bool = False, b_k_major: bool = True, dtype: torch.dtype = torch.bfloat16,
                     out_dtype: torch.dtype = None, epilogue: bool = False, fast_accum: bool = False,
                     stream_k: bool = False) -> dict:
    """Registers, spills and shared memory of gemm_ws_kernel built for sm_90a (no GPU needed);
    epilogue: with bias, gelu_tanh, residual and the pre-activation; stream_k: with its pieces
    (512^3 on 3 SMs)."""
    from kernelforge.triton.attention_gluon import sm90_usage
    a = torch.zeros(512, 512, dtype=dtype)
    b = torch.zeros(512, 512, dtype=dtype)
    out = torch.zeros(512, 512, dtype=out_dtype or (torch.bfloat16 if dtype == FP8 else dtype))
    options = dict(fast_accum=fast_accum, stream_k=stream_k)
    if dtype == FP8:
        options.update(scale_a=torch.ones(512), scale_b=torch.ones(512))
    if epilogue:
        options.update(bias=torch.zeros(512, dtype=out.dtype), residual=torch.zeros_like(out),
                       preact=torch.zeros_like(out), activation="gelu_tanh")
    values, constexprs, _ = arguments(a.t() if a_m_major else a, b.t() if b_k_major else b, out, 3, **options)
    assert constexprs["STREAM_K"] == stream_k
    return sm90_usage(gemm_ws_kernel, values, constexprs)
