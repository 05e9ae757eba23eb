"""GEMM suites: the plain product against cuBLAS (torch.matmul) and torch.compile (also at the
projection shapes of ViT-B, BERT-base and Llama-3.2-1B steps: gemm_models), and the
fused bias + GELU(tanh) epilogue against eager linear + gelu and its torch.compile, at
the target squares and the LLM projection shapes (M tokens against N, K of 4096 / 14336);
tf32 (float32 operands) against cuBLAS's tf32; fp8 (e4m3 operands, per-row or per-tensor
scales, bf16 out) against torch._scaled_mm.

Shapes are (M, N, K); b is a Linear weight (N, K) read transposed (x @ W^T), as models call
it. `kernelforge.bench.suites` adds `gemm_suites()` to its SUITES.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernelforge as kf
from kernelforge.bench.roofline import Cost
from kernelforge.bench.suite_types import Suite, Unavailable
from kernelforge.ops.gemm import resolve_compute
from kernelforge.reference.gemm import fp8_scale, quantize_fp8

SQUARES = [(n, n, n) for n in (1024, 2048, 4096, 8192)]
LLM = [(m, n, k) for m in (16, 128, 4096) for n, k in ((4096, 4096), (14336, 4096), (4096, 14336))]
QUICK = [(33, 17, 65), (64, 48, 40)]
# The projections of whole models' steps, (tokens, out features, in features): ViT-B/16 at
# batch 64 (64 x 197 tokens: qkv, proj, fc1, fc2), BERT-base at 32 x 512 (fc1, fc2) and
# Llama-3.2-1B at 4 x 2048 (q / k / v fused, o, gate / up fused, down)
MODELS = [(12608, 2304, 768), (12608, 768, 768), (12608, 3072, 768), (12608, 768, 3072),
          (16384, 3072, 768), (16384, 768, 3072),
          (8192, 3072, 2048), (8192, 2048, 2048), (8192, 16384, 2048), (8192, 2048, 8192)]


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


def _with_tf32(fn):
    """fn with torch.backends.cuda.matmul.allow_tf32 on for the call (cuBLAS's tf32 path;
    torch.compile guards on the flag, so compiled and eager see the same)."""
    def run(*args):
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            return fn(*args)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous

    return run


def _tf32_baselines():
    matmul = lambda a, w: torch.matmul(a, w.t())  # noqa: E731
    return {"torch eager": _with_tf32(matmul), "torch.compile": _with_tf32(torch.compile(matmul, dynamic=False))}


def _tf32_cost(shape, dtype, direction):
    M, N, K = shape
    return Cost(4 * (M * K + N * K + M * N), 2 * M * N * K, "tf32")


# (M, N, K, scaling): scaling "row" (a's rows and b's columns) or "tensor"
FP8_SHAPES = [(n, n, n, s) for n in (4096, 8192) for s in ("row", "tensor")] + [
    (m, n, k, "row") for m, n, k in LLM]
FP8_QUICK = [(33, 32, 64, "row"), (64, 48, 32, "tensor")]


def _fp8_inputs(shape, dtype, device):
    """e4m3 a (M, K) and weight (N, K) with float32 scales shaped as torch._scaled_mm takes
    them: (M, 1) and (1, N) per row, () per tensor."""
    M, N, K, scaling = shape
    a = torch.randn(M, K, device=device)
    weight = torch.randn(N, K, device=device) / K ** 0.5
    scale_a, scale_w = fp8_scale(a, scaling, -1), fp8_scale(weight, scaling, -1)
    qa, qw = quantize_fp8(a, scale_a), quantize_fp8(weight, scale_w)
    if scaling == "row":
        return qa, qw, scale_a, scale_w.reshape(1, N)
    return qa, qw, scale_a.reshape(()), scale_w.reshape(())


def _fp8_cost(shape, dtype, direction):
    M, N, K, _ = shape
    return Cost(M * K + N * K + 2 * M * N + 4 * (M + N), 2 * M * N * K, "fp8")


def _scaled_mm(fast_accum: bool):
    def run(qa, qw, scale_a, scale_b):
        if qa.device.type != "cuda":
            raise Unavailable("torch._scaled_mm runs on GPUs with float8 tensor cores")
        return torch._scaled_mm(qa, qw.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                                use_fast_accum=fast_accum)

    return run


def _product_suite(op: str, shapes: list) -> Suite:
    """The plain product x @ W^T at `shapes` against cuBLAS and torch.compile."""
    return Suite(
        op=op,
        registry_op="gemm",
        shapes=shapes,
        quick_shapes=QUICK,
        make_inputs=_inputs(bias=False),
        cost=_cost(bias=False),
        kernelforge=lambda a, w: kf.gemm(a, w.t()),
        baselines=_eager_and_compiled(lambda a, w: torch.matmul(a, w.t())),
        support_args=_support_args,
    )


def gemm_suites() -> dict:
    return {
        "gemm": _product_suite("gemm", SQUARES + LLM),
        "gemm_models": _product_suite("gemm_models", MODELS),
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
        "gemm_tf32": Suite(
            op="gemm_tf32",
            registry_op="gemm",
            shapes=SQUARES,
            quick_shapes=QUICK,
            make_inputs=_inputs(bias=False),
            cost=_tf32_cost,
            kernelforge=lambda a, w: kf.gemm(a, w.t(), precision="tf32"),
            baselines=_tf32_baselines,
            support_args=lambda inputs, direction: ((inputs[0], inputs[1].t()), {"compute": "tf32"}),
            directions=("fwd",),
            dtypes=("fp32",),
        ),
        "gemm_fp8": Suite(
            op="gemm_fp8",
            registry_op="gemm",
            shapes=FP8_SHAPES,
            quick_shapes=FP8_QUICK,
            make_inputs=_fp8_inputs,
            cost=_fp8_cost,
            kernelforge=lambda qa, qw, sa, sb: kf.gemm(qa, qw.t(), scale_a=sa, scale_b=sb),
            # the reduced-precision accumulation both ways: ours next to cuBLAS's
            variants=lambda: {"kernelforge fast accum": lambda qa, qw, sa, sb: kf.gemm(
                qa, qw.t(), scale_a=sa, scale_b=sb, fp8_fast_accum=True)},
            baselines=lambda: {"torch._scaled_mm": _scaled_mm(False), "torch._scaled_mm fast accum": _scaled_mm(True)},
            support_args=lambda inputs, direction: ((inputs[0], inputs[1].t()), {"compute": "fp8"}),
            directions=("fwd",),
            dtypes=("fp8",),
            label=lambda shape: "x".join(map(str, shape[:3])) + f" {shape[3]}",
        ),
    }
