"""Launcher of the few-row GEMM (gemm_kernels.gemv_kernel): one matrix whose a has a single row,
as a decoding step's projections have at batch 1. kernelforge/triton/gemm.py routes such calls
here (its _route); the tensor-core kernels pad the row to a 16-row tile and leave too few
programs streaming the weight (0.72-0.92x cuBLAS at the decode shapes of
benchmarks/tuning/decode_step_sweep.py, H200), where this kernel gives 0.97-1.25x.

Candidates: the best config at each of those shapes (one row; BLOCK_N x BLOCK_K of b a program
and iteration, warps), and, for outputs too narrow to give every SM two programs, the same tiles
over 2 or 4 slices of K. Autotuned once per (rows, N, K, layout, dtypes, epilogue) in a process,
as the other GEMM kernels are; under TRITON_INTERPRET=1 one small tile runs. gemm.SPLIT_K, when
set, fixes the slice count (and one tile) here too, so the tests reach split-K on both.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton

from kernelforge.bench.timing import autotune_timing
from kernelforge.triton import interpreter_enabled
from kernelforge.triton._launch import cdiv, launch, next_power_of_2, sm_count, zeroed_counters
from kernelforge.triton.gemm_kernels import gemv_kernel

_INTERPRETER = interpreter_enabled()
MAX_ROWS = 1  # rows the rule routes here (gemm.USE_GEMV True: up to FORCED_MAX_ROWS)
FORCED_MAX_ROWS = 8  # beyond this a program's accumulators (ROWS x BLOCK_N x BLOCK_K) spill
SPLITS = (2, 4)


def _config(block_n, block_k, warps, split=1):
    return triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split}, num_warps=warps, num_stages=1)


# The winners of benchmarks/tuning/decode_step_sweep.py at one row (H200, bf16; results in
# benchmarks/results/nvidia-h200/0.1.0/models/97577be-decode-step-sweep/): 8 x 512 / 4 warps at N 6144
# (K 2048 and 4096), 4 x 1024 / 8 warps at 2048 x 2048, 4 x 1024 / 4 at 2048 x 5472, 16 x 256 / 4 at 10944 x 2048,
# 8 x 1024 / 4 at the vocabulary, 4096 x 4096, 28672 x 4096 and 4096 x 14336. Software
# pipelining (num_stages) changed nothing there: the loads are not a tl.dot's.
CONFIGS = [_config(8, 512, 4), _config(4, 1024, 8), _config(4, 1024, 4), _config(16, 256, 4), _config(8, 1024, 4)]
SPLIT_CONFIGS = [_config(4, 512, 4, split) for split in SPLITS]
INTERPRETER_CONFIG = dict(BLOCK_N=8, BLOCK_K=32, num_warps=4, num_stages=1)
FIXED_SPLIT_CONFIG = dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=1)  # gemm.SPLIT_K set, on a GPU
AUTOTUNE_KEY = ["ROWS", "SPLIT_CHOICES", "N", "K", "sak", "sbk", "COMPUTE", "ACTIVATION", "HAS_BIAS", "HAS_RESIDUAL",
                "SAVE_PREACT"]


def _splits(N: int, K: int, device: torch.device) -> tuple:
    """The slice counts the autotuner may try: split only where the unsplit output gives fewer than
    two programs an SM (at the narrowest candidate tile), into slices of a K tile at least."""
    if cdiv(N, min(c.kwargs["BLOCK_N"] for c in CONFIGS)) >= 2 * sm_count(device):
        return (1,)
    return (1, *(s for s in SPLITS if K // s >= max(c.kwargs["BLOCK_K"] for c in SPLIT_CONFIGS)))


def _prune(configs, named_args, **kwargs):
    """The candidates at the slice counts SPLIT_CHOICES allows (_splits, one bit each: part of the
    key, as it follows the device's SM count) whose accumulators fit a thread's registers at this
    many rows (128 floats each)."""
    mask, rows = named_args["SPLIT_CHOICES"], kwargs["ROWS"]
    allowed = [c for c in configs if mask >> c.kwargs["SPLIT_K"] & 1]
    kept = [c for c in allowed if rows * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= 128 * 32 * c.num_warps]
    return kept or [min(allowed, key=lambda c: c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"])]


def _even_k(args):
    return args["K"] % args["BLOCK_K"] == 0


@functools.lru_cache(maxsize=None)
def _tuner():
    """The autotuned kernel (None under the interpreter)."""
    if _INTERPRETER:
        return None
    return triton.autotune(configs=CONFIGS + SPLIT_CONFIGS, key=AUTOTUNE_KEY,
                           prune_configs_by={"early_config_prune": _prune},
                           do_bench=autotune_timing)(triton.heuristics({"EVEN_K": _even_k})(gemv_kernel))


def takes(a: torch.Tensor, compute: str, forced: Optional[bool]) -> bool:
    """Whether the (batch, M, K) operand a goes through gemv_kernel: one matrix of at most MAX_ROWS
    rows (FORCED_MAX_ROWS when forced), any compute but fp8 (whose operands the tensor cores take
    quantized; here they would be dequantized per element). forced False: never."""
    if forced is False or compute == "fp8" or a.shape[0] != 1:
        return False
    return 1 <= a.shape[1] <= (FORCED_MAX_ROWS if forced else MAX_ROWS)


# The autotuner's pick per signature: (config kwargs, launch keywords).
_CHOSEN: dict = {}


class Launch:
    """gemv_kernel at one call signature (gemm.py's route for it): integer arguments, constexprs,
    and once the autotuner has chosen, the grid and keywords. Called with the (1, M, ...) tensors."""

    def __init__(self, a, b, out, residual, preact, compute: str, epilogue: dict, dtypes: tuple,
                 split_k: Optional[int]):
        _, M, K = a.shape
        N = b.shape[2]
        rows = next_power_of_2(M)
        res, pre = (out if t is None else t for t in (residual, preact))
        splits = (split_k,) if split_k is not None else _splits(N, K, out.device)
        self.ints = (M, N, K, *a.stride()[1:], *b.stride()[1:], *out.stride()[1:], *res.stride()[1:],
                     *pre.stride()[1:], sum(1 << s for s in splits))
        self.kwargs = dict(ROWS=rows, COMPUTE=compute, **epilogue)
        self.signature = (rows, splits, N, K, a.stride(2), b.stride(1), compute, *dtypes, *epilogue.values())
        self.work = (M, N, out.device)
        self.tuner = _tuner()
        # the tuning call's split-K buffers, for the largest slice count it may try: none for most
        # shapes (a zeroed counter buffer made inside a CUDA-graph warm-up would stay in its pool)
        self.tuning_split = max(splits)
        chosen = _CHOSEN.get(self.signature)
        if self.tuner is None or split_k is not None:  # the interpreter, or a slice count asked for: one tile
            config = {**(INTERPRETER_CONFIG if self.tuner is None else FIXED_SPLIT_CONFIG), "SPLIT_K": split_k or 1}
            chosen = (config, {**self.kwargs, "EVEN_K": K % config["BLOCK_K"] == 0, **config})
        self.chosen = None if chosen is None else self._ready(*chosen)

    def _ready(self, config, launch_kwargs):
        """(grid, keywords, slice count) of a chosen config."""
        return self._grid(config), launch_kwargs, config["SPLIT_K"]

    def _grid(self, meta):
        return cdiv(self.work[1], meta["BLOCK_N"]), meta["SPLIT_K"]

    def __call__(self, a, b, out, bias, residual, preact, scale_a=None, scale_b=None):  # never scaled: not fp8
        M, N, device = self.work
        chosen = self.chosen
        split = self.tuning_split if chosen is None else chosen[2]
        partials = arrivals = out  # not read unsplit
        if split > 1:
            partials = torch.empty(split * M * N, device=device, dtype=torch.float32)
            arrivals = zeroed_counters(device, N)  # a count per output tile: at most N of them
        tensors = (a, b, out, out if bias is None else bias, out if residual is None else residual,
                   out if preact is None else preact, partials, arrivals)
        if chosen is not None:
            grid, launch_kwargs, _ = chosen
            launch(gemv_kernel, grid, *tensors, *self.ints, **launch_kwargs)
            return
        launch(self.tuner, self._grid, *tensors, *self.ints, **self.kwargs)  # through launch: an eager plan sees it
        config = self.tuner.best_config
        launch_kwargs = {**self.kwargs, "EVEN_K": self.ints[2] % config.kwargs["BLOCK_K"] == 0, **config.all_kwargs()}
        _CHOSEN[self.signature] = (config.kwargs, launch_kwargs)
        self.chosen = self._ready(config.kwargs, launch_kwargs)


__all__ = ["CONFIGS", "FORCED_MAX_ROWS", "Launch", "MAX_ROWS", "SPLIT_CONFIGS", "takes"]
