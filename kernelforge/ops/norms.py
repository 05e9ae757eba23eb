"""layer_norm, rms_norm and their residual-add forms, each defined once (kernelforge.ops._opdef):
schemas, checks, fakes, gradients, backend choice.

Registered ops (each with a fake implementation; normalization over the trailing
`normalized_shape` dims; mean and rstd are float32 (float64 for float64 input), shaped
like x without those dims):
    kernelforge::layer_norm(x, normalized_shape, weight?, bias?, eps, offset) -> (y, mean, rstd)
    kernelforge::add_layer_norm(x, residual, normalized_shape, weight?, bias?, eps, offset)
        -> (y, residual_out, mean, rstd)
    kernelforge::rms_norm(x, normalized_shape, weight?, bias?, eps, offset) -> (y, rstd)
    kernelforge::add_rms_norm(x, residual, normalized_shape, weight?, bias?, eps, offset)
        -> (y, residual_out, rstd)
    kernelforge::layer_norm_backward(grad_y, grad_residual?, h, normalized_shape, weight?,
        bias?, mean, rstd, eps, offset, weight_grads) -> [grad_h, grad_weight?, grad_bias?]
    kernelforge::rms_norm_backward(grad_y, grad_residual?, h, normalized_shape, weight?,
        bias?, rstd, eps, offset, weight_grads) -> [grad_h, grad_weight?, grad_bias?]
h is the normalized input: x, or residual_out = x + residual for the add_ forms (whose
gradient reaches x and residual alike). The backward ops return grad_weight / grad_bias
only when weight_grads is set and the parameter exists (a list, since a schema cannot
return an optional tensor); `bias` is passed to them for its presence and dtype.
y = norm(h) * (weight + offset) + bias; offset 1.0 with RMS gives Gemma's x * (1 + w).

Every backend implements two row launchers (see kernelforge.reference.norms) on (rows, n)
views with unit column stride; this module flattens the normalized dims into n.
Under torch.compile an op is traced into its implementation where the chosen backend is
traceable (the reference's torch ops; Triton's JIT kernels, which Inductor then launches);
a call on the CUDA extension stays one opaque custom op.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kernelforge import backends, tuning
from kernelforge.ops._common import FLOAT_DTYPES, GPU_FLOAT_DTYPES, as_float, check_floating, check_same, require
from kernelforge.ops._opdef import Op, define_op

OP = "norms"  # the backend registry's name for the family: the norms share kernels and rules


# ----------------------------------------------------------------------------- dispatch
def _why_not_triton(x: torch.Tensor, weight=None, bias=None, **direction):
    from kernelforge.triton import why_unavailable

    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in GPU_FLOAT_DTYPES:
            return f"Triton kernels take float32/float16/bfloat16, got {name} of {t.dtype}"
    return why_unavailable(x.device)


def _why_not_cuda(x: torch.Tensor, weight=None, bias=None, **direction):
    from kernelforge.cuda import why_unavailable

    if x.device.type != "cuda":
        return f"the CUDA extension runs on CUDA tensors, got a {x.device.type} tensor"
    from kernelforge.cuda.norms import why_not

    return why_not(x, weight, bias) or why_unavailable("norms")


def _why_not_reference(x: torch.Tensor, weight=None, bias=None, **direction):
    return None


# Triton's kernels take less device time than the CUDA extension's at every size measured on an H200
# (bf16, 16x4096 to 16384x4096, benchmarks/tuning/backend_order.py): forward 0.28-0.58x, forward+backward
# 0.50-0.73x, and with its eager plan a call costs less host time too. Only large backward passes
# over rows of up to this many columns measured the other way for the layer norm (16384x4096: CUDA's
# backward 185 against 199 us on the H200, 207 against 216 on an H100; RMS: 160 against 153 on the
# H200, 182 against 186 on the H100): there the CUDA kernels stay first.
CUDA_BACKWARD_MAX_COLS = 8192
CUDA_BACKWARD_MIN_ELEMENTS = 1 << 25


def _cuda_backward(x: torch.Tensor, n: int) -> bool:
    return n <= CUDA_BACKWARD_MAX_COLS and x.numel() >= CUDA_BACKWARD_MIN_ELEMENTS


def _preference(x: torch.Tensor, weight=None, bias=None, n: int = 0, backward: bool = False):
    if x.device.type != "cuda":
        return ("reference",), "the reference is the CPU implementation"
    if backward and _cuda_backward(x, n):
        return ("cuda", "triton", "reference"), (
            f"backward over >= {CUDA_BACKWARD_MIN_ELEMENTS} elements in rows of <= {CUDA_BACKWARD_MAX_COLS}: the "
            "CUDA kernels measured 2-4% faster (H100, 16384x4096)")
    return ("triton", "cuda", "reference"), (
        "Triton's kernels take less device time than the CUDA extension's at every size measured below "
        f"{CUDA_BACKWARD_MIN_ELEMENTS} elements (H200: forward 0.14-0.58x, forward+backward 0.50-0.73x) and, "
        "with its eager plan, less host time a call")


def _choice_key(x: torch.Tensor, weight=None, bias=None, n: int = 0, backward: bool = False):
    dtype = lambda t: None if t is None else t.dtype  # noqa: E731
    return x.device.type, x.dtype, dtype(weight), dtype(bias), backward and _cuda_backward(x, n)


backends.register(OP, "triton", "kernelforge.triton.norms", _why_not_triton)
# kf.explain("rms_norm", x, weight) and the like: the public names of the family
backends.register_alias("layer_norm", OP)
backends.register_alias("rms_norm", OP)
backends.register_alias("add_layer_norm", OP)
backends.register_alias("add_rms_norm", OP)
backends.register(OP, "cuda", "kernelforge.cuda.norms", _why_not_cuda)
backends.register(OP, "reference", "kernelforge.reference.norms", _why_not_reference)
backends.set_preference(OP, _preference, _choice_key)
backends.set_tuning(OP, tuning.NORMS)  # measured on CUDA where it pays (kernelforge.tuning)


# ----------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class _Variant:
    name: str
    rms: bool
    residual: bool

    @property
    def backward_name(self) -> str:
        return "rms_norm_backward" if self.rms else "layer_norm_backward"

    def outputs(self, y, residual_out, mean, rstd) -> tuple:
        """The registered forward op's outputs, in schema order."""
        return (y,) + ((residual_out,) if self.residual else ()) + (() if self.rms else (mean,)) + (rstd,)

    def split_outputs(self, outputs: Sequence[torch.Tensor]):
        """(y, residual_out or None, mean or None, rstd) from the forward op's outputs."""
        outputs = list(outputs)
        y = outputs.pop(0)
        residual_out = outputs.pop(0) if self.residual else None
        mean = None if self.rms else outputs.pop(0)
        return y, residual_out, mean, outputs.pop(0)


LAYER_NORM = _Variant("layer_norm", rms=False, residual=False)
ADD_LAYER_NORM = _Variant("add_layer_norm", rms=False, residual=True)
RMS_NORM = _Variant("rms_norm", rms=True, residual=False)
ADD_RMS_NORM = _Variant("add_rms_norm", rms=True, residual=True)
VARIANTS = (LAYER_NORM, ADD_LAYER_NORM, RMS_NORM, ADD_RMS_NORM)


# ----------------------------------------------------------------------------- checks
def _check_param(op: str, name: str, t: Optional[torch.Tensor], x: torch.Tensor, normalized_shape) -> None:
    if t is None:
        return
    check_floating(op, name, t, FLOAT_DTYPES)
    check_same(op, "device", ("x", name), (x.device, t.device))
    require(
        tuple(t.shape) == tuple(normalized_shape),
        lambda: f"kernelforge.{op}: {name} must have shape normalized_shape={tuple(normalized_shape)}, "
        f"got {tuple(t.shape)}")


def _check_forward(v: _Variant, x, residual, normalized_shape, weight, bias, eps: float) -> int:
    """Validates a forward call; returns n, the number of elements normalized together."""
    check_floating(v.name, "x", x, FLOAT_DTYPES)
    k = len(normalized_shape)
    if k == 0:
        raise ValueError(f"kernelforge.{v.name}: normalized_shape must have at least one dim, got []")
    if k > x.dim() or tuple(x.shape[x.dim() - k:]) != tuple(normalized_shape):
        raise ValueError(
            f"kernelforge.{v.name}: normalized_shape={tuple(normalized_shape)} must match the trailing "
            f"dims of x, got x of shape {tuple(x.shape)}")
    if not eps >= 0:
        raise ValueError(f"kernelforge.{v.name}: eps must be >= 0, got {eps}")
    if v.residual:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"kernelforge.{v.name}: residual must be a tensor, got {type(residual).__name__}")
        check_floating(v.name, "residual", residual, FLOAT_DTYPES)
        check_same(v.name, "device", ("x", "residual"), (x.device, residual.device))
        check_same(v.name, "dtype", ("x", "residual"), (x.dtype, residual.dtype))
        check_same(v.name, "shape", ("x", "residual"), (tuple(x.shape), tuple(residual.shape)))
    _check_param(v.name, "weight", weight, x, normalized_shape)
    _check_param(v.name, "bias", bias, x, normalized_shape)
    return math.prod(normalized_shape)


def _check_backward(op: str, grad_y, grad_residual, h, normalized_shape, weight, bias, stats) -> int:
    names = ("grad_y", "h") + (("grad_residual",) if grad_residual is not None else ())
    tensors = (grad_y, h) + ((grad_residual,) if grad_residual is not None else ())
    check_floating(op, "h", h, FLOAT_DTYPES)
    check_same(op, "device", names, tuple(t.device for t in tensors))
    check_same(op, "dtype", names, tuple(t.dtype for t in tensors))
    check_same(op, "shape", names, tuple(tuple(t.shape) for t in tensors))
    k = len(normalized_shape)
    require(
        0 < k <= h.dim() and tuple(h.shape[h.dim() - k:]) == tuple(normalized_shape),
        lambda: f"kernelforge.{op}: normalized_shape={tuple(normalized_shape)} must match the trailing "
        f"dims of h, got h of shape {tuple(h.shape)}")
    stats_dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    for name, s in stats.items():
        check_same(op, "device", ("h", name), (h.device, s.device))
        require(s.dtype == stats_dtype,
                lambda: f"kernelforge.{op}: {name} must have dtype {stats_dtype} for h of {h.dtype}, got {s.dtype}")
        require(
            tuple(s.shape) == tuple(h.shape[: h.dim() - k]),
            lambda: f"kernelforge.{op}: {name} must have shape {tuple(h.shape[: h.dim() - k])} "
            f"(h without the normalized dims), got {tuple(s.shape)}")
    _check_param(op, "weight", weight, h, normalized_shape)
    _check_param(op, "bias", bias, h, normalized_shape)
    return math.prod(normalized_shape)


# ----------------------------------------------------------------------------- implementation
def _rows(t: Optional[torch.Tensor], normalized_ndim: int) -> Optional[torch.Tensor]:
    """t as (rows, n), n the product of its last `normalized_ndim` dims, with unit column
    stride: a view when the layout allows, else a copy. (Not reshape(-1, n): n may be 0.)"""
    if t is None:
        return None
    if normalized_ndim == 1 and t.dim() == 2 and t.stride(1) == 1:
        return t  # already (rows, n): the common call, kept free of reshape's cost
    lead = t.dim() - normalized_ndim
    n = math.prod(t.shape[lead:])
    t2d = t.reshape(math.prod(t.shape[:lead]), n)
    return t2d if t2d.stride(1) == 1 or n <= 1 else t2d.contiguous()


def _flat(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if t is None or (t.dim() == 1 and t.is_contiguous()):
        return t
    return t.reshape(-1).contiguous()


def _shaped(t: torch.Tensor, shape) -> torch.Tensor:
    """t viewed as `shape`; no view (a few microseconds of host time) when it already is."""
    return t if t.shape == shape else t.view(shape)


_EMPTY_REASON = "an empty input has nothing to launch: the reference shapes the empty results"


def _choose(x: torch.Tensor, weight, bias, n: int, backward: bool) -> backends.Choice:
    """The backend that runs a norm (or its backward, `backward`) over rows of n elements of x."""
    if x.numel() == 0:
        return backends.Choice(backends.implementations(OP)["reference"], _EMPTY_REASON)
    return backends.select(OP, x, weight, bias, n=n, backward=backward)


def _forward(v: _Variant, x, residual, normalized_shape, weight, bias, eps: float, offset: float) -> tuple:
    """What the forward op computes, as its output tuple."""
    n = _check_forward(v, x, residual, normalized_shape, weight, bias, eps)
    k = len(normalized_shape)
    y, residual_out, mean, rstd = _choose(x, weight, bias, n, backward=False).implementation.launchers(
    ).norm_forward_rows(_rows(x, k), _rows(residual, k), _flat(weight), _flat(bias), eps, v.rms, offset)
    stats_shape = x.shape[: x.dim() - len(normalized_shape)]
    return v.outputs(
        _shaped(y, x.shape), None if residual_out is None else _shaped(residual_out, x.shape),
        None if mean is None else _shaped(mean, stats_shape), _shaped(rstd, stats_shape))


def _backward(op: str, grad_y, grad_residual, h, normalized_shape, weight, bias, mean, rstd,
              offset: float, weight_grads: bool) -> list:
    """What the backward ops compute."""
    stats = {"rstd": rstd} if mean is None else {"mean": mean, "rstd": rstd}
    n = _check_backward(op, grad_y, grad_residual, h, normalized_shape, weight, bias, stats)
    k = len(normalized_shape)
    dh, dw, db = _choose(h, weight, bias, n, backward=True).implementation.launchers().norm_backward_rows(
        _rows(grad_y, k), _rows(grad_residual, k), _rows(h, k), _flat(weight), None if bias is None else bias.dtype,
        _flat(mean), _flat(rstd), mean is None, offset, weight_grads)
    grads = [_shaped(dh, h.shape)]
    if dw is not None:
        grads.append(_shaped(dw, weight.shape))
    if db is not None:
        grads.append(_shaped(db, bias.shape))
    return grads


def _fake_backward(op: str, grad_y, grad_residual, h, normalized_shape, weight, bias, mean, rstd,
                   weight_grads: bool) -> list:
    stats = {"rstd": rstd} if mean is None else {"mean": mean, "rstd": rstd}
    _check_backward(op, grad_y, grad_residual, h, normalized_shape, weight, bias, stats)
    params = (weight, bias) if weight_grads else ()
    return [torch.empty_like(h, memory_format=torch.contiguous_format)] + [
        torch.empty_like(p, memory_format=torch.contiguous_format) for p in params if p is not None]


def _fake_forward(v: _Variant, x, residual, normalized_shape, weight, bias, eps: float, offset: float) -> tuple:
    _check_forward(v, x, residual, normalized_shape, weight, bias, eps)
    stats_shape = x.shape[: x.dim() - len(normalized_shape)]
    stats_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    new_stat = lambda: x.new_empty(stats_shape, dtype=stats_dtype)  # noqa: E731
    dense = lambda: torch.empty_like(x, memory_format=torch.contiguous_format)  # noqa: E731
    return v.outputs(dense(), dense() if v.residual else None, None if v.rms else new_stat(), new_stat())


# ----------------------------------------------------------------------------- gradients
def _double_backward(ctx, grad_grads):
    """Gradients of a backward op (create_graph=True): autograd through the reference's
    backward formula, with the statistics recomputed from h so that their dependence on
    h is counted (the mean and rstd inputs then get no gradient of their own). grad_grads: the
    gradients of the op's Tensor[] output, as one list."""
    from kernelforge.reference.norms import differentiable_backward

    grad_y, grad_residual, h, weight, bias = ctx.saved_tensors
    create_graph = torch.is_grad_enabled()  # read before enable_grad below
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_() if t is not None else None
                  for t in (grad_y, grad_residual, h, weight)]
        bias_dtype = None if bias is None else bias.dtype
        outputs = differentiable_backward(*inputs, ctx.normalized_shape, bias_dtype, ctx.eps, ctx.rms, ctx.offset,
                                          ctx.weight_grads)
        outputs = [o for o in outputs if o is not None]  # aligned with the op's output list
        pairs = [(o, g) for o, g in zip(outputs, grad_grads) if g is not None]
        wrt = [t for t in inputs if t is not None]
        found = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                    allow_unused=True, create_graph=create_graph)
    found = iter(found)
    d_grad_y, d_grad_residual, d_h, d_weight = (next(found) if t is not None else None for t in inputs)
    stats = (None,) if ctx.rms else (None, None)
    return (d_grad_y, d_grad_residual, d_h, None, d_weight, None, *stats, None, None, None)


def _input_grads(ctx, v: _Variant, grads, backward_op: Op, weight_grads: bool) -> tuple:
    """Gradients for (x, [residual], normalized_shape, weight, bias, eps, offset) from the
    gradients of the forward outputs."""
    h, weight, bias, mean, rstd = ctx.saved_tensors
    grad_y = grads[0] if grads[0] is not None else torch.zeros_like(h)
    grad_residual = grads[1] if v.residual else None
    stats = (rstd,) if v.rms else (mean, rstd)
    result = iter(backward_op(grad_y, grad_residual, h, ctx.normalized_shape, weight, bias, *stats,
                              ctx.eps, ctx.offset, weight_grads))
    grad_h = next(result)
    grad_weight = next(result) if weight_grads and weight is not None else None
    grad_bias = next(result) if weight_grads and bias is not None else None
    return ((grad_h, grad_h) if v.residual else (grad_h,)) + (None, grad_weight, grad_bias, None, None)


# ----------------------------------------------------------------------------- definitions
def _define_backward(v: _Variant) -> Op:
    """kernelforge::layer_norm_backward or rms_norm_backward (v: the variant without residual)."""
    name = v.backward_name
    stats = "Tensor rstd" if v.rms else "Tensor mean, Tensor rstd"
    schema = (f"kernelforge::{name}(Tensor grad_y, Tensor? grad_residual, Tensor h, int[] normalized_shape, "
              f"Tensor? weight, Tensor? bias, {stats}, float eps, float offset, bool weight_grads) -> Tensor[]")
    if v.rms:
        def impl(gy, gr, h, ns, w, b, rstd, eps, offset, wg):
            return _backward(name, gy, gr, h, ns, w, b, None, rstd, offset, wg)

        def fake(gy, gr, h, ns, w, b, rstd, eps, offset, wg):
            return _fake_backward(name, gy, gr, h, ns, w, b, None, rstd, wg)
    else:
        def impl(gy, gr, h, ns, w, b, mean, rstd, eps, offset, wg):
            return _backward(name, gy, gr, h, ns, w, b, mean, rstd, offset, wg)

        def fake(gy, gr, h, ns, w, b, mean, rstd, eps, offset, wg):
            return _fake_backward(name, gy, gr, h, ns, w, b, mean, rstd, wg)

    def choose(gy, gr, h, ns, w, b, *stats_and_flags):
        return _choose(h, w, b, math.prod(ns), backward=True)

    def setup_context(ctx, inputs, output):
        grad_y, grad_residual, h, normalized_shape, weight, bias = inputs[:6]
        eps, offset, weight_grads = inputs[-3:]
        ctx.save_for_backward(grad_y, grad_residual, h, weight, bias)
        ctx.normalized_shape, ctx.eps, ctx.offset, ctx.rms, ctx.weight_grads = (
            normalized_shape, eps, offset, v.rms, weight_grads)

    return define_op(schema, impl, fake, choose=choose, setup_context=setup_context, backward=_double_backward)


def _define_forward(v: _Variant, backward_op: Op) -> Op:
    residual_arg = "Tensor residual, " if v.residual else ""
    n_outputs = 1 + v.residual + (not v.rms) + 1
    schema = (f"kernelforge::{v.name}(Tensor x, {residual_arg}int[] normalized_shape, Tensor? weight, "
              f"Tensor? bias, float eps, float offset) -> ({', '.join(['Tensor'] * n_outputs)})")
    if v.residual:
        def impl(x, residual, normalized_shape, weight, bias, eps, offset):
            return _forward(v, x, residual, normalized_shape, weight, bias, eps, offset)

        def fake(x, residual, normalized_shape, weight, bias, eps, offset):
            return _fake_forward(v, x, residual, normalized_shape, weight, bias, eps, offset)

        def choose(x, residual, normalized_shape, weight, bias, eps, offset):
            return _choose(x, weight, bias, math.prod(normalized_shape), backward=False)
    else:
        def impl(x, normalized_shape, weight, bias, eps, offset):
            return _forward(v, x, None, normalized_shape, weight, bias, eps, offset)

        def fake(x, normalized_shape, weight, bias, eps, offset):
            return _fake_forward(v, x, None, normalized_shape, weight, bias, eps, offset)

        def choose(x, normalized_shape, weight, bias, eps, offset):
            return _choose(x, weight, bias, math.prod(normalized_shape), backward=False)

    weight_index = 2 + v.residual  # of weight in the op's arguments; bias follows it

    def setup_context(ctx, inputs, output):
        x, normalized_shape, weight, bias, eps, offset = (inputs[0],) + tuple(inputs[1 + v.residual:])
        _, residual_out, mean, rstd = v.split_outputs(output)
        ctx.save_for_backward(residual_out if v.residual else x, weight, bias, mean, rstd)
        ctx.normalized_shape, ctx.eps, ctx.offset = normalized_shape, eps, offset
        # the statistics are for the backward, not values to differentiate
        ctx.mark_non_differentiable(*(s for s in (mean, rstd) if s is not None))
        # an unused output's gradient comes as None, not zeros: an add_ form whose residual_out
        # gets no gradient then adds none in the backward kernel
        ctx.set_materialize_grads(False)

    def backward(ctx, *grads):
        weight_grads = ctx.needs_input_grad[weight_index] or ctx.needs_input_grad[weight_index + 1]
        return _input_grads(ctx, v, grads, backward_op, weight_grads)

    return define_op(schema, impl, fake, choose=choose, setup_context=setup_context, backward=backward)


layer_norm_backward_op = _define_backward(LAYER_NORM)
rms_norm_backward_op = _define_backward(RMS_NORM)
layer_norm_op = _define_forward(LAYER_NORM, layer_norm_backward_op)
add_layer_norm_op = _define_forward(ADD_LAYER_NORM, layer_norm_backward_op)
rms_norm_op = _define_forward(RMS_NORM, rms_norm_backward_op)
add_rms_norm_op = _define_forward(ADD_RMS_NORM, rms_norm_backward_op)


# ----------------------------------------------------------------------------- public API
# torch.nn.RMSNorm's default eps (torch.finfo(x.dtype).eps), without finfo's cost a call
_DEFAULT_EPS = {dtype: torch.finfo(dtype).eps for dtype in FLOAT_DTYPES}


def _call(op: Op, v: _Variant, x, residual, weight, bias, eps, offset, normalized_shape):
    """The public functions' argument defaults, then the op; its checks are the op's own."""
    if normalized_shape is None:
        if x.dim() == 0:
            check_floating(v.name, "x", x, FLOAT_DTYPES)  # a bad dtype is reported first, as the op does
            raise ValueError(f"kernelforge.{v.name}: x must have at least one dim, got a 0-dim tensor")
        param = weight if weight is not None else bias
        normalized_shape = tuple(param.shape) if param is not None else (x.shape[-1],)
    normalized_shape = [int(s) for s in normalized_shape] if not isinstance(normalized_shape, int) else [normalized_shape]
    if eps is None:  # an x of another dtype gets 0.0 here and the op's dtype error
        eps = _DEFAULT_EPS.get(x.dtype, 0.0)
    args = (x, residual) if v.residual else (x,)
    eps, offset = as_float(v.name, "eps", eps), as_float(v.name, "offset", offset)
    outputs = op(*args, normalized_shape, weight, bias, eps, offset)
    return (outputs[0], outputs[1]) if v.residual else outputs[0]


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
               eps: float = 1e-5, *, normalized_shape=None, offset: float = 0.0) -> torch.Tensor:
    """Layer norm over the trailing dims of `normalized_shape` (default: weight's shape, else
    the last dim): (x - mean) / sqrt(var + eps) * (weight + offset) + bias, in float32 for
    low-precision inputs. weight and bias are optional; differentiable in all of them."""
    return _call(layer_norm_op, LAYER_NORM, x, None, weight, bias, eps, offset, normalized_shape)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: Optional[float] = None,
             offset: float = 0.0, *, bias: Optional[torch.Tensor] = None, normalized_shape=None) -> torch.Tensor:
    """RMS norm: x / sqrt(mean(x^2) + eps) * (weight + offset) (+ bias). offset=1.0 is Gemma's
    x * (1 + w); eps=None takes torch.finfo(x.dtype).eps, as torch.nn.RMSNorm does."""
    return _call(rms_norm_op, RMS_NORM, x, None, weight, bias, eps, offset, normalized_shape)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None, eps: float = 1e-5, *, normalized_shape=None,
                   offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual) in one pass: the pre-norm transformer's
    residual stream. The sum is rounded to x's dtype and normalized as stored."""
    return _call(add_layer_norm_op, ADD_LAYER_NORM, x, residual, weight, bias, eps, offset, normalized_shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor] = None,
                 eps: Optional[float] = None, offset: float = 0.0, *, bias: Optional[torch.Tensor] = None,
                 normalized_shape=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; see add_layer_norm."""
    return _call(add_rms_norm_op, ADD_RMS_NORM, x, residual, weight, bias, eps, offset, normalized_shape)


__all__ = ["add_layer_norm", "add_rms_norm", "layer_norm", "rms_norm"]
