"""GEMM suites: the plain product against cuBLAS (torch.matmul) and torch.compile, and the
fused bias + GELU(tanh) epilogue against eager linear + gelu and its torch.compile, at
TARGETS.md's squares and the LLM projection shapes (M tokens against N, K of 4096 / 14336).

Shapes are (M, N, K); b is a Linear weight (N, K) read transposed (x @ W^T), as models call
it. `kernelforge.bench.suites` adds `gemm_suites()` to its SUITES.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernelforge as kf
from kernelforge.bench.roofline import Cost
from kernelforge.ops.gemm import resolve_compute

SQUARES = [(n, n, n) for n in (1024, 2048, 4096, 8192)]
LLM = [(m, n, k) for m in (16, 128, 4096) for n, k in ((4096, 4096), (14336, 4096), (4096, 14336))]
QUICK = [(33, 17, 65), (64, 48, 40)]


def _precision(dtype: torch.dtype) -> str:
    """The matmul ceiling: bf16 / fp16, and tf32 for float32 on a GPU (the harness measures
    bf16, tf32 and fp8 ceilings; fp16 rows get no %)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def _inputs(bias: bool):
    def make(shape, dtype, device):
        M, N, K = shape
        a = torch.randn(M, K, device=device, dtype=dtype)
        weight = torch.randn(N, K, device=device, dtype=dtype) / K ** 0.5
        return (a, weight) + ((torch.randn(N, device=device, dtype=dtype),) if bias else ())

    return make


def _cost(bias: bool):
    def cost(shape, dtype, direction):
        M, N, K = shape
        elems = M * K + N * K + M * N + (N if bias else 0)
        flops = 2 * M * N * K
        if direction != "fwd":  # dA and dB: two more products; read dO, write dA, dB (and db)
            elems += M * N + M * K + N * K + (N if bias else 0)
            flops *= 3
        return Cost(elems * dtype.itemsize, flops, _precision(dtype))

    return cost


def _eager_and_compiled(eager):
    def impls():
        return {"torch eager": eager, "torch.compile": torch.compile(eager, dynamic=False)}

    return impls


def _support_args(inputs, direction):
    """What the gemm registry's predicates take: the operands as kf.gemm sees them, and the
    compute mode its precision="auto" resolves to."""
    a, b = inputs[0], inputs[1].t()
    return (a, b), {"compute": resolve_compute(a, b, "auto")}


def gemm_suites() -> dict:
    from kernelforge.bench.suites import Suite  # (suites.py calls this once Suite is defined)

    return {
        "gemm": Suite(
            op="gemm",
            shapes=SQUARES + LLM,
            quick_shapes=QUICK,
            make_inputs=_inputs(bias=False),
            cost=_cost(bias=False),
            kernelforge=lambda a, w: kf.gemm(a, w.t()),
            baselines=_eager_and_compiled(lambda a, w: torch.matmul(a, w.t())),
            support_args=_support_args,
        ),
        "gemm_bias_gelu": Suite(
            op="gemm_bias_gelu",
            registry_op="gemm",
            shapes=[(4096, 4096, 4096), (8192, 8192, 8192)] + LLM,
            quick_shapes=QUICK,
            make_inputs=_inputs(bias=True),
            cost=_cost(bias=True),
            kernelforge=lambda a, w, b: kf.gemm(a, w.t(), bias=b, activation="gelu_tanh"),
            baselines=_eager_and_compiled(lambda a, w, b: F.gelu(F.linear(a, w, b), approximate="tanh")),
            support_args=_support_args,
        ),
    }
