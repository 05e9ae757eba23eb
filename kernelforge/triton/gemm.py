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
overrides its rule the same way. A fourth, on the CUDA cores (gemv.py), takes one matrix of a
single row (a decoding step's), any compute but fp8; USE_GEMV overrides its rule.

Tiles (and split-K's slice count) are autotuned on the GPU, once per (M rounded up to a power
of two, N, K, operand layout, dtypes, epilogue) in a process, timed by bench.timing.autotune_timing: a first
call at a new shape costs the compiles and timings of the candidates (seconds), later calls
none. Under TRITON_INTERPRET=1 one small tile runs, so the CPU suite stays fast.

Host time: everything a launch needs but the tensors is a function of the call's signature
(shapes, strides, dtypes, device, 16-byte alignment, epilogue, the USE_* overrides), so it is
worked out once per signature (_Plan: which kernel, the copies of the operands it needs, its
integer arguments and constexprs) and, once the autotuner has chosen, the config's grid and
keywords, and TMA descriptor templates of the chosen blocks (checked once, rebased on each
call's tensors: `rebased`). A later call at the signature allocates the output, binds its
tensors and launches the chosen config through kernelforge.triton._launch.launch: no tuner,
heuristics, rule or descriptor check runs again (before, the launcher's Python around the launch
took 17 of the 63 us of host time a 16x4096x4096 bf16 call cost on the H200 host:
benchmarks/results/nvidia-h200/0.1.0/host/4637225-host-timeline/host-timeline-4637225.log).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from kernelforge import _eager_plans
from kernelforge.bench.timing import autotune_timing
from kernelforge.triton import interpreter_enabled
from kernelforge.triton import gemv
from kernelforge.triton._launch import (cdiv, device_capability, gluon_module, launch, next_power_of_2, on_device,
                                        sm_count, zeroed_counters)
from kernelforge.triton.gemm_kernels import gemm_kernel, gemm_tma_kernel, round_tf32_kernel
from kernelforge.triton.tma_descriptors import descriptor_template, rebased, tma_layouts

# The kernels above were made interpreted or compiled when they were defined: read once, not per call
_INTERPRETER = interpreter_enabled()

USE_TMA: Optional[bool] = None
USE_GLUON: Optional[bool] = None  # the Gluon kernel for one matrix: None its rule, False never, True any size
USE_GEMV: Optional[bool] = None  # the few-row kernel (gemv.py): None its rule (one row), False never, True <= 8 rows
SPLIT_K: Optional[int] = None  # slices of K a TMA-kernel tile is split into: None the autotuner's pick


def overrides() -> tuple:
    """The four settings above: part of every eager plan's signature (kernelforge._eager_plans), so
    a call recorded under one setting is not replayed under another."""
    return USE_TMA, USE_GLUON, USE_GEMV, SPLIT_K


_eager_plans.add_state(overrides)
_TMA_MIN_ROWS = 65  # at 16 rows the pointer kernel's 16-row tiles win (benchmarks/tuning/gemm_sweep.py)
_PRECISION = {"fp32": "ieee", "tf32": "tf32", "fp16": "tf32", "bf16": "tf32", "fp8": "tf32"}  # not fp32: ignored
_COMPUTE_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}  # 16-bit operands the tensor cores take as they are
_OPERAND_BITS = {"fp8": 8, "fp16": 16, "bf16": 16, "fp32": 32, "tf32": 32}


def _config(m, n, k, warps, stages, group=8):
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": group}, num_warps=warps,
                         num_stages=stages)


# Candidates. 16-bit operands: the Hopper shapes of Triton's matmul tutorial and smaller
# tiles for few rows (M = 16..128 tokens: at 16 rows of a 4096-wide output, 16 x 32 tiles
# give 128 programs to stream the weight) or narrow N; fp32 operands (tf32 / IEEE) take
# half the K depth for the same shared memory. The H200 sweep (benchmarks/tuning/gemm_sweep.py):
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
CONFIGS_TMA = [  # the fastest of benchmarks/tuning/gemm_sweep.py's TMA candidates at each of its shapes
    _config(128, 256, 64, 8, 3), _config(128, 128, 64, 4, 4), _config(128, 128, 64, 8, 4),
    _config(128, 128, 128, 8, 3), _config(64, 256, 64, 4, 4), _config(64, 128, 64, 4, 4),
    # more bytes in flight an SM, for few-row products (each SM streams its part of b): the
    # autotuner's picks at 128 x 4096 x 4096 / 14336, split or not (the split-K experiment's --deep
    # candidates: docs/notes/gemm.md)
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
# The H200 sweep (benchmarks/tuning/gemm_sweep.py --fp8): with fast accumulation 128x256x128 is the
# best (1.02x / 0.98x _scaled_mm at 4096^3 / 8192^3); with the float32 promotion it is 0.42x
# (two 128x256 accumulators in registers), where 128x128x256 and 256x128x128 / 8 warps give
# 0.80-0.83x.
CONFIGS_FP8 = [
    _config(128, 256, 128, 8, 3), _config(128, 128, 256, 8, 3), _config(256, 128, 128, 8, 3),
    _config(128, 128, 128, 8, 4), _config(128, 128, 128, 4, 4), _config(64, 256, 128, 4, 4),
    _config(128, 64, 128, 4, 4), _config(64, 128, 128, 4, 4), _config(64, 64, 256, 4, 4), _config(64, 32, 256, 4, 4),
    _config(128, 128, 128, 4, 6),  # split-K's pick at 128 x 4096 x 14336 (docs/notes/gemm.md, --deep)
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


def _even_k(args):
    return args["K"] % args["BLOCK_K"] == 0


@functools.lru_cache(maxsize=None)
def _pointer_kernels(operand_bits: int):
    """The autotuned pointer kernel (None under the interpreter), one tuner per operand width.
    Its heuristics wrapper gives EVEN_K on the tuning calls; later launches pass EVEN_K
    themselves (_PointerLaunch)."""
    if _INTERPRETER:
        return None
    configs = {8: CONFIGS_FP8, 16: CONFIGS_16BIT, 32: CONFIGS_32BIT}[operand_bits]
    return triton.autotune(configs=configs, key=AUTOTUNE_KEY, prune_configs_by={"early_config_prune": _prune},
                           do_bench=autotune_timing)(triton.heuristics({"EVEN_K": _even_k})(gemm_kernel))


@functools.lru_cache(maxsize=None)
def _tma_kernels(operand_bits: int):
    """The autotuned TMA kernel (None under the interpreter), one tuner per operand width."""
    if _INTERPRETER:
        return None
    configs = [triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=_tma_block_shapes)
               for c in {8: CONFIGS_FP8, 16: CONFIGS_TMA, 32: CONFIGS_TMA_32}[operand_bits]]
    return triton.autotune(configs=configs, key=TMA_AUTOTUNE_KEY, prune_configs_by={"early_config_prune": _prune_tma},
                           do_bench=autotune_timing)(gemm_tma_kernel)


# ----------------------------------------------------------------------------- TMA descriptors
def _tma_operands(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, compute: str):
    """(descriptors of a, b and out, whose block shapes a config sets, and the operands' memory
    orders) for gemm_tma_kernel, or None (tma_descriptors.tma_layouts); benchmarks/tuning/gemm_sweep.py
    launches it so."""
    found = tma_layouts(a, b, out, compute)
    if found is None:
        return None
    layouts, orders = found
    return tuple(TensorDescriptor(t, *layout, [16, 16]) for t, layout in zip((a, b, out), layouts)), orders


# ----------------------------------------------------------------------------- routes
def _take_gluon(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: Optional[torch.Tensor],
                residual: Optional[torch.Tensor], fast_accum: bool) -> bool:
    """One matrix on Hopper: the warp-specialized Gluon kernel (gemm_gluon.py) where it takes
    it (USE_GLUON True: whatever its size)."""
    if USE_GLUON is False or _INTERPRETER or a.device.type != "cuda":
        return False
    gluon = gluon_module("gemm_gluon")
    return gluon is not None and gluon.takes(a, b, out, device_capability(a.device), sm_count(a.device),
                                             bias=bias, residual=residual, fast_accum=fast_accum,
                                             any_size=USE_GLUON is True)


def _take_tma(a: torch.Tensor, compute: str) -> bool:
    if USE_TMA is not None:
        return USE_TMA
    if _INTERPRETER or a.device.type != "cuda" or device_capability(a.device)[0] < 9:
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


class _PointerLaunch:
    """gemm_kernel at one call signature: integer arguments, constexprs, and once the autotuner
    has chosen (here or at another plan of the same tuner signature) the config's grid and keywords."""

    def __init__(self, a, b, out, residual, preact, compute, epilogue, sms, dtypes, scale_strides):
        batch, M, K = a.shape
        N = b.shape[2]
        self.tuner = _pointer_kernels(_OPERAND_BITS[compute])
        self.ints = (M, N, K, *a.stride(), *b.stride(), *out.stride(), *_strides(residual, out),
                     *_strides(preact, out), *scale_strides, batch, next_power_of_2(M))
        self.kwargs = dict(COMPUTE=compute, PRECISION=_PRECISION[compute], **epilogue)
        self.signature = ("pointers", next_power_of_2(M), N, K, a.stride(2), b.stride(2), compute, *dtypes,
                          *epilogue.values())
        self.work = (batch, M, N, sms)
        chosen = _CHOSEN.get(self.signature)
        if self.tuner is None:  # the interpreter: one small tile
            chosen = (INTERPRETER_CONFIG, gemm_kernel,
                      {**self.kwargs, "EVEN_K": K % INTERPRETER_CONFIG["BLOCK_K"] == 0, **INTERPRETER_CONFIG})
        self.chosen = None if chosen is None else (chosen[1], self._grid(chosen[0]), chosen[2])

    def _grid(self, meta):
        batch, M, N, sms = self.work
        return (max(1, min(sms, batch * cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]))),)

    def __call__(self, a, b, out, bias, residual, preact, scale_a, scale_b):
        tensors = (a, b, out, out if bias is None else bias, out if residual is None else residual,
                   out if preact is None else preact, out if scale_a is None else scale_a,
                   out if scale_b is None else scale_b)
        chosen = self.chosen
        if chosen is not None:
            kernel, grid, launch_kwargs = chosen
            launch(kernel, grid, *tensors, *self.ints, **launch_kwargs)
            return
        launch(self.tuner, self._grid, *tensors, *self.ints, **self.kwargs)  # through launch: an eager plan sees it
        config = self.tuner.best_config
        launch_kwargs = {**self.kwargs, "EVEN_K": self.ints[2] % config.kwargs["BLOCK_K"] == 0, **config.all_kwargs()}
        _CHOSEN[self.signature] = (config.kwargs, gemm_kernel, launch_kwargs)
        self.chosen = (gemm_kernel, self._grid(config.kwargs), launch_kwargs)


class _TmaLaunch:
    """gemm_tma_kernel at one call signature: descriptor layouts, integer arguments, constexprs, and
    once the autotuner has chosen the config's grid, keywords, descriptor templates and slice count."""

    def __init__(self, a, b, out, layouts, orders, residual, preact, compute, epilogue, sms, dtypes, scale_strides):
        M, K, N = a.shape[1], a.shape[2], b.shape[2]
        choices = _split_choices(M, N, K, sms)
        self.tuner = _tma_kernels(_OPERAND_BITS[compute])
        self.layouts, self.orders, self.choices = layouts, orders, choices
        self.ints = (M, N, K, *_strides(residual, out)[1:], *_strides(preact, out)[1:], scale_strides[1],
                     scale_strides[3], M * N, next_power_of_2(M), _split_mask(choices), sms)
        self.kwargs = dict(COMPUTE=compute, PRECISION=_PRECISION[compute], **orders, **epilogue)
        self.signature = ("tma", next_power_of_2(M), N, K, compute, choices, *orders.values(), *dtypes,
                          *epilogue.values())
        self.work = (M, N, sms, out.device)
        chosen = _CHOSEN.get(self.signature)
        if self.tuner is None:  # the interpreter: one small tile, at the last slice count allowed
            config = {**INTERPRETER_CONFIG, "SPLIT_K": choices[-1]}
            chosen = (config, gemm_tma_kernel, {**self.kwargs, **config})
        self.chosen = None if chosen is None else self._ready((a, b, out), *chosen)

    def _ready(self, bases, config, kernel, launch_kwargs):
        """(kernel, grid, keywords, descriptor templates, slice count) of a chosen config."""
        bm, bn, bk, split = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["SPLIT_K"]
        blocks = ([bm, bk] if self.orders["A_K_CONTIGUOUS"] else [bk, bm],
                  [bk, bn] if self.orders["B_N_CONTIGUOUS"] else [bn, bk], [bm, bn])
        templates = tuple(descriptor_template(TensorDescriptor(base, *layout, block))
                          for base, layout, block in zip(bases, self.layouts, blocks))
        return kernel, self._grid(config), launch_kwargs, templates, split

    def _grid(self, meta):  # at most `sms` programs, each walking the work units `sms` apart
        M, N, sms, _ = self.work
        return (max(1, min(sms, cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]) * meta["SPLIT_K"])),)

    def __call__(self, a, b, out, bias, residual, preact, scale_a, scale_b):
        chosen = self.chosen
        # the partials and arrival counts of split-K, for the largest split the call may take
        split = max(self.choices) if chosen is None else chosen[4]
        partials = arrivals = out  # not read unsplit
        if split > 1:
            M, N, _, device = self.work
            partials = torch.empty((split, M, N), device=device, dtype=torch.float32)
            arrivals = zeroed_counters(device, cdiv(M, 32) * cdiv(N, 32))  # every tile is 32 x 32 or larger
        tail = (out if bias is None else bias, out if residual is None else residual,
                out if preact is None else preact, out if scale_a is None else scale_a,
                out if scale_b is None else scale_b, partials, arrivals, *self.ints)
        if chosen is not None:
            kernel, grid, launch_kwargs, (a_desc, b_desc, c_desc), _ = chosen
            launch(kernel, grid, rebased(a_desc, a), rebased(b_desc, b), rebased(c_desc, out), *tail, **launch_kwargs)
            return
        # the tuner's pre-hook sets each config's block shapes on these
        descriptors = (TensorDescriptor(base, *layout, [16, 16]) for base, layout in zip((a, b, out), self.layouts))
        launch(self.tuner, self._grid, *descriptors, *tail, **self.kwargs)
        config = self.tuner.best_config
        launch_kwargs = {**self.kwargs, **config.all_kwargs()}
        _CHOSEN[self.signature] = (config.kwargs, gemm_tma_kernel, launch_kwargs)
        self.chosen = self._ready((a, b, out), config.kwargs, gemm_tma_kernel, launch_kwargs)


def _route(a, b, out, bias, residual, preact, scale_a, scale_b, activation, compute, fast_accum):
    """The launch a call signature takes (its first call's tensors, after _Plan's copies): the
    Gluon kernel's plan, or _TmaLaunch, or _PointerLaunch; each is called with the tensors."""
    scaled = compute == "fp8"
    dtypes = (a.dtype, b.dtype, out.dtype, None if bias is None else bias.dtype,
              None if residual is None else residual.dtype)
    if USE_TMA is not True and USE_GLUON is not True and gemv.takes(a, compute, USE_GEMV):  # unless another is forced
        epilogue = dict(ACTIVATION=activation or "none", HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
                        SAVE_PREACT=preact is not None, PRECISE=not _INTERPRETER,
                        BF16_OUT=out.dtype == torch.bfloat16 and not _INTERPRETER)
        return gemv.Launch(a, b, out, residual, preact, compute, epilogue, dtypes, SPLIT_K)
    sms = sm_count(a.device)
    if a.shape[0] == 1 and (scaled or _COMPUTE_DTYPE.get(compute) == a.dtype):
        first = [None if t is None else t[0] for t in (residual, preact, scale_a, scale_b)]
        if _take_gluon(a[0], b[0], out[0], bias, first[0], fast_accum):
            plan = gluon_module("gemm_gluon").Plan
            return plan(a[0], b[0], out[0], sms, bias=bias, residual=first[0], preact=first[1], scale_a=first[2],
                        scale_b=first[3], activation=activation, fast_accum=fast_accum)
    epilogue = dict(ACTIVATION=activation or "none", HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
                    SAVE_PREACT=preact is not None, PRECISE=not _INTERPRETER,
                    BF16_OUT=out.dtype == torch.bfloat16 and not _INTERPRETER, SCALED=scaled,
                    FP8_PRECISE=scaled and not fast_accum)
    # (batch, row) strides of scale_a and (batch, column) of scale_b; unscaled: never read
    scale_strides = (*scale_a.stride(), *scale_b.stride()) if scaled else (0, 0, 0, 0)
    tma = tma_layouts(a, b, out, compute) if _take_tma(a, compute) else None
    if tma is not None:
        return _TmaLaunch(a, b, out, *tma, residual, preact, compute, epilogue, sms, dtypes, scale_strides)
    return _PointerLaunch(a, b, out, residual, preact, compute, epilogue, sms, dtypes, scale_strides)


class _Plan:
    """One call signature's launch (see the module docstring): the operand copies it needs, the
    output's shape, and its route (_route), made on its first call's tensors."""

    __slots__ = ("device", "device_index", "fp8", "tf32_copy", "contiguous_bias", "out_shape", "out_dtype",
                 "save_preact", "options", "route")

    def __init__(self, a, b, bias, activation, compute, out_dtype, save_preact, fast_accum):
        self.device = a.device
        self.device_index = self.device.index if self.device.type == "cuda" else None
        self.fp8 = compute == "fp8"
        self.tf32_copy = compute == "tf32" and a.shape[0] == 1 == b.shape[0] and _take_tf32_tma(a, b)
        # the kernels read bias[n] at n (no stride): a copy of N elements where needed
        self.contiguous_bias = bias is not None and not bias.is_contiguous()
        self.out_shape = (a.shape[0], a.shape[1], b.shape[2])
        self.out_dtype, self.save_preact = out_dtype, save_preact
        self.options = (activation, compute, fast_accum)
        self.route = None

    def run(self, a, b, bias, residual, scale_a, scale_b, out_shape):
        if self.contiguous_bias:
            bias = bias.contiguous()
        if self.fp8:
            a, b = _k_major(a, b)
        elif self.tf32_copy:
            with on_device(a):
                a, b = _tf32_copy(a, 1), _tf32_copy(b, 0)
        # in the caller's shape: the kernels take out's (batch, M, N) strides from the plan
        shape = self.out_shape if out_shape is None else out_shape
        out = torch.empty(shape, dtype=self.out_dtype, device=self.device)
        preact = torch.empty(shape, dtype=self.out_dtype, device=self.device) if self.save_preact else None
        route = self.route
        if route is None:
            as3 = lambda t: None if t is None else t.view(self.out_shape)  # noqa: E731
            route = self.route = _route(a, b, as3(out), bias, residual, as3(preact), scale_a, scale_b, *self.options)
        index = self.device_index
        if index is None or index == torch.cuda.current_device():
            route(a, b, out, bias, residual, preact, scale_a, scale_b)
        else:  # Triton launches on the current device
            with torch.cuda.device(index):
                route(a, b, out, bias, residual, preact, scale_a, scale_b)
        return out, preact


# Plans by call signature (every input of their decisions); bounded: ever new shapes start over.
_PLANS: dict = {}
_MAX_PLANS = 4096
# The autotuner's pick per tuner signature (its key and more): (config kwargs, kernel, launch
# keywords). A new plan at a tuned signature starts from it; benchmarks print it.
_CHOSEN: dict = {}


def gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
         activation: Optional[str], compute: str, out_dtype: torch.dtype, save_preact: bool,
         scale_a: Optional[torch.Tensor] = None, scale_b: Optional[torch.Tensor] = None, fast_accum: bool = False,
         out_shape: Optional[tuple] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    signature = (a.shape, a.stride(), b.stride(), b.shape[2], a.dtype, b.dtype, a.device, a.data_ptr() % 16,
                 b.data_ptr() % 16, compute, out_dtype, activation, save_preact, fast_accum,
                 None if bias is None else (bias.dtype, bias.stride()),
                 None if residual is None else (residual.dtype, residual.stride(), residual.data_ptr() % 16),
                 None if scale_a is None else (scale_a.stride(), scale_b.stride()), USE_TMA, USE_GLUON, USE_GEMV,
                 SPLIT_K)
    plan = _PLANS.get(signature)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[signature] = _Plan(a, b, bias, activation, compute, out_dtype, save_preact, fast_accum)
    return plan.run(a, b, bias, residual, scale_a, scale_b, out_shape)
