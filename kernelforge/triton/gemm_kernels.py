"""Triton GEMM with a fused epilogue: out = act(a @ b + bias) + residual, batched.

Work per (batch) matrix: 2*M*N*K FLOPs. Bytes: a and b once each from HBM when the tiles
that share them run close together in time (the grouped order below keeps GROUP_M rows of
tiles on the same columns of b, so b's panels stay in L2), c written once; with the
epilogue, + the bias (N), + the residual read (M*N), + preact written (M*N) when the
backward needs it. Compute bound from a few hundred in every dim up (H100/H200 ridge:
~250-300 FLOP/byte at bf16).

Persistent: a grid of about one program per SM (times a few) walks the tiles of every
batch in a grid-stride loop, so short tails and many small batches do not pay a launch
per tile and the next tile's loads start while the last one finishes.

Operands are read through their strides (transposed or sliced views need no copy; Triton
specializes a unit stride, so the common layouts load in 16-byte vectors), converted in
registers to the compute dtype (COMPUTE: fp16 / bf16 / tf32 operands of fp32 inputs are
rounded there, not in a separate pass) and multiplied with tl.dot at PRECISION ("ieee" for fp32,
"tf32", or the 16-bit tensor-core path), accumulating in float32.

fp8 (COMPUTE "fp8"): e4m3 operands, quantized before the launch, multiplied on the fp8
tensor cores (twice the 16-bit rate, half the operand bytes). Hopper's fp8 instruction adds
its products into the accumulator at reduced precision (about 14 mantissa bits);
FP8_PRECISE makes Triton add the partial sum of every 128 K (or of the K tile, if shorter)
into a float32 accumulator, as cuBLAS does unless asked for fast accumulation. SCALED multiplies each accumulator row by
scale_a[m] and column by scale_b[n] (stride 0: one scale per tensor) before the epilogue.
Bytes: + M + N float32 scales per matrix.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernelforge.triton.activations import activation, activation_for_bf16


@triton.jit
def tile_coordinates(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(batch, tile row, tile column) of a linear tile index: within a batch, GROUP_M tile
    rows are walked column by column, so consecutive programs share b's column panel."""
    per_batch = tiles_m * tiles_n
    batch = tile // per_batch
    t = tile % per_batch
    per_group = GROUP_M * tiles_n
    first_m = (t // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % rows_in_group
    pid_n = (t % per_group) // rows_in_group
    return batch, pid_m, pid_n


@triton.constexpr_function
def _promote_every(block_k):
    """K products summed at the fp8 tensor cores' precision before each float32 promotion:
    128, cuBLAS's interval (its error and ours agree to the digit at K = 1024 and 8192,
    docs/notes/gemm.md), or a shorter K tile."""
    return min(block_k, 128)


@triton.jit
def _operand(x, COMPUTE: tl.constexpr):
    """x in the multiply's dtype (a register conversion; the tensor cores round nothing else)."""
    if COMPUTE == "fp8":  # quantized before the launch: e4m3 already
        return x
    elif COMPUTE == "fp16":
        return x.to(tl.float16)
    elif COMPUTE == "bf16":
        return x.to(tl.bfloat16)
    elif COMPUTE == "tf32":
        # The tensor cores drop the 13 low mantissa bits (truncation); round to nearest first,
        # ties away from zero (cvt.rna.tf32.f32), as the reference does. Inf and NaN pass.
        x = x.to(tl.float32)
        rounded = ((x.to(tl.int32, bitcast=True) + 0x1000) & -0x2000).to(tl.float32, bitcast=True)
        return tl.where(tl.abs(x) < float("inf"), rounded, x)
    else:
        return x.to(tl.float32)


@triton.jit
def dequantized(acc, SA, SB, offs_m, offs_n, M, N, ssam, ssbn):
    """acc * scale_a[m] * scale_b[n] (SA / SB at the tile's matrix; a stride 0 repeats one
    scale)."""
    scale_a = tl.load(SA + offs_m * ssam, mask=offs_m < M, other=0.0)
    scale_b = tl.load(SB + offs_n * ssbn, mask=offs_n < N, other=0.0)
    return acc * scale_a[:, None] * scale_b[None, :]


@triton.jit
def bias_activation(acc, BIAS, offs_n, N, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
                     PRECISE: tl.constexpr, BF16_OUT: tl.constexpr):
    """act(acc + bias) in float32 (also the Gluon kernel's, gemm_gluon._epilogue). BF16_OUT: the
    output is bfloat16, so the SFU's tanh is accurate enough (GPU only; see
    activation_for_bf16)."""
    z = acc
    if HAS_BIAS:
        z += tl.load(BIAS + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if BF16_OUT and ACTIVATION != "none":
        z = activation_for_bf16(z, ACTIVATION, PRECISE)
    elif ACTIVATION != "none":
        z = activation(z, ACTIVATION, PRECISE)
    return z


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, BIAS, RES, PRE, srm, srn, spm, spn,
              ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
              SAVE_PREACT: tl.constexpr, PRECISE: tl.constexpr, BF16_OUT: tl.constexpr):
    """(act(acc + bias) + residual in float32, the in-range mask) of one output tile; stores
    acc (a @ b before the bias) to PRE when the backward needs it for act'. RES and PRE point
    at the tile's matrix (its batch already added). BF16_OUT: the output is bfloat16, so the
    SFU's tanh is accurate enough (GPU only; see activation_for_bf16)."""
    inside = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SAVE_PREACT:
        tl.store(PRE + offs_m[:, None].to(tl.int64) * spm + offs_n[None, :] * spn, acc.to(PRE.dtype.element_ty),
                 mask=inside)
    z = bias_activation(acc, BIAS, offs_n, N, ACTIVATION, HAS_BIAS, PRECISE, BF16_OUT)
    if HAS_RESIDUAL:
        z += tl.load(RES + offs_m[:, None].to(tl.int64) * srm + offs_n[None, :] * srn, mask=inside,
                     other=0.0).to(tl.float32)
    return z, inside


@triton.jit
def gemm_kernel(
    A, B, C, BIAS, RES, PRE, SA, SB,
    M, N, K,
    sab, sam, sak, sbb, sbk, sbn, scb, scm, scn, srb, srm, srn, spb, spm, spn, ssab, ssam, ssbb, ssbn,
    BATCH, M_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SAVE_PREACT: tl.constexpr,
    PRECISE: tl.constexpr, BF16_OUT: tl.constexpr, SCALED: tl.constexpr, FP8_PRECISE: tl.constexpr,
):
    # M_BUCKET (M rounded up to a power of two) is only the autotuner's key: one tuning per
    # bucket, not one per distinct token count.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = BATCH * tiles_m * tiles_n
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        batch, pid_m, pid_n = tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows / columns past the edge read row 0 / column 0 instead of masking every load:
        # their results are never stored, and the loads stay unmasked along M and N.
        # The hints restore what tl.where hides from Triton's analysis: each run of BLOCK
        # offsets starts at a multiple of BLOCK and is contiguous, so a unit-stride operand
        # (a column-major a, a row-major b) loads in 16-byte vectors. Without them a row-major
        # b loads element by element, 50x slower (benchmarks/tuning/gemm_sweep.py, "nn"). In a
        # clamped tail a vector may read columns past N of the same aligned 16 bytes: their
        # lanes are never stored.
        rows = tl.max_contiguous(tl.multiple_of(tl.where(offs_m < M, offs_m, 0), BLOCK_M), BLOCK_M)
        cols = tl.max_contiguous(tl.multiple_of(tl.where(offs_n < N, offs_n, 0), BLOCK_N), BLOCK_N)
        a_ptrs = A + batch.to(tl.int64) * sab + rows[:, None].to(tl.int64) * sam + offs_k[None, :] * sak
        b_ptrs = B + batch.to(tl.int64) * sbb + offs_k[:, None] * sbk + cols[None, :].to(tl.int64) * sbn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
            acc = tl.dot(_operand(a, COMPUTE), _operand(b, COMPUTE), acc, input_precision=PRECISION,
                         max_num_imprecise_acc=_promote_every(BLOCK_K) if FP8_PRECISE else None)
            a_ptrs += BLOCK_K * sak
            b_ptrs += BLOCK_K * sbk
        if SCALED:
            acc = dequantized(acc, SA + batch.to(tl.int64) * ssab, SB + batch.to(tl.int64) * ssbb, offs_m, offs_n,
                               M, N, ssam, ssbn)
        z, inside = _epilogue(acc, offs_m, offs_n, M, N, BIAS, RES + batch.to(tl.int64) * srb,
                              PRE + batch.to(tl.int64) * spb, srm, srn, spm, spn,
                              ACTIVATION, HAS_BIAS, HAS_RESIDUAL, SAVE_PREACT, PRECISE, BF16_OUT)
        tl.store(C + batch.to(tl.int64) * scb + offs_m[:, None].to(tl.int64) * scm + offs_n[None, :] * scn,
                 z.to(C.dtype.element_ty), mask=inside)


@triton.jit
def _split_k_unit(unit, num_tiles, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """(output tile, first K tile, K tile to stop before) of a split-K work unit: unit
    covers slice unit // num_tiles of that tile's K tiles, cdiv(K tiles, SPLIT_K) of them
    (the last slices take what is left: fewer, or none). Unsplit: the tile and all of K."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    if SPLIT_K == 1:
        return unit, 0, k_tiles
    per_slice = tl.cdiv(k_tiles, SPLIT_K)
    k_first = (unit // num_tiles) * per_slice
    return unit % num_tiles, k_first, tl.minimum(k_first + per_slice, k_tiles)


@triton.jit
def _split_k_arrive(acc, unit, num_tiles, offs_m, offs_n, M, N, PARTIALS, SLICE, ARRIVALS, SPLIT_K: tl.constexpr):
    """A split-K unit's partial sum in, (the tile's whole sum, True) out if it is the last of
    its tile's SPLIT_K units to arrive, else (acc, False).

    Ordering (the pattern of CUTLASS's split-K semaphore): every thread stores its part of
    the partial, the block barrier orders those stores before the one thread that issues the
    arrival, whose acq_rel atomic at GPU scope publishes them (release is cumulative) and,
    in the last unit, makes every other unit's published partial visible (acquire). The
    partials are read with .cg (from L2, the coherence point, never a stale L1 line)."""
    inside = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    at = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tile = unit % num_tiles
    tl.store(PARTIALS + (unit // num_tiles).to(tl.int64) * SLICE + at, acc, mask=inside)
    tl.debug_barrier()
    arrived = tl.atomic_add(ARRIVALS + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    if last:
        acc = tl.load(PARTIALS + at, mask=inside, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(PARTIALS + s * SLICE + at, mask=inside, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(ARRIVALS + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch
    return acc, last


@triton.jit
def gemm_tma_kernel(
    a_desc, b_desc, c_desc, BIAS, RES, PRE, SA, SB, PARTIALS, ARRIVALS,
    M, N, K, srm, srn, spm, spn, ssam, ssbn, SLICE, M_BUCKET, SPLIT_CHOICES, NUM_PROGRAMS,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_K_CONTIGUOUS: tl.constexpr, B_N_CONTIGUOUS: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SAVE_PREACT: tl.constexpr,
    PRECISE: tl.constexpr, BF16_OUT: tl.constexpr, SCALED: tl.constexpr, FP8_PRECISE: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """One matrix (batch 1) of 16-bit, e4m3 or tf32-rounded float32 operands, through Hopper's
    tensor memory accelerator:
    a, b and the output move by TMA descriptors built on the host, whose block shapes the
    autotuner's pre-hook sets per config. The copy engine computes addresses and zero-fills
    what lies past M, N or K, so the K loop has no masks and no address math; each operand
    may be stored either way round (A_K_CONTIGUOUS: a is (M, K) row-major, else its
    transpose is; B_N_CONTIGUOUS: b is (K, N) row-major, else b^T is, as a Linear weight).
    COMPUTE (fp16 / bf16 / fp8 / tf32) is the operands' own dtype here; it only keys the
    autotuner (fp8 and tf32 operands come K-major, as Hopper's tensor-core instruction reads
    both for them; tf32 ones are rounded beforehand by round_tf32_kernel, the tensor cores
    would truncate them).
    Same work and bytes as gemm_kernel; 0.94-1.04x cuBLAS where gemm_kernel gives 0.91-1.0x
    on an H200 (benchmarks/tuning/gemm_sweep.py).

    SPLIT_K > 1 (split-K, for products of few output tiles: 128 x 4096 has 32 of 128 x 128,
    a quarter of an H200's SMs, each walking all of K): the work units are (tile, slice of
    K), SPLIT_K slices a tile, so SPLIT_K times as many SMs stream b. Each unit stores its
    float32 partial sum to PARTIALS[slice] (SPLIT_K x M x N, row-major, SLICE = M x N
    elements apart) and counts itself in ARRIVALS[tile] (int32, zero at launch); the unit
    that arrives last adds the SPLIT_K partials in slice order (so the bits do not depend on
    which unit was last), runs the epilogue, and sets the count back to zero for the next
    launch. No second kernel: a separate summing pass cost 1.2-5.7 us and a launch gap
    (benchmarks/results/nvidia-h200/0.1.0/gemm/8a845ed-split-k-two-pass/). Bytes: + SPLIT_K x
    M x N x 4 written and read back (from L2: just written). M_BUCKET and SPLIT_CHOICES (the
    slice counts the autotuner may pick SPLIT_K from, one bit each) are only its key.
    """
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tiles_m * tiles_n
    # The epilogue takes its tile from its own counter, so the software pipeliner (which
    # overlaps the next tile's loads with this tile's tail) need not keep the prologue's
    # coordinates alive across the K loop.
    unit_c = tl.program_id(0) - NUM_PROGRAMS
    for unit in tl.range(tl.program_id(0), num_tiles * SPLIT_K, NUM_PROGRAMS, flatten=True):
        tile, k_first, k_stop = _split_k_unit(unit, num_tiles, K, BLOCK_K, SPLIT_K)
        _, pid_m, pid_n = tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for ki in range(k_first, k_stop):
            if A_K_CONTIGUOUS:
                a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            else:
                a = a_desc.load([ki * BLOCK_K, pid_m * BLOCK_M]).T
            if B_N_CONTIGUOUS:
                b = b_desc.load([ki * BLOCK_K, pid_n * BLOCK_N])
            else:
                b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K]).T
            acc = tl.dot(a, b, acc, input_precision=PRECISION,
                         max_num_imprecise_acc=_promote_every(BLOCK_K) if FP8_PRECISE else None)
        unit_c += NUM_PROGRAMS
        _, pid_m, pid_n = tile_coordinates(unit_c % num_tiles, tiles_m, tiles_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if SPLIT_K > 1:
            acc, last = _split_k_arrive(acc, unit_c, num_tiles, offs_m, offs_n, M, N, PARTIALS, SLICE, ARRIVALS,
                                        SPLIT_K)
        else:
            last = True
        if last:
            if SCALED:
                acc = dequantized(acc, SA, SB, offs_m, offs_n, M, N, ssam, ssbn)
            z, _inside = _epilogue(acc, offs_m, offs_n, M, N, BIAS, RES, PRE, srm, srn, spm, spn,
                                   ACTIVATION, HAS_BIAS, HAS_RESIDUAL, SAVE_PREACT, PRECISE, BF16_OUT)
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], z.to(c_desc.dtype))


@triton.jit
def round_tf32_kernel(X, Y, R, C, sxr, sxc, syr, syc, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Y = X rounded to tf32 (nearest, ties away, as _operand), in float32, into Y's strides:
    the TMA kernel's float32 operands in the K-major order its tensor-core instruction reads.
    Bytes: X once, 4 bytes per element written; no FLOPs to speak of."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = (r[:, None] < R) & (c[None, :] < C)
    x = tl.load(X + r[:, None].to(tl.int64) * sxr + c[None, :].to(tl.int64) * sxc, mask=inside)
    tl.store(Y + r[:, None].to(tl.int64) * syr + c[None, :].to(tl.int64) * syc, _operand(x, "tf32"), mask=inside)


@triton.jit
def gemv_kernel(
    A, B, C, BIAS, RES, PRE, PARTIALS, ARRIVALS,
    M, N, K, sam, sak, sbk, sbn, scm, scn, srm, srn, spm, spn, SPLIT_CHOICES,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    COMPUTE: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    SAVE_PREACT: tl.constexpr, PRECISE: tl.constexpr, BF16_OUT: tl.constexpr,
):
    """One matrix of few rows (M <= ROWS, a decoding step's tokens): out = act(a @ b + bias) +
    residual, on the CUDA cores.

    Bytes: b's K x N elements once (all that counts: a is M x K, from L2 after the first
    program), out M x N; FLOPs 2 M N K, a few per byte, so the weight's stream is the whole
    cost. The tensor cores would pad M to 16 or 64 rows and their tiles need many output
    columns a program, leaving too few programs to keep HBM busy; here a program owns BLOCK_N
    columns and (SPLIT_K > 1) one of SPLIT_K slices of K, multiplies each (BLOCK_N x BLOCK_K)
    tile of b by a's rows in float32 registers and sums over K once, after the loop, so the
    loop is loads and FMAs only. Split slices meet as gemm_tma_kernel's do (_split_k_arrive:
    the last to arrive adds the partials in slice order and runs the epilogue): one launch.
    At one row this streams b at 0.97-1.25x cuBLAS's pace (H200, decode shapes,
    benchmarks/tuning/decode_step_sweep.py); at four rows its registers hold four accumulator tiles
    and it falls to 0.6x, so only single rows take it. SPLIT_CHOICES (the slice counts the
    autotuner may pick from, one bit each) is only its key."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, ROWS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows and columns past the edge read row / column 0 (never stored), so the loads need no
    # mask along M or N; the hints keep a unit-stride b column-contiguous for 16-byte loads
    rows = tl.where(offs_m < M, offs_m, 0)
    cols = tl.max_contiguous(tl.multiple_of(tl.where(offs_n < N, offs_n, 0), BLOCK_N), BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_first = split * per_split
    k_stop = tl.minimum(k_first + per_split, k_tiles)
    k_offs = (k_first * BLOCK_K + offs_k)[None, :].to(tl.int64)
    a_ptrs = A + rows[:, None].to(tl.int64) * sam + k_offs * sak
    b_ptrs = B + cols[:, None].to(tl.int64) * sbn + k_offs * sbk
    a_step = tl.cast(BLOCK_K, tl.int64) * sak  # a K tile's step along a and b, in 64 bits: strided
    b_step = tl.cast(BLOCK_K, tl.int64) * sbk  # operands may be more than 2^31 elements long
    acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], tl.float32)
    for kt in range(k_first, k_stop):
        if EVEN_K:
            w = tl.load(b_ptrs)
            x = tl.load(a_ptrs)
        else:
            inside_k = offs_k[None, :] < K - kt * BLOCK_K
            w = tl.load(b_ptrs, mask=inside_k, other=0.0)
            x = tl.load(a_ptrs, mask=inside_k, other=0.0)
        # rounded to the compute dtype first (a no-op for operands in it), so the products are
        # the tensor cores' (exact in float32) and the result matches gemm_kernel's
        acc += _operand(x, COMPUTE).to(tl.float32)[:, None, :] * _operand(w, COMPUTE).to(tl.float32)[None, :, :]
        a_ptrs += a_step
        b_ptrs += b_step
    out = tl.sum(acc, axis=2)
    if SPLIT_K > 1:
        num_tiles = tl.num_programs(0)
        out, last = _split_k_arrive(out, split * num_tiles + pid_n, num_tiles, offs_m, offs_n, M, N, PARTIALS,
                                    M * N, ARRIVALS, SPLIT_K)
    else:
        last = True
    if last:
        z, inside = _epilogue(out, offs_m, offs_n, M, N, BIAS, RES, PRE, srm, srn, spm, spn,
                              ACTIVATION, HAS_BIAS, HAS_RESIDUAL, SAVE_PREACT, PRECISE, BF16_OUT)
        tl.store(C + offs_m[:, None].to(tl.int64) * scm + offs_n[None, :] * scn, z.to(C.dtype.element_ty), mask=inside)
