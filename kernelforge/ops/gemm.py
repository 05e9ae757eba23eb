"""GEMM with a fused epilogue: schema, input checks, fake implementation, autograd, dispatch.

    kernelforge.gemm(a, b, *, bias=None, activation=None, residual=None, precision="auto",
                     out_dtype=None, scale_a=None, scale_b=None, fp8_scaling="row",
                     fp8_fast_accum=False)
        = act(a @ b + bias) + residual

Registered op (kernelforge.ops._opdef.define_op: fake implementation and autograd attached):
    kernelforge::gemm(Tensor a, Tensor b, Tensor? bias, Tensor? residual, str activation,
                      str compute, ScalarType out_dtype, bool save_preact, Tensor? scale_a=None,
                      Tensor? scale_b=None, str fp8_scaling="row", bool fp8_fast_accum=False)
        -> (Tensor, Tensor)
        a (*batch_a, M, K), b (*batch_b, K, N), batch dims broadcast as torch.matmul does;
        bias (N,); residual broadcastable to (*batch, M, N); activation "none" or a kind;
        compute a mode of kernelforge/reference/gemm.py (the public function resolves
        precision="auto" to one). Returns out (*batch, M, N) and, when save_preact, a @ b
        before the bias (what the backward needs for act'), else an empty tensor.
        compute "fp8": a and b (float8_e4m3fn, or any float dtype, then divided by their
        scale and rounded to e4m3 here) with float32 scales: scale_a broadcastable to
        (*batch_a, M, 1), scale_b to (*batch_b, 1, N); a missing one is computed from the
        operand's largest magnitudes per `fp8_scaling` ("row": a's rows and b's columns;
        "tensor"), or is 1 for an e4m3 operand. fp8_fast_accum: let the GPU's fp8 tensor
        cores accumulate the whole K loop at their reduced precision (faster, ~50x the
        error at K = 8192; torch._scaled_mm's use_fast_accum), instead of adding each K
        tile's partial sums into float32.

The backward is made of registered ops: kernelforge::bias_activation_backward (or
activation_backward) turns the output gradient into dz = grad * act'(a @ b + bias) and the
bias gradient in one pass, then two kernelforge::gemm calls give dA = dz b^T and
dB = a^T dz (summed over broadcast batch dims; a b shared across the batch gets one GEMM
over all rows). Gradients therefore run on the same kernels, and double backward works.
precision "fp8" trains with the straight-through estimator: the rounding to e4m3 counts as
the identity, and the backward GEMMs run in bf16 on the unquantized operands (an e4m3
operand takes no gradient).

Backends (registry "gemm": gemm): triton, cublas (torch's matmul on CUDA: kernelforge/cublas/gemm.py),
cuda (fp16 / bf16 compute), reference. See
kernelforge/reference/gemm.py for the launcher interface and what each compute mode means.

Input checks: kernelforge/ops/gemm_checks.py.

Under torch.compile the GEMM stays one opaque custom op on the GPU: Inductor's code calls
torch.ops.kernelforge.gemm, which runs the eager launcher. Its Triton backend is registered
traceable=False because what it launches cannot enter a traced graph through
torch.library.wrap_triton: the kernels are autotuned (triton.autotune, with a pruning rule and
our own timing) and wrapped in triton.heuristics, the TMA kernel takes host-side TensorDescriptor
objects whose block shapes the tuner's pre-hook sets per config, split-K shares a per-stream
arrival-count buffer, and large products go to a Gluon kernel; Inductor takes plain @triton.jit
kernels only. The CUDA extension is opaque anyway. The reference (torch ops) is traced: a CPU
graph holds its matmul and epilogue, and the backward's GEMMs and activation steps, as torch ops.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from kernelforge import backends, tuning
from kernelforge.ops import activations as activation_ops
from kernelforge.ops._common import FLOAT_DTYPES, GPU_FLOAT_DTYPES, follows_autocast, is_dtensor
from kernelforge.ops._opdef import define_op, is_traced
from kernelforge.ops.gemm_checks import ACTIVATIONS, TRITON_MODES, check_gemm
from kernelforge.reference import gemm as reference

OP = "gemm"
PRECISIONS = ("auto", "fp32", "tf32", "fp16", "bf16", "fp8")
_FP8 = reference.FP8
_TRITON_OPERAND_DTYPES = GPU_FLOAT_DTYPES + (_FP8,)


@dataclass
class _Policy:
    """What "auto" takes inside kernelforge.precision(...) / gpu_kernel(...): mode None follows
    the input dtype (and torch.backends.cuda.matmul.allow_tf32 for float32). Process-wide,
    as torch.backends.cuda.matmul.allow_tf32 is: a plain attribute, which torch.compile reads
    and guards on (it cannot trace a contextvars.ContextVar)."""
    mode: Optional[str] = None
    float32_only: bool = False


_policy = _Policy()


@contextlib.contextmanager
def precision(mode: Optional[str], *, float32_only: bool = False) -> Iterator[None]:
    """Within the block, gemm(..., precision="auto") computes in `mode` ("fp32", "tf32",
    "fp16", "bf16"; None: follow the inputs); with float32_only, only float32 inputs do
    (how gpu_kernel(use_tensor_cores=...) picks tf32 or IEEE float32 without touching 16-bit
    inputs). Explicit precision arguments still win."""
    if mode is not None and mode not in PRECISIONS[1:]:
        raise ValueError(f"kernelforge.precision: mode must be None or one of {PRECISIONS[1:]}, got {mode!r}")
    saved = (_policy.mode, _policy.float32_only)
    _policy.mode, _policy.float32_only = mode, float32_only
    try:
        yield
    finally:
        _policy.mode, _policy.float32_only = saved


# ----------------------------------------------------------------------------- dispatch
def _why_not_triton(a: torch.Tensor, b: torch.Tensor, compute: str = "fp32"):
    from kernelforge.triton import why_unavailable

    if compute not in TRITON_MODES:
        return f"the Triton GEMM computes in {', '.join(TRITON_MODES)}, not {compute}"
    if compute != "fp8":  # fp8 operands reach the launcher rounded to e4m3, whatever they came as
        for name, t in (("a", a), ("b", b)):
            if t.dtype not in _TRITON_OPERAND_DTYPES:
                return (f"the Triton GEMM takes float32/float16/bfloat16/float8_e4m3fn operands, got {name} of "
                        f"{t.dtype}")
    return why_unavailable(a.device)


def _why_not_cuda(a: torch.Tensor, b: torch.Tensor, compute: str = "fp32"):
    if a.device.type != "cuda":
        return f"the CUDA extension runs on CUDA tensors, got a {a.device.type} tensor"
    from kernelforge.cuda import why_unavailable
    from kernelforge.cuda.matmul import why_not

    return why_not(a, b, compute) or why_unavailable("gemm")


def _why_not_cublas(a: torch.Tensor, b: torch.Tensor, compute: str = "fp32"):
    from kernelforge.cublas.gemm import why_not

    return why_not(a, b, compute)


def _preference(a: torch.Tensor, b: torch.Tensor, compute: str = "fp32"):
    if a.device.type != "cuda":
        return ("reference",), "the reference is the CPU implementation"
    return (("triton", "cublas", "cuda", "reference"),
            "the Triton GEMM (TMA and wgmma on Hopper) first; cuBLAS through torch next (its epilogue fused "
            "where cuBLASLt can); the CUDA one (mma.sync, cp.async) after it (~0.35x cuBLAS); the reference "
            "last (float32 copies of 16-bit operands)")


# traceable=False: autotuned / heuristics-wrapped kernels, host TMA descriptors, Gluon (module docstring)
backends.register(OP, "triton", "kernelforge.triton.gemm", _why_not_triton, traceable=False)
backends.register(OP, "cuda", "kernelforge.cuda.matmul", _why_not_cuda)
# cuBLAS is torch ops, which torch.compile could trace; registered opaque so that a compiled graph
# keeps the GEMM the eager rules pick (the traced order would put cuBLAS before the opaque Triton
# GEMM) until a measurement says tracing it pays
backends.register(OP, "cublas", "kernelforge.cublas.gemm", _why_not_cublas, traceable=False)
backends.register(OP, "reference", "kernelforge.reference.gemm", lambda *inputs, **options: None)


def _choice_key(a: torch.Tensor, b: torch.Tensor, compute: str = "fp32"):
    # cuBLAS computes float32 as torch's tf32 flag says at the call: a choice made under the other
    # setting must not be reused (an explicit precision="fp32" would silently run in tf32)
    tf32 = compute in ("fp32", "tf32") and torch.backends.cuda.matmul.allow_tf32
    return a.device.type, a.dtype, b.dtype, compute, tf32


backends.set_preference(OP, _preference, _choice_key)
backends.set_tuning(OP, tuning.GEMM)  # measured on CUDA where it pays (kernelforge.tuning)


def _choose(a: torch.Tensor, b: torch.Tensor, compute: str) -> backends.Choice:
    """The implementation that multiplies a and b (as given: fp8 operands are rounded to e4m3
    after the choice, which _why_not_triton allows for); an empty product is the reference's
    epilogue of zeros, on any backend."""
    if a.numel() == 0 or b.numel() == 0:
        return backends.Choice(backends.implementations(OP)["reference"], "an empty product is the epilogue of zeros")
    return backends.select(OP, a, b, compute=compute)


# ----------------------------------------------------------------------------- checks
def _activation_name(activation: Optional[str]) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"kernelforge.gemm: activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation or "none"


def resolve_compute(a: torch.Tensor, b: torch.Tensor, precision: str) -> str:
    """The compute mode of a call: precision, or for "auto" the context's default, else the
    inputs' dtype (float32: tf32 when torch.backends.cuda.matmul.allow_tf32 and on a GPU)."""
    if precision != "auto":
        if precision not in PRECISIONS:
            raise ValueError(f"kernelforge.gemm: precision must be one of {PRECISIONS}, got {precision!r}")
        return precision
    dtype = a.dtype
    if _policy.mode is not None and (not _policy.float32_only or dtype == b.dtype == torch.float32):
        return _policy.mode
    if dtype == _FP8 or b.dtype == _FP8:
        return "fp8"
    if dtype != b.dtype:
        raise TypeError(f"kernelforge.gemm: with precision='auto' a and b must have the same dtype, got a: {a.dtype}, "
                        f"b: {b.dtype} (name a precision to cast both)")
    if dtype == torch.float64:
        return "fp64"
    if dtype == torch.float32:
        return "tf32" if a.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32 else "fp32"
    return "fp16" if dtype == torch.float16 else "bf16"


# ----------------------------------------------------------------------------- implementation
def _batched(a, b, residual, batch, M, N, K):
    """(a3, b3, residual3, folded): (B, M', K), (B, K, N), (B, M', N) views for the launcher.
    A b with no batch dims takes a's batch into the rows (one GEMM of batch*M rows, folded)
    when a and the residual allow it without a copy."""
    if not batch:  # two matrices: one view op each
        return a.unsqueeze(0), b.unsqueeze(0), None if residual is None else residual.expand(M, N).unsqueeze(0), False
    if b.dim() == 2:
        try:
            a_rows = a.view(1, -1, K)
            res_rows = None if residual is None else residual.expand(*batch, M, N).view(1, -1, N)
            return a_rows, b.unsqueeze(0), res_rows, True
        except (RuntimeError, ValueError):  # not foldable without a copy (ValueError: traced): stay batched
            pass
    count = math.prod(batch)
    a3 = a.expand(*batch, M, K).reshape(count, M, K)
    b3 = b.expand(*batch, K, N).reshape(count, K, N)
    res3 = None if residual is None else residual.expand(*batch, M, N).reshape(count, M, N)
    return a3, b3, res3, False


def _fp8_operands(a, b, scale_a, scale_b, fp8_scaling: str):
    """(a, b) rounded to e4m3 and their float32 scales (computed where not given)."""
    quantized = []
    for x, scale, k_dim in ((a, scale_a, -1), (b, scale_b, -2)):
        if scale is None:
            scale = (torch.ones((1,) * x.dim(), device=x.device) if x.dtype == _FP8
                     else reference.fp8_scale(x, fp8_scaling, k_dim))
        scale = scale.float()
        quantized += [reference.quantize_fp8(x, scale), scale]
    return quantized


def _batched_scales(scale_a, scale_b, a_shape, batch, M, N, folded: bool):
    """scale_a (B, M') and scale_b (B, N) matching _batched's a3 and b3 (copies: they are small)."""
    if folded:
        return scale_a.expand(*a_shape[:-1], 1).reshape(1, -1), scale_b.expand(1, N).reshape(1, N)
    count = math.prod(batch)
    return scale_a.expand(*batch, M, 1).reshape(count, M), scale_b.expand(*batch, 1, N).reshape(count, N)


def _gemm(a, b, bias, residual, activation: str, compute: str, out_dtype: torch.dtype, save_preact: bool,
          scale_a=None, scale_b=None, fp8_scaling: str = "row", fp8_fast_accum: bool = False):
    """What kernelforge::gemm computes (the eager call runs it directly, the registered op
    through torch.ops, torch.compile traces it on the reference)."""
    batch, M, N, K = check_gemm(a, b, bias, residual, activation, compute, scale_a, scale_b, fp8_scaling)
    launchers = _choose(a, b, compute).implementation.launchers()
    fp8 = {}
    if compute == "fp8":
        a, scale_a, b, scale_b = _fp8_operands(a, b, scale_a, scale_b, fp8_scaling)
    a3, b3, res3, folded = _batched(a, b, residual, batch, M, N, K)
    if compute == "fp8":
        sa3, sb3 = _batched_scales(scale_a, scale_b, a.shape, batch, M, N, folded)
        fp8 = dict(scale_a=sa3, scale_b=sb3, fast_accum=fp8_fast_accum)
    # out_shape: the launcher allocates the output in its final shape (a reshape here would cost
    # an op a call, and a view would have to be made a non-view again for autograd)
    out, preact = launchers.gemm(a3, b3, bias, res3, None if activation == "none" else activation, compute,
                                 out_dtype, save_preact, out_shape=(*batch, M, N), **fp8)
    return out, preact if save_preact else out.new_empty(0)


def _fake(a, b, bias, residual, activation, compute, out_dtype, save_preact, scale_a=None, scale_b=None,
          fp8_scaling="row", fp8_fast_accum=False):
    batch, M, N, _ = check_gemm(a, b, bias, residual, activation, compute, scale_a, scale_b, fp8_scaling)
    out = a.new_empty((*batch, M, N), dtype=out_dtype)
    return out, (torch.empty_like(out) if save_preact else a.new_empty(0, dtype=out_dtype))


def _choose_for(a, b, bias, residual, activation, compute, *rest, **options) -> backends.Choice:
    return _choose(a, b, compute)


# ----------------------------------------------------------------------------- backward
def _sum_to(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return t if t.shape == shape else t.sum_to_size(shape)


def _matmul(x, w, compute: str, out_dtype: torch.dtype) -> torch.Tensor:
    return gemm_op(x, w, None, None, "none", compute, out_dtype, False, None, None, "row", False)[0]


def _activation_grad(grad_out, preact, bias, activation: str, need_bias: bool):
    """(dz = grad_out * act'(preact + bias), the bias gradient or None)."""
    if need_bias:
        return activation_ops.bias_activation_backward_op(grad_out, preact, bias, activation)
    return activation_ops.activation_backward_op(grad_out, preact, bias, activation), None


def _weight_grad(a, dz, b, compute, dtype):
    """dB = a^T dz summed to b's shape; a b without batch dims gets one GEMM over all rows, in b's
    layout: for b = W.t() (a Linear's weight read transposed in place) as (dz^T a)^T, so W's gradient
    comes out in W's own layout. Autograd copies a parameter's gradient into the parameter's layout
    when it arrives in another (AccumulateGrad's layout contract): a strided copy of every weight's
    gradient, on every step. A DTensor a keeps its batch: folding it into the rows is a reshape
    across a sharded dimension (torch 2.11 refuses it, later releases gather a whole first)."""
    if b.dim() == 2 and not is_dtensor(a):
        K, N = a.shape[-1], dz.shape[-1]
        rows = dz.numel() // N if N else a.numel() // K if K else 0  # not -1: K or N may be 0
        a_rows = a.reshape(rows, K)  # a's batch is dz's: b has none
        dz_rows = dz.reshape(rows, N)
        if b.stride(0) == 1 and b.stride(1) != 1 and K > 1:  # b = W.t(): compute W's gradient (N, K)
            return _matmul(dz_rows.t(), a_rows, compute, dtype).t()
        return _matmul(a_rows.t(), dz_rows, compute, dtype)
    return _sum_to(_matmul(a.transpose(-1, -2), dz, compute, dtype), b.shape)


def _gemm_backward(saved, options, needs, grad_out):
    """Gradients (a, b, bias, residual) of out = act(a @ b + bias) + residual."""
    a, b, bias, preact = saved
    activation, compute, residual_meta = options
    if compute == "fp8":  # the straight-through estimator, in bf16 (see the module's docstring)
        compute = "bf16"
    need_a, need_b, need_bias, need_residual = needs
    grad_bias = None
    create_graph = torch.is_grad_enabled() and not is_traced(grad_out)
    if activation != "none" and grad_out.numel() > 0 and (preact.numel() == 0 or create_graph):
        # Recompute a @ b: the op ran with save_preact=False (only a direct torch.ops call does
        # that), or this backward is itself differentiated (create_graph=True), where the saved
        # preact, a detached intermediate, would drop the path through act'(a @ b + bias). Not while
        # torch.compile traces the backward (grad mode is on there, and the saved preact is what eager
        # uses): a compiled step would run the forward GEMM twice, and fp8's straight-through backward
        # would take act' at a bf16 product instead of the forward's fp8 one.
        preact = _matmul(a, b, compute, grad_out.dtype)
    if activation == "none":
        dz = grad_out
        if need_bias:
            acc = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0, dtype=acc).to(bias.dtype)
    else:
        dz, grad_bias = _activation_grad(grad_out, preact, bias, activation, bias is not None and need_bias)
    grad_a = _sum_to(_matmul(dz, b.transpose(-1, -2), compute, a.dtype), a.shape) if need_a else None
    grad_b = _weight_grad(a, dz, b, compute, b.dtype) if need_b else None
    grad_residual = None
    if need_residual:
        shape, dtype = residual_meta
        grad_residual = _sum_to(grad_out, shape).to(dtype)
    return grad_a, grad_b, grad_bias, grad_residual


def _real_valued(x: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """What an fp8 operand stands for, for the other operand's gradient: an e4m3 x times its
    scale, in bf16 (other dtypes pass)."""
    if x.dtype != _FP8:
        return x
    return (x.float() * (1.0 if scale is None else scale.float())).to(torch.bfloat16)


def _setup_context(ctx, inputs, output):
    a, b, bias, residual, activation, compute = inputs[:6]
    if compute == "fp8":
        scale_a, scale_b = (tuple(inputs[8:10]) + (None, None))[:2]
        a, b = _real_valued(a, scale_a), _real_valued(b, scale_b)
    ctx.save_for_backward(a, b, bias, output[1] if activation != "none" else None)
    ctx.options = (activation, compute, None if residual is None else (residual.shape, residual.dtype))
    ctx.mark_non_differentiable(output[1])


def _gradient(ctx, grad_out, _grad_preact):
    grads = _gemm_backward(ctx.saved_tensors, ctx.options, ctx.needs_input_grad[:4], grad_out)
    return (*grads, None, None, None, None, None, None, None, None)


# ----------------------------------------------------------------------------- definition
gemm_op = define_op(
    "kernelforge::gemm(Tensor a, Tensor b, Tensor? bias, Tensor? residual, str activation, str compute, "
    "ScalarType out_dtype, bool save_preact, Tensor? scale_a=None, Tensor? scale_b=None, str fp8_scaling=\"row\", "
    "bool fp8_fast_accum=False) -> (Tensor, Tensor)",
    impl=_gemm, fake=_fake, choose=_choose_for, setup_context=_setup_context, backward=_gradient,
    helper_outputs=(1,))


# ----------------------------------------------------------------------------- public function
def _autocast_casts(call) -> bool:
    """Whether a gemm call under autocast takes autocast's dtype: precision "auto", no out_dtype, no
    kernelforge.precision context, float (not float8 / float64) operands; else it keeps its own."""
    arguments = call.arguments
    return (arguments.get("precision", "auto") == "auto" and arguments.get("out_dtype") is None
            and _policy.mode is None and getattr(arguments["a"], "dtype", None) in GPU_FLOAT_DTYPES
            and getattr(arguments["b"], "dtype", None) in GPU_FLOAT_DTYPES)


@follows_autocast("a", "b", "bias", "residual", when=_autocast_casts)
def gemm(a: torch.Tensor, b: torch.Tensor, *, bias: Optional[torch.Tensor] = None, activation: Optional[str] = None,
         residual: Optional[torch.Tensor] = None, precision: str = "auto", out_dtype: Optional[torch.dtype] = None,
         scale_a: Optional[torch.Tensor] = None, scale_b: Optional[torch.Tensor] = None,
         fp8_scaling: str = "row", fp8_fast_accum: bool = False) -> torch.Tensor:
    """act(a @ b + bias) + residual in one kernel.

    a (..., M, K) and b (..., K, N) with batch dims that broadcast (b may be (K, N)); any
    strides (a transposed weight needs no copy). bias (N,), any float dtype. activation
    None, "gelu", "gelu_tanh", "silu" or "relu", applied before the residual is added.
    precision: "auto" (the inputs' dtype; float32 follows torch.backends.cuda.matmul.allow_tf32
    on a GPU, and kernelforge.precision(...) changes the default), or "fp32", "tf32", "fp16",
    "bf16": the operands are rounded to it, products accumulate in float32, the epilogue
    runs in float32. out_dtype: the result's dtype, by default the inputs' (promoted;
    bfloat16 for float8 inputs).
    precision "fp8" (GPUs with float8 tensor cores, and the CPU reference): a and b are
    rounded to float8 e4m3 after dividing by their scales (float8_e4m3fn operands are taken
    as they are; "auto" means "fp8" for them). scale_a broadcasts to (..., M, 1) and scale_b
    to (..., 1, N), as torch._scaled_mm's: one per tensor, or per row of a / column of b. A
    scale not given is computed from the operand (largest magnitude -> 448, per
    fp8_scaling "row" or "tensor"), or is 1 for a float8 operand. The product of e4m3
    values accumulates in float32 (per K tile on GPUs; fp8_fast_accum=True leaves the whole K
    loop in the tensor cores' reduced-precision accumulator, as torch._scaled_mm's
    use_fast_accum) and is multiplied by scale_a * scale_b before the epilogue.
    Differentiable in a, b, bias and residual (fp8: straight-through, backward in bf16).
    Under torch.autocast (precision "auto", no kernelforge.precision context, no out_dtype): the
    float operands, bias and residual in autocast's dtype, as torch's addmm there; a precision or
    out_dtype named is kept (the op then runs with autocast off, so no torch matmul inside a
    backend recasts it)."""
    act = _activation_name(activation)
    compute = resolve_compute(a, b, precision)
    a_dtype, b_dtype = a.dtype, b.dtype
    fp8_operand = a_dtype == _FP8 or b_dtype == _FP8
    if out_dtype is None:
        out_dtype = (torch.bfloat16 if fp8_operand else a_dtype if a_dtype == b_dtype
                     else torch.promote_types(a_dtype, b_dtype))
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"kernelforge.gemm: out_dtype must be a float dtype, got {out_dtype}")
    save_preact = False
    if (act != "none" or fp8_operand) and torch.is_grad_enabled():
        grads = any(t is not None and t.requires_grad for t in (a, b, bias, residual))
        for name, t in (("a", a), ("b", b)):
            if grads and t.dtype == _FP8 and t.requires_grad:
                raise TypeError(f"kernelforge.gemm: {name} is float8_e4m3fn and requires grad; a float8 operand "
                                "takes no gradient (pass it in bf16 / float32 with precision='fp8' to train through "
                                "the rounding)")
        save_preact = grads and act != "none"
    return gemm_op(a, b, bias, residual, act, compute, out_dtype, save_preact, scale_a, scale_b, fp8_scaling,
                   fp8_fast_accum)[0]


__all__ = ["gemm", "precision"]
