"""Launcher of the Triton GEMM (kernelforge/triton/gemm_kernels.py): the gemm op's backend
interface, as kernelforge/reference/gemm.py defines it.

Tiles are autotuned on the GPU, once per (M rounded up to a power of two, N, K, strides'
unit-ness, dtypes, epilogue) in a process: a first call at a new shape costs the compiles
and timings of the candidates (seconds), later calls none. Under TRITON_INTERPRET=1 one
small tile runs, so the CPU suite stays fast.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton

from kernelforge.triton import interpreter_enabled
from kernelforge.triton._launch import on_device, sm_count
from kernelforge.triton.gemm_kernels import gemm_kernel

_TL_DTYPES = {"fp32": "fp32", "tf32": "fp32", "fp16": "fp16", "bf16": "bf16"}
_PRECISION = {"fp32": "ieee", "tf32": "tf32", "fp16": "tf32", "bf16": "tf32"}  # 16-bit: the argument is ignored


def _config(m, n, k, warps, stages, group=8):
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": group}, num_warps=warps,
                         num_stages=stages)


# Candidates. 16-bit operands: the Hopper shapes of Triton's matmul tutorial and smaller
# tiles for few rows (M = 16..128 tokens) or narrow N; fp32 operands (tf32 / IEEE) take
# half the K depth for the same shared memory. Not yet swept on our GPUs (issue 6).
CONFIGS_16BIT = [
    _config(128, 256, 64, 8, 3), _config(128, 128, 64, 8, 4), _config(128, 128, 64, 4, 4),
    _config(64, 256, 64, 4, 4), _config(128, 64, 64, 4, 4), _config(64, 128, 128, 4, 3),
    _config(64, 64, 128, 4, 4), _config(32, 64, 256, 4, 3),
]
CONFIGS_32BIT = [
    _config(128, 128, 32, 8, 3), _config(128, 256, 32, 8, 3), _config(128, 64, 32, 4, 4),
    _config(64, 128, 32, 4, 4), _config(64, 64, 64, 4, 3), _config(32, 64, 128, 4, 3),
]
INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)
AUTOTUNE_KEY = ["M_BUCKET", "N", "K", "sak", "sbn", "COMPUTE", "ACTIVATION", "HAS_BIAS", "HAS_RESIDUAL",
                "SAVE_PREACT"]


def _even_k(args):
    return args["K"] % args["BLOCK_K"] == 0


@functools.lru_cache(maxsize=None)
def _kernel(sixteen_bit: bool):
    """The kernel as launched: autotuned on the GPU (one tuner per operand width), plain
    in the interpreter."""
    kernel = triton.heuristics({"EVEN_K": _even_k})(gemm_kernel)
    if interpreter_enabled():
        return kernel
    return triton.autotune(configs=CONFIGS_16BIT if sixteen_bit else CONFIGS_32BIT, key=AUTOTUNE_KEY)(kernel)


def _strides(t: Optional[torch.Tensor], fallback: torch.Tensor):
    return tuple((t if t is not None else fallback).stride())


def gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
         activation: Optional[str], compute: str, out_dtype: torch.dtype, save_preact: bool
         ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    batch, M, K = a.shape
    N = b.shape[2]
    out = torch.empty(batch, M, N, dtype=out_dtype, device=a.device)
    preact = torch.empty_like(out) if save_preact else None
    sixteen_bit = compute in ("fp16", "bf16")
    kernel = _kernel(sixteen_bit)
    sms = sm_count(a.device)

    def grid(meta):
        tiles = batch * triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])
        return (max(1, min(sms, tiles)),)

    fixed = INTERPRETER_CONFIG if interpreter_enabled() else {}
    with on_device(a):
        kernel[grid](
            a, b, out, bias if bias is not None else out, residual if residual is not None else out,
            preact if preact is not None else out,
            M, N, K, *a.stride(), *b.stride(), *out.stride(), *_strides(residual, out), *_strides(preact, out),
            batch, triton.next_power_of_2(M),
            COMPUTE=_TL_DTYPES[compute], PRECISION=_PRECISION[compute],
            ACTIVATION=activation or "none", HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
            SAVE_PREACT=save_preact, PRECISE=not interpreter_enabled(), **fixed,
        )
    return out, preact
