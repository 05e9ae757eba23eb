"""Hopper GEMM in Gluon with warp specialization: c = act(a @ b * scales + bias) + residual,
16-bit or e4m3 operands, one matrix.

Why a second GEMM next to gemm_kernels.gemm_tma_kernel: Triton 3.6's persistent TMA kernel
reaches 0.93-0.97x cuBLAS at 4096^3 on an H200 (bf16), 0.79-0.85x torch._scaled_mm for fp8
with cuBLAS's float32 promotion, and no tile, stage count or programs-an-SM closes the gap
(benchmarks/results/nvidia-h200/0.1.0/gemm/sweep/). There the same warps issue the TMA loads, wait
for them, run the MMAs and the epilogue. Here, as cuBLAS's Hopper kernels do, one loader warp
only streams A and B tiles through a ring of shared-memory stages (TMA, mbarrier completion),
and two consumer warpgroups only multiply (async wgmma) and run the epilogue: a stage is
handed back to the loader as soon as the MMA that read it retires, and the loader runs ahead
into the next tile while the consumers run the epilogue, whose TMA store in turn drains
under the next tile's K loop. For fp8 the consumers add each K tile's partial product into a
float32 accumulator while the tensor cores compute the next one (_accumulate_promoted).

Work per output tile (BLOCK_M x BLOCK_N): 2 * BLOCK_M * BLOCK_N * K FLOPs; bytes: A's
BLOCK_M x K and B's K x BLOCK_N panels (from L2 for all but the first tile of a group:
GROUP_M tile rows walk one column panel of b, as gemm_kernels.tile_coordinates), c once;
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

from kernelforge.triton._launch import cdiv, launch
from kernelforge.triton.gemm_kernels import bias_activation, dequantized, tile_coordinates
from kernelforge.triton.tma_descriptors import descriptor_template, rebased

FP8 = torch.float8_e4m3fn
DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, FP8: gl.float8e4nv, torch.float32: gl.float32}
OPERAND_DTYPES = (torch.bfloat16, torch.float16, FP8)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # of e4m3 products
SHARED_BYTES = 227 * 1024 - 1024  # what one program may take on an H100 / H200, less the barriers
LOADER_REGISTERS = gl.constexpr(40)  # the loader warp only computes coordinates: the rest go to the consumers


@gluon.jit
def _loader(a_desc, b_desc, a_ring, b_ring, ready, empty, tiles_m, tiles_n, k_tiles,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
            STAGES: gl.constexpr, A_M_MAJOR: gl.constexpr, B_K_MAJOR: gl.constexpr):
    """The loader warp: every (tile, K step) of this program in order, each into the next ring
    stage once the consumers have handed it back (empty), completing on its ready barrier."""
    step = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        _, pid_m, pid_n = tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
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
        acc = dequantized(acc, SA, SB, offs_m, offs_n, M, N, ssam, ssbn)
    tma.store_wait(0)  # the last tile's store has left c_smem
    if SAVE_PREACT:
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(pre_desc, [off_m, off_n], c_smem)
    z = bias_activation(acc, BIAS, offs_n, N, ACTIVATION, HAS_BIAS, PRECISE, BF16_OUT)
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
def _consumer(c_desc, res_desc, pre_desc, a_ring, b_ring, ready, empty, res_ready, c_smem, BIAS, SA, SB, M, N,
              ssam, ssbn, tiles_m, tiles_n, k_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, A_M_MAJOR: gl.constexpr, B_K_MAJOR: gl.constexpr,
              PROMOTE: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
              SAVE_PREACT: gl.constexpr, SCALED: gl.constexpr, PRECISE: gl.constexpr, BF16_OUT: gl.constexpr,
              num_warps: gl.constexpr):
    """The consumer warpgroups: per tile, the K loop of async wgmma, then the epilogue."""
    # wgmma's K step: 32 bytes of operands (16 bf16 / fp16, 32 e4m3)
    instr_k: gl.constexpr = 256 // a_ring.dtype.primitive_bitwidth
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, instr_k])
    step = 0
    done = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        _, pid_m, pid_n = tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
        if PROMOTE:
            acc, step = _accumulate_promoted(a_ring, b_ring, ready, empty, step, k_tiles, acc_layout, BLOCK_M,
                                             BLOCK_N, STAGES, A_M_MAJOR, B_K_MAJOR)
        else:
            acc, step = _accumulate(a_ring, b_ring, ready, empty, step, k_tiles, acc_layout, BLOCK_M, BLOCK_N,
                                    STAGES, A_M_MAJOR, B_K_MAJOR)
        _epilogue(acc, pid_m * BLOCK_M, pid_n * BLOCK_N, c_desc, c_smem, res_desc, pre_desc, res_ready, done & 1,
                  BIAS, SA, SB, M, N, ssam, ssbn, ACTIVATION, HAS_BIAS, HAS_RESIDUAL, SAVE_PREACT, SCALED, PRECISE,
                  BF16_OUT)
        done += 1
    tma.store_wait(0)


@gluon.jit
def gemm_ws_kernel(a_desc, b_desc, c_desc, res_desc, pre_desc, BIAS, SA, SB, M, N, K, ssam, ssbn,
                   GROUP_M: gl.constexpr, STAGES: gl.constexpr, A_M_MAJOR: gl.constexpr, B_K_MAJOR: gl.constexpr,
                   PROMOTE: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr,
                   HAS_RESIDUAL: gl.constexpr, SAVE_PREACT: gl.constexpr, SCALED: gl.constexpr,
                   PRECISE: gl.constexpr, BF16_OUT: gl.constexpr, num_warps: gl.constexpr):
    """Persistent: program p takes tiles p, p + programs, ... (grouped order). res_desc and
    pre_desc (the residual read, the pre-activation written) and the BIAS / SA / SB pointers
    are only touched under their flags (the caller passes c's where they are not given)."""
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
        (_consumer, (c_desc, res_desc, pre_desc, a_ring, b_ring, ready, empty, res_ready, c_smem, BIAS, SA, SB, M, N,
                     ssam, ssbn, tiles_m, tiles_n, k_tiles, BLOCK_M, BLOCK_N, GROUP_M, STAGES, A_M_MAJOR, B_K_MAJOR,
                     PROMOTE, ACTIVATION, HAS_BIAS, HAS_RESIDUAL, SAVE_PREACT, SCALED, PRECISE, BF16_OUT,
                     num_warps)),
        (_loader, (a_desc, b_desc, a_ring, b_ring, ready, empty, tiles_m, tiles_n, k_tiles, BLOCK_M, BLOCK_N,
                   BLOCK_K, GROUP_M, STAGES, A_M_MAJOR, B_K_MAJOR)),
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


def _template(t: torch.Tensor, block: list) -> TensorDescriptor:
    """A descriptor of t's rows (checked by its constructor) to rebase on each call's tensors."""
    return descriptor_template(TensorDescriptor.from_tensor(t, block, _shared_layout(tuple(block), t.dtype)))


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
    (the H200 experiment, docs/notes/gemm.md: 3 at 128 x 256, all there is
    room for; fp8 promoted at 128 x 128 x 128 0.97-1.02x torch._scaled_mm with 4, 1.01-1.02x
    with 6)."""
    stage = (block_m + block_n) * block_k * a_dtype.itemsize
    return min(most, (SHARED_BYTES - block_m * block_n * out_dtype.itemsize) // stage)


class Plan:
    """gemm_ws_kernel's launch for one call signature, worked out once: out = act(a @ b * scales
    + bias) + residual, preact = a @ b * scales, for a (M, K) and b (K, N) either way round (rows
    where TMA can read them so, else their transposes' rows: a Linear weight's transpose reads
    K-major; e4m3 both K-major only), out, residual and preact (M, N) row-major, bias (N,),
    scale_a (M,) and scale_b (N,) float32 (stride 0: one scale). The tensors given here fix the
    signature (shapes, strides, dtypes, alignment, which epilogue inputs there are); calling the
    plan launches on tensors of that signature: the matrices, or tensors that start where they
    do (a batch of one)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, sms: int, bias=None, residual=None,
                 preact=None, scale_a=None, scale_b=None, activation=None, fast_accum: bool = False, block_m: int = 128,
                 block_n: int = None, block_k: int = None, group_m: int = 8, stages: int = None):
        M, K = a.shape
        N = b.shape[1]
        scaled = a.dtype == FP8
        promote = scaled and not fast_accum
        default = tile(a.dtype, out.dtype, promote, bias is not None or residual is not None)
        block_n = block_n or default["block_n"]
        block_k = block_k or default["block_k"]
        stages = stages or _stages(block_m, block_n, block_k, a.dtype, out.dtype)
        a_m_major = not _tma_readable(a, 1)
        b_k_major = not _tma_readable(b, 1)
        c = _template(out, [block_m, block_n])
        self.templates = (_template(a.t(), [block_k, block_m]) if a_m_major else _template(a, [block_m, block_k]),
                          _template(b.t(), [block_n, block_k]) if b_k_major else _template(b, [block_k, block_n]),
                          c, c if residual is None else _template(residual, [block_m, block_n]),
                          c if preact is None else _template(preact, [block_m, block_n]))
        self.ints = (M, N, K, scale_a.stride(0) if scaled else 0, scale_b.stride(0) if scaled else 0)
        self.constexprs = dict(GROUP_M=group_m, STAGES=stages, A_M_MAJOR=a_m_major, B_K_MAJOR=b_k_major,
                               PROMOTE=promote, ACTIVATION=activation or "none", HAS_BIAS=bias is not None,
                               HAS_RESIDUAL=residual is not None, SAVE_PREACT=preact is not None, SCALED=scaled,
                               PRECISE=True, BF16_OUT=out.dtype == torch.bfloat16, num_warps=8)
        self.grid = (max(1, min(sms, cdiv(M, block_m) * cdiv(N, block_n))),)

    def arguments(self, a, b, out, bias=None, residual=None, preact=None, scale_a=None, scale_b=None) -> tuple:
        """gemm_ws_kernel's positional arguments for these tensors."""
        a_desc, b_desc, c_desc, res_desc, pre_desc = self.templates
        c_desc = rebased(c_desc, out)
        return (rebased(a_desc, a), rebased(b_desc, b), c_desc,
                c_desc if residual is None else rebased(res_desc, residual),
                c_desc if preact is None else rebased(pre_desc, preact),
                out if bias is None else bias, out if scale_a is None else scale_a, out if scale_b is None else scale_b,
                *self.ints)

    def __call__(self, a, b, out, bias=None, residual=None, preact=None, scale_a=None, scale_b=None) -> None:
        launch(gemm_ws_kernel, self.grid, *self.arguments(a, b, out, bias, residual, preact, scale_a, scale_b),
               **self.constexprs)


def arguments(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias=None, residual=None, preact=None,
              scale_a=None, scale_b=None, activation=None, fast_accum: bool = False, **tile_options):
    """(positional arguments, constexprs) of gemm_ws_kernel for these tensors (see Plan; tile_options:
    block_m, block_n, block_k, group_m, stages)."""
    tensors = dict(bias=bias, residual=residual, preact=preact, scale_a=scale_a, scale_b=scale_b)
    plan = Plan(a, b, out, 1, activation=activation, fast_accum=fast_accum, **tensors, **tile_options)
    return plan.arguments(a, b, out, **tensors), plan.constexprs


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
    and (unless any_size) enough tiles to give every SM one (e4m3: three in four, of a full
    tile's rows): smaller products keep the Triton kernels' smaller tiles."""
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
    # e4m3 with full-height tiles from 3/4 of the SMs' worth: at 128 x 14336 x 4096 (112 tiles
    # of 128 x 128 on 132 SMs) 0.96x torch._scaled_mm against the Triton kernel's 0.88x; at 16
    # rows the Triton kernel's 64-row tiles stay ahead (1.05x against 0.94x; H200,
    # gemm/b093def-stream-k/run2-experiment-fp8.log)
    fp8_rows = a.dtype == FP8 and M >= config["block_m"] and 4 * tiles >= 3 * sms
    return any_size or tiles >= sms or fp8_rows


def gemm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, sms: int, **options) -> torch.Tensor:
    """out = act(a @ b * scales + bias) + residual by gemm_ws_kernel (what `takes` accepts),
    `sms` persistent programs at most; options: Plan's keywords. A plan of its own: the GEMM
    launcher keeps one per call signature instead."""
    tensors = {k: options.pop(k, None) for k in ("bias", "residual", "preact", "scale_a", "scale_b")}
    Plan(a, b, out, sms, **tensors, **options)(a, b, out, **tensors)
    return out


def compile_for_sm90(a_m_major: bool = False, b_k_major: bool = True, dtype: torch.dtype = torch.bfloat16,
                     out_dtype: torch.dtype = None, epilogue: bool = False, fast_accum: bool = False) -> dict:
    """Registers, spills and shared memory of gemm_ws_kernel built for sm_90a (no GPU needed);
    epilogue: with bias, gelu_tanh, residual and the pre-activation."""
    from kernelforge.triton.attention_gluon import sm90_usage
    a = torch.zeros(512, 512, dtype=dtype)
    b = torch.zeros(512, 512, dtype=dtype)
    out = torch.zeros(512, 512, dtype=out_dtype or (torch.bfloat16 if dtype == FP8 else dtype))
    options = dict(fast_accum=fast_accum)
    if dtype == FP8:
        options.update(scale_a=torch.ones(512), scale_b=torch.ones(512))
    if epilogue:
        options.update(bias=torch.zeros(512, dtype=out.dtype), residual=torch.zeros_like(out),
                       preact=torch.zeros_like(out), activation="gelu_tanh")
    return sm90_usage(gemm_ws_kernel, *arguments(a.t() if a_m_major else a, b.t() if b_k_major else b, out,
                                                 **options))
