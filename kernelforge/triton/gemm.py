"""Launcher of the Triton GEMM (kernelforge/triton/gemm_kernels.py): the gemm op's backend
interface, as kernelforge/reference/gemm.py defines it.

Two kernels: on Hopper (sm_90+), one matrix of fp16/bf16/e4m3 operands in their own dtype
(or tf32: float32 operands rounded by a separate pass first, see _tf32_copy), with
more than 64 rows (e4m3: any), 16-byte-aligned rows and one unit stride each, goes through TMA
descriptors (gemm_tma_kernel, which may also split K for products of few output tiles:
_split_choices); everything else (batches, fp32 / tf32, few rows, odd strides,
older GPUs) through pointers (gemm_kernel). USE_TMA overrides the choice (True / False;
None: that rule), so the tests run both kernels, also under Triton's interpreter.
A third, in Gluon (gemm_gluon.py, warp-specialized: a loader warp and two MMA warpgroups),
takes one matrix of 16-bit or e4m3 operands on sm_90, with any epilogue, when its tiles
(128 x 256; 128 x 128 for fp8 with the float32 promotion) give every SM one; USE_GLUON
overrides its rule the same way.

Tiles (and split-K's slice count) are autotuned on the GPU, once per (M rounded up to a power
of two, N, K, operand layout, dtypes, epilogue) in a process, timed by _tuning_bench: a first
call at a new shape costs the compiles and timings of the candidates (seconds), later calls
none. Under TRITON_INTERPRET=1 one small tile runs, so the CPU suite stays fast.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from kernelforge.bench.timing import time_function
from kernelforge.triton import interpreter_enabled
from kernelforge.triton._launch import (cdiv, device_capability, gluon_module, launch, next_power_of_2, on_device,
                                        sm_count)
from kernelforge.triton.gemm_kernels import gemm_kernel, gemm_tma_kernel, round_tf32_kernel

USE_TMA: Optional[bool] = None
USE_GLUON: Optional[bool] = None  # the Gluon kernel for one matrix: None its rule, False never, True any size
SPLIT_K: Optional[int] = None  # slices of K a TMA-kernel tile is split into: None the autotuner's pick
_TMA_MIN_ROWS = 65  # at 16 rows the pointer kernel's 16-row tiles win (benchmarks/gemm_sweep.py)
_PRECISION = {"fp32": "ieee", "tf32": "tf32", "fp16": "tf32", "bf16": "tf32", "fp8": "tf32"}  # not fp32: ignored
_FP8 = torch.float8_e4m3fn
_COMPUTE_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}  # 16-bit operands the tensor cores take as they are
_OPERAND_BITS = {"fp8": 8, "fp16": 16, "bf16": 16, "fp32": 32, "tf32": 32}


def _config(m, n, k, warps, stages, group=8):
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": group}, num_warps=warps,
                         num_stages=stages)


# Candidates. 16-bit operands: the Hopper shapes of Triton's matmul tutorial and smaller
# tiles for few rows (M = 16..128 tokens: at 16 rows of a 4096-wide output, 16 x 32 tiles
# give 128 programs to stream the weight) or narrow N; fp32 operands (tf32 / IEEE) take
# half the K depth for the same shared memory. The H200 sweep (benchmarks/gemm_sweep.py):
# 128 x 256 x 64 / 8 warps / 3 stages is the best at 4096^3 and 8192^3.
CONFIGS_16BIT = [
    _config(128, 256, 64, 8, 3), _config(128, 128, 64, 8, 4), _config(128, 128, 64, 4, 4),
    _config(64, 256, 64, 4, 4), _config(128, 64, 64, 4, 4), _config(64, 128, 128, 4, 3),
    _config(64, 64, 128, 4, 4), _config(32, 64, 256, 4, 3), _config(16, 64, 256, 4, 4), _config(16, 32, 256, 4, 4),
]
CONFIGS_32BIT = [
    _config(128, 128, 32, 8, 3), _config(128, 256, 32, 8, 3), _config(128, 64, 32, 4, 4),
    _config(64, 128, 32, 4, 4), _config(64, 64, 64, 4, 3), _config(32, 64, 128, 4, 3),
]
CONFIGS_TMA = [  # the fastest of benchmarks/gemm_sweep.py's TMA candidates at each of its shapes
    _config(128, 256, 64, 8, 3), _config(128, 128, 64, 4, 4), _config(128, 128, 64, 8, 4),
    _config(128, 128, 128, 8, 3), _config(64, 256, 64, 4, 4), _config(64, 128, 64, 4, 4),
    # more bytes in flight an SM, for few-row products (each SM streams its part of b): the
    # autotuner's picks at 128 x 4096 x 4096 / 14336, split or not (gemm_split_k_experiment.py --deep)
    _config(128, 128, 64, 4, 6), _config(64, 128, 128, 4, 4),
]
# tf32 through TMA: 4-byte operands at half the 16-bit K depth (the same shared-memory bytes per
# stage), leaving room for the float32 output tile the epilogue stores through shared memory.
CONFIGS_TMA_32 = [
    _config(128, 128, 32, 8, 4), _config(128, 128, 32, 4, 4), _config(128, 256, 32, 8, 3),
    _config(64, 256, 32, 4, 4), _config(128, 64, 32, 4, 4), _config(64, 128, 32, 4, 4),
]
# e4m3: the 16-bit shapes with twice the K depth (the same shared-memory bytes per stage), and
# no tile under 64 rows (Hopper's fp8 tensor-core instruction is 64 rows tall per warp group).
# The H200 sweep (benchmarks/gemm_sweep.py --fp8): with fast accumulation 128x256x128 is the
# best (1.02x / 0.98x _scaled_mm at 4096^3 / 8192^3); with the float32 promotion it is 0.42x
# (two 128x256 accumulators in registers), where 128x128x256 and 256x128x128 / 8 warps give
# 0.80-0.83x.
CONFIGS_FP8 = [
    _config(128, 256, 128, 8, 3), _config(128, 128, 256, 8, 3), _config(256, 128, 128, 8, 3),
    _config(128, 128, 128, 8, 4), _config(128, 128, 128, 4, 4), _config(64, 256, 128, 4, 4),
    _config(128, 64, 128, 4, 4), _config(64, 128, 128, 4, 4), _config(64, 64, 256, 4, 4), _config(64, 32, 256, 4, 4),
    _config(128, 128, 128, 4, 6),  # split-K's pick at 128 x 4096 x 14336 (gemm_split_k_experiment.py --deep)
]
INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)
AUTOTUNE_KEY = ["M_BUCKET", "N", "K", "sak", "sbn", "COMPUTE", "ACTIVATION", "HAS_BIAS", "HAS_RESIDUAL",
                "SAVE_PREACT"]
TMA_AUTOTUNE_KEY = ["M_BUCKET", "N", "K", "A_K_CONTIGUOUS", "B_N_CONTIGUOUS", "COMPUTE", "ACTIVATION", "HAS_BIAS",
                    "HAS_RESIDUAL", "SAVE_PREACT", "SPLIT_CHOICES"]


def _prune(configs, named_args, **kwargs):
    """Drop tiles wider than the problem along M or N (rounded up to a power of two), keeping
    at least the narrowest: a 128-row tile over 16 token rows computes 8x the work, and each
    candidate costs the autotuner a compile and a timing."""
    def narrowest_fit(dim, extent):
        smallest = min(c.kwargs[dim] for c in configs)
        return max(next_power_of_2(extent), smallest)

    max_m, max_n = narrowest_fit("BLOCK_M", named_args["M"]), narrowest_fit("BLOCK_N", named_args["N"])
    return [c for c in configs if c.kwargs["BLOCK_M"] <= max_m and c.kwargs["BLOCK_N"] <= max_n]


# Split-K (gemm_tma_kernel's SPLIT_K): where _split_choices allows it, every TMA tile of at
# most 128 x 128 is also a candidate at 2 and 4 slices of K.
SPLITS = (2, 4)
_SPLIT_K_MIN_DEPTH = 512  # K a slice keeps at least


def _split_choices(M: int, N: int, K: int, sms: int) -> tuple:
    """Slice counts the autotuner may pick from: SPLIT_K if set; else 1, and, for products
    whose 128 x 128 tiles fill at most half the SMs, each of SPLITS that leaves every slice
    _SPLIT_K_MIN_DEPTH of K. Splitting a product that fills the GPU already only adds the
    partials' traffic (0.47-0.81x at 128 x 14336 x 4096, gemm/8a845ed-split-k-two-pass/)."""
    if SPLIT_K is not None:
        return (SPLIT_K,)
    if cdiv(M, 128) * cdiv(N, 128) * 2 > sms:
        return (1,)
    return (1, *(s for s in SPLITS if K // s >= _SPLIT_K_MIN_DEPTH))


def _split_mask(choices: tuple) -> int:
    """The slice counts as one int (bit s set: s may be chosen): the kernel's SPLIT_CHOICES,
    an argument only the autotuner's key and pruning read."""
    return sum(1 << s for s in choices)


def _prune_tma(configs, named_args, **kwargs):
    """_prune's tiles, each at every slice count SPLIT_CHOICES allows (a tile over 128 x 128
    unsplit only)."""
    mask = named_args["SPLIT_CHOICES"]
    splits = [s for s in range(mask.bit_length()) if mask >> s & 1]
    return [triton.Config({**c.kwargs, "SPLIT_K": s}, num_warps=c.num_warps, num_stages=c.num_stages,
                          pre_hook=c.pre_hook)
            for s in splits for c in _prune(configs, named_args)
            if s == 1 or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128]


def _tma_block_shapes(nargs):
    """Autotuner pre-hook: each descriptor's block is the config's tile, in the operand's
    memory order."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk] if nargs["A_K_CONTIGUOUS"] else [bk, bm]
    nargs["b_desc"].block_shape = [bk, bn] if nargs["B_N_CONTIGUOUS"] else [bn, bk]
    nargs["c_desc"].block_shape = [bm, bn]


def _tuning_bench(kernel_call, quantiles):
    """The autotuners' timing: device time with an L2 flush before each run and the GPU held
    until the run is queued (kernelforge.bench.timing.time_function), the quantiles Triton
    asks for. Triton's own do_bench records events around each call as it is queued; a
    few-row product runs in 10-20 us, less than the host takes to launch it, so every
    candidate timed as the host's pace and the picks were noise: 64x128x128 at 2 slices ran
    20.6 us where the tuner's pick ran 23.3 (128 x 4096 x 4096, H200)."""
    timing = time_function(kernel_call, "cuda", warmup=3, repeat=25)
    by_quantile = {0.5: timing.median_ms, 0.2: timing.p20_ms, 0.8: timing.p80_ms}
    return [by_quantile[q] for q in quantiles] if quantiles else timing.median_ms


def _even_k(args):
    return args["K"] % args["BLOCK_K"] == 0


@functools.lru_cache(maxsize=None)
def _pointer_kernels(operand_bits: int):
    """(the autotuned pointer kernel, or None under the interpreter; the kernel at a given
    config). One tuner per operand width."""
    plain = triton.heuristics({"EVEN_K": _even_k})(gemm_kernel)
    if interpreter_enabled():
        return None, plain
    configs = {8: CONFIGS_FP8, 16: CONFIGS_16BIT, 32: CONFIGS_32BIT}[operand_bits]
    return triton.autotune(configs=configs, key=AUTOTUNE_KEY, prune_configs_by={"early_config_prune": _prune},
                           do_bench=_tuning_bench)(plain), plain


@functools.lru_cache(maxsize=None)
def _tma_kernels(operand_bits: int):
    if interpreter_enabled():
        return None, gemm_tma_kernel
    configs = [triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=_tma_block_shapes)
               for c in {8: CONFIGS_FP8, 16: CONFIGS_TMA, 32: CONFIGS_TMA_32}[operand_bits]]
    return triton.autotune(configs=configs, key=TMA_AUTOTUNE_KEY, prune_configs_by={"early_config_prune": _prune_tma},
                           do_bench=_tuning_bench)(gemm_tma_kernel), gemm_tma_kernel


# Per call signature: the autotuner's pick as (config kwargs, the kernel to launch, every
# keyword argument of its launch). Triton's Autotuner rebuilds a dict of all ~30 arguments and
# its cache key on every call (25 us a call under cProfile); after the first call at a
# signature, the kernel launches at the chosen config directly, through
# kernelforge.triton._launch.launch (Triton's own launch path cost 27 us of a 76 us kf.gemm
# call at 16x4096x4096 on the H200 host: benchmarks/host_timeline.py).
_CHOSEN: dict = {}


def _launch(kernels, signature, grid, args, kwargs, set_block_shapes=None, heuristics=None, interpreter_config=None):
    """Launch a (tuner, plain) pair at the config tuned for `signature` (every argument the
    tuner's key and its dtype list hold, and more), tuning on its first call; later calls
    launch the kernel itself at that config through kernelforge.triton._launch.launch, with
    `heuristics(config kwargs)` giving the constexprs a triton.heuristics wrapper would.
    Under the interpreter: the one small config (and `interpreter_config`, the tuned
    constexprs it lacks)."""
    tuner, plain = kernels
    if tuner is None:
        config = {**INTERPRETER_CONFIG, **(interpreter_config or {})}
        if set_block_shapes is not None:
            set_block_shapes(config)
        plain[grid](*args, **kwargs, **config)
        return
    chosen = _CHOSEN.get(signature)
    if chosen is None:
        tuner[grid](*args, **kwargs)
        config = tuner.best_config
        extra = heuristics(config.kwargs) if heuristics is not None else {}
        _CHOSEN[signature] = (config.kwargs, plain.fn if heuristics is not None else plain,
                              {**kwargs, **extra, **config.all_kwargs()})
        return
    config_kwargs, kernel, launch_kwargs = chosen
    if set_block_shapes is not None:
        set_block_shapes(config_kwargs)
    launch(kernel, grid(config_kwargs), *args, **launch_kwargs)


def _tma_descriptor(t: torch.Tensor, unit_dim: int) -> Optional[TensorDescriptor]:
    """A TMA descriptor of t (2-D) with its unit-stride dim last, or None when TMA cannot read
    it that way (that stride is not 1, rows are not a multiple of 16 bytes apart, the start
    is not 16-byte aligned, an extent is 0). Its block shape is set per config later."""
    view = t if unit_dim == 1 else t.t()
    rows, cols = view.shape
    if rows == 0 or cols == 0 or view.data_ptr() % 16:
        return None
    if view.stride(1) != 1 and cols > 1:
        return None
    # A stride over an extent of 1 is never followed: any aligned value describes the view.
    row_stride = view.stride(0) if rows > 1 else -(-cols // 8) * 8
    if row_stride * view.element_size() % 16:
        return None
    return TensorDescriptor(view, [rows, cols], [row_stride, 1], [16, 16])


def _tma_operands(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, compute: str):
    """Descriptors of a, b and out and the operands' memory orders for gemm_tma_kernel, or
    None when it cannot take them: a batch, operands not 16-bit in the compute dtype, or a
    layout TMA cannot read."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": _FP8, "tf32": torch.float32}.get(compute)
    if a.shape[0] != 1 or b.shape[0] != 1 or not a.dtype == b.dtype == dtype:
        return None
    found = {}
    for name, t, natural in (("a", a[0], "A_K_CONTIGUOUS"), ("b", b[0], "B_N_CONTIGUOUS")):
        # e4m3 and tf32: K-major only (_k_major / _tf32_copy made them so), the order their
        # tensor-core instruction reads
        unit_dims = ((1,) if name == "a" else (0,)) if compute in ("fp8", "tf32") else (1, 0)
        for unit_dim in unit_dims:
            desc = _tma_descriptor(t, unit_dim)
            if desc is not None:
                found[name], found[natural] = desc, unit_dim == 1
                break
        else:
            return None
    out_desc = _tma_descriptor(out[0], 1)
    if out_desc is None:
        return None
    return (found["a"], found["b"], out_desc), {k: found[k] for k in ("A_K_CONTIGUOUS", "B_N_CONTIGUOUS")}


def _take_gluon(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: Optional[torch.Tensor],
                residual: Optional[torch.Tensor], fast_accum: bool) -> bool:
    """One matrix on Hopper: the warp-specialized Gluon kernel (gemm_gluon.py) where it takes
    it (USE_GLUON True: whatever its size)."""
    if USE_GLUON is False or interpreter_enabled() or a.device.type != "cuda":
        return False
    gluon = gluon_module("gemm_gluon")
    return gluon is not None and gluon.takes(a, b, out, device_capability(a.device), sm_count(a.device),
                                             bias=bias, residual=residual, fast_accum=fast_accum,
                                             any_size=USE_GLUON is True)


def _take_tma(a: torch.Tensor, compute: str) -> bool:
    if USE_TMA is not None:
        return USE_TMA
    if interpreter_enabled() or a.device.type != "cuda" or device_capability(a.device)[0] < 9:
        return False
    # e4m3 tiles are 64 rows or more either way; at 16 rows the pointer kernel gives 0.67-0.85x
    # torch._scaled_mm, the TMA kernel 1.01-1.46x (H200, gemm/97faeaf-split-k/experiment/)
    return a.shape[1] >= _TMA_MIN_ROWS or compute == "fp8"


# tf32 through TMA pays two rounding passes (launches and bytes) up front. H200, gemm_tf32
# suite (gemm/cee7381/): 4096^3 0.47x -> 0.73x cuBLAS and 8192^3 0.56x -> 0.89x with it, but
# 1024^3 0.32x -> 0.12x and 2048^3 0.48x -> 0.33x: only products above 2048^3 take it.
_TF32_TMA_MIN_WORK = 2048 ** 3


def _take_tf32_tma(a: torch.Tensor, b: torch.Tensor) -> bool:
    if USE_TMA is not None or not _take_tma(a, "tf32"):
        return _take_tma(a, "tf32")
    return a.shape[1] * a.shape[2] * b.shape[2] > _TF32_TMA_MIN_WORK


def _strides(t: Optional[torch.Tensor], fallback: torch.Tensor):
    return tuple((t if t is not None else fallback).stride())


def _k_major(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 a and b with K as their unit-stride dim, copied where it is not: Hopper's fp8
    tensor-core instruction reads both operands K-major from shared memory, and a transpose
    of 8-bit data on chip is not something to count on from Triton. A Linear weight (N, K)
    read as b = W^T, and row-major activations, are K-major already: no copy."""
    if a.stride(2) != 1 and a.shape[2] > 1:
        a = a.transpose(1, 2).contiguous().transpose(1, 2)
    if b.stride(1) != 1 and b.shape[1] > 1:
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    return a, b


def _tf32_copy(t: torch.Tensor, k_dim: int) -> torch.Tensor:
    """t (1, R, C) rounded to tf32 (float32) into a fresh tensor whose unit-stride dim is
    k_dim (1: rows, a's K; 0: columns, b's K): one pass, so the TMA kernel can feed the tensor
    cores as they are (they truncate). Costs a read and a write of each operand (~15% of a
    4096^3 GEMM), where the pointer kernel rounds every tile again on each use."""
    R, C = t.shape[1:]
    y = torch.empty((R, C) if k_dim == 1 else (C, R), device=t.device, dtype=torch.float32)
    y = y if k_dim == 1 else y.t()
    launch(round_tf32_kernel, (cdiv(R, 64), cdiv(C, 64)), t[0], y, R, C, *t.stride()[1:], *y.stride(),
           BLOCK_R=64, BLOCK_C=64)
    return y.unsqueeze(0)


def gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
         activation: Optional[str], compute: str, out_dtype: torch.dtype, save_preact: bool,
         scale_a: Optional[torch.Tensor] = None, scale_b: Optional[torch.Tensor] = None, fast_accum: bool = False
         ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    scaled = compute == "fp8"
    if bias is not None:  # the kernels read bias[n] at n (no stride); a copy of N elements where needed
        bias = bias.contiguous()
    if scaled:
        a, b = _k_major(a, b)
    elif compute == "tf32" and a.shape[0] == b.shape[0] == 1 and _take_tf32_tma(a, b):
        with on_device(a):
            a, b = _tf32_copy(a, 1), _tf32_copy(b, 0)
    batch, M, K = a.shape
    N = b.shape[2]
    out = torch.empty(batch, M, N, dtype=out_dtype, device=a.device)
    preact = torch.empty_like(out) if save_preact else None
    if (batch == 1 and (scaled or _COMPUTE_DTYPE.get(compute) == a.dtype)
            and _take_gluon(a[0], b[0], out[0], bias, None if residual is None else residual[0], fast_accum)):
        first = {name: None if t is None else t[0] for name, t in
                 (("residual", residual), ("preact", preact), ("scale_a", scale_a), ("scale_b", scale_b))}
        with on_device(a):
            gluon_module("gemm_gluon").gemm_into(a[0], b[0], out[0], sm_count(a.device), bias=bias,
                                                 activation=activation, fast_accum=fast_accum, **first)
        return out, preact
    epilogue = dict(ACTIVATION=activation or "none", HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
                    SAVE_PREACT=save_preact, PRECISE=not interpreter_enabled(),
                    BF16_OUT=out_dtype == torch.bfloat16 and not interpreter_enabled(), SCALED=scaled,
                    FP8_PRECISE=scaled and not fast_accum)
    # (batch, row) strides of scale_a and (batch, column) of scale_b; unscaled: never read
    scale_strides = (*scale_a.stride(), *scale_b.stride()) if scaled else (0, 0, 0, 0)
    pointers = (bias if bias is not None else out, residual if residual is not None else out,
                preact if preact is not None else out, scale_a if scaled else out, scale_b if scaled else out)
    tma = _tma_operands(a, b, out, compute) if _take_tma(a, compute) else None
    sms = sm_count(a.device)

    def grid(meta):
        tiles = batch * cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])
        return (max(1, min(sms, tiles)),)

    dtypes = (a.dtype, b.dtype, out.dtype, None if bias is None else bias.dtype,
              None if residual is None else residual.dtype)
    with on_device(a):
        if tma is not None:
            _launch_tma(tma, out, pointers, residual, preact, M, N, K, compute, epilogue, sms, dtypes,
                        scale_strides)
            return out, preact
        signature = ("pointers", next_power_of_2(M), N, K, a.stride(2), b.stride(2), compute, *dtypes,
                     *epilogue.values())
        _launch(_pointer_kernels(_OPERAND_BITS[compute]), signature, grid,
                (a, b, out, *pointers, M, N, K, *a.stride(), *b.stride(), *out.stride(), *_strides(residual, out),
                 *_strides(preact, out), *scale_strides, batch, next_power_of_2(M)),
                dict(COMPUTE=compute, PRECISION=_PRECISION[compute], **epilogue),
                heuristics=lambda config: {"EVEN_K": _even_k({"K": K, **config})})
    return out, preact


def _launch_tma(tma, out, pointers, residual, preact, M, N, K, compute, epilogue, sms, dtypes, scale_strides):
    descriptors, orders = tma
    choices = _split_choices(M, N, K, sms)
    signature = ("tma", next_power_of_2(M), N, K, compute, choices, *orders.values(), *dtypes, *epilogue.values())
    chosen = _CHOSEN.get(signature)
    # the partials and arrival counts of split-K, for the largest split the call may take
    split = max(choices) if chosen is None else chosen[0]["SPLIT_K"]
    partials, arrivals = out, out  # not read unsplit
    if split > 1:
        partials = torch.empty(split, M, N, device=out.device, dtype=torch.float32)
        arrivals = _arrival_counts(out.device, cdiv(M, 32) * cdiv(N, 32))  # every tile is 32 x 32 or larger

    def set_block_shapes(config_kwargs):  # what the autotuner's pre-hook does when it launches
        _tma_block_shapes(dict(zip(("a_desc", "b_desc", "c_desc"), descriptors), **orders, **config_kwargs))

    def grid(meta):  # at most `sms` programs, each walking the work units `sms` apart
        return (max(1, min(sms, cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]) * meta["SPLIT_K"])),)

    _launch(_tma_kernels(_OPERAND_BITS[compute]), signature, grid,
            (*descriptors, *pointers, partials, arrivals, M, N, K, *_strides(residual, out)[1:],
             *_strides(preact, out)[1:], scale_strides[1], scale_strides[3], M * N, next_power_of_2(M),
             _split_mask(choices), sms),
            dict(COMPUTE=compute, PRECISION=_PRECISION[compute], **orders, **epilogue),
            set_block_shapes, interpreter_config={"SPLIT_K": choices[-1]})


# Split-K's arrival counts, one zeroed int32 buffer per (device, stream): gemm_tma_kernel sets
# every count it uses back to zero before it ends, so launches in one stream (which run one
# after another) share a buffer without a memset, and streams never share one.
_ARRIVALS: dict = {}


def _arrival_counts(device: torch.device, count: int) -> torch.Tensor:
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    counts = _ARRIVALS.get(key)
    if counts is None or counts.numel() < count:
        counts = torch.zeros(max(count, 4096), device=device, dtype=torch.int32)
        _ARRIVALS[key] = counts
    return counts
