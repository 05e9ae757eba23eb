"""Benchmark suites: for each op, its shapes, inputs, cost and the implementations to race.

Adding an op to `kernelforge bench` means adding one `Suite` (kernelforge.bench.suite_types) to
SUITES here: the shape grid (the large target shapes, latency shapes where per-call overhead
dominates, and small CPU shapes), how to make inputs, what one call must move and compute
(`Cost`), and the baselines (PyTorch eager, torch.compile, peers when importable). The attention
suites are in kernelforge.bench.attention_suites, the GEMM suites in kernelforge.bench.gemm_suites,
the ConvRNN suite in kernelforge.bench.recurrent_suites, the gather-scatter suite in
kernelforge.bench.message_passing_suites.
"""
from __future__ import annotations

import importlib.util
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import kernelforge as kf
from kernelforge import backends
from kernelforge.bench.attention_suites import attention_suites
from kernelforge.bench.gemm_suites import gemm_suites
from kernelforge.bench.message_passing_suites import message_passing_suites
from kernelforge.bench.recurrent_suites import recurrent_suites
from kernelforge.bench.roofline import Cost
from kernelforge.bench.suite_types import Fn, Shape, Suite, Unavailable


def _softmax_kernel_only() -> dict[str, Fn]:
    from kernelforge.cuda import why_unavailable
    from kernelforge.triton.softmax import softmax_forward_rows as triton_rows

    impls = {"triton kernel only": lambda x: triton_rows(x, False)}
    if why_unavailable("softmax") is None:
        from kernelforge.cuda.softmax import softmax_forward_rows as cuda_rows

        impls["cuda kernel only"] = lambda x: cuda_rows(x, False)
    return impls


def _norm_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, bias: bool) -> tuple:
    n = shape[-1]
    x = torch.randn(shape, device=device, dtype=dtype) * 2 + 0.5
    params = (torch.randn(n, device=device, dtype=dtype),) + ((torch.randn(n, device=device, dtype=dtype),) if bias else ())
    return (x,) + params


def _norm_cost(shape: Shape, dtype: torch.dtype, direction: str) -> Cost:
    # forward reads x and writes y; backward reads dy and x and writes dx (the norms' fwd+bwd
    # ~5*M*N*E); the weight/bias reads and their gradients are O(N), negligible.
    return Cost((2 if direction == "fwd" else 5) * torch.Size(shape).numel() * dtype.itemsize)


def _add_norm_cost(shape: Shape, dtype: torch.dtype, direction: str) -> Cost:
    # forward reads x and residual, writes y and residual_out; backward reads dy, the
    # residual_out gradient and h, and writes dh (the gradient of x and residual alike)
    return Cost((4 if direction == "fwd" else 8) * torch.Size(shape).numel() * dtype.itemsize)


def _eager_add_norm(rms: bool) -> Fn:
    def run(x, residual, w, b=None):
        h = x + residual
        n = (x.shape[-1],)
        return (torch.nn.functional.rms_norm(h, n, w, 1e-6) if rms
                else torch.nn.functional.layer_norm(h, n, w, b, 1e-5)), h

    return run


def _norm_kernel_only(rms: bool) -> Callable[[], dict[str, Fn]]:
    def impls() -> dict[str, Fn]:
        from kernelforge.triton.norms import norm_forward_rows

        def run(x, w, b=None):
            return norm_forward_rows(x.view(-1, x.shape[-1]), None, w, b, 1e-6 if rms else 1e-5, rms, 0.0)[0]

        return {"triton kernel only": run}

    return impls


def _elementwise_cost(reads: int, writes: int, grad_reads: int, grad_writes: int):
    """Elementwise ops: tensors of the input's size read and written forward, and by the
    backward (which reads dy and recomputes from the inputs instead of saving anything)."""
    def cost(shape: Shape, dtype: torch.dtype, direction: str) -> Cost:
        tensors = reads + writes + (0 if direction == "fwd" else grad_reads + grad_writes)
        return Cost(tensors * torch.Size(shape).numel() * dtype.itemsize)

    return cost


def _baselines(eager: Fn, liger: Optional[Callable[[], Fn]] = None) -> Callable[[], dict[str, Fn]]:
    """Eager PyTorch, its torch.compile, and Liger-Kernel's version when it is importable
    (`liger` builds it; only called then)."""
    def impls() -> dict[str, Fn]:
        found = {"torch eager": eager, "torch.compile": torch.compile(eager, dynamic=False)}
        if liger is not None and importlib.util.find_spec("liger_kernel") is not None:
            found["liger"] = liger()
        return found

    return impls


def _liger_layer_norm() -> Fn:
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5)


def _liger_rms_norm() -> Fn:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    # not in place: Liger's default writes dX over dY, and the harness reuses dY
    return lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False)


def _liger_add_rms_norm() -> Fn:
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    return lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, 1e-6, 0.0, "llama", False)


def _liger_geglu() -> Fn:
    from liger_kernel.ops.geglu import LigerGELUMulFunction  # gelu's tanh form

    return LigerGELUMulFunction.apply


def _liger_softmax() -> Fn:
    from liger_kernel.ops.softmax import LigerSoftmaxFunction  # over the last dim

    return LigerSoftmaxFunction.apply


def _liger_swiglu() -> Fn:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply


def _add_norm_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, bias: bool) -> tuple:
    x, *params = _norm_inputs(shape, dtype, device, bias)
    return (x, torch.randn(shape, device=device, dtype=dtype), *params)


def _bias_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> tuple:
    return torch.randn(shape, device=device, dtype=dtype), torch.randn(shape[-1], device=device, dtype=dtype)


def _gated_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> tuple:
    return torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype)


def _cross_entropy_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> tuple:
    rows, classes = shape
    return (torch.randn(shape, device=device, dtype=dtype) * 4,
            torch.randint(0, classes, (rows,), device=device))


def _cross_entropy_cost(shape: Shape, dtype: torch.dtype, direction: str) -> Cost:
    """The logits read forward; read again and their gradient written backward (the per-row
    target, loss and lse are noise)."""
    return Cost((1 if direction == "fwd" else 3) * torch.Size(shape).numel() * dtype.itemsize)


def _cross_entropy_suite() -> Suite:
    """Mean cross-entropy of (rows, vocabulary) logits. The baseline is PyTorch's float32 recipe,
    F.cross_entropy(logits.float(), target), whose accuracy kernelforge's matches (its loss is
    float32 too); F.cross_entropy straight on bfloat16 logits returns a bfloat16 loss."""
    eager = lambda x, t: torch.nn.functional.cross_entropy(x.float(), t)  # noqa: E731
    return Suite(op="cross_entropy", shapes=[(4096, 128256), (16384, 32000), (8192, 50257), (8, 32000),
                                             (32, 128256)],
                 quick_shapes=[(256, 4096), (8, 1000)], make_inputs=_cross_entropy_inputs, cost=_cross_entropy_cost,
                 kernelforge=lambda x, t: kf.cross_entropy(x, t), baselines=_baselines(eager))


def _rope_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> tuple:
    """q (B, H, S, D) and k (B, Hkv, S, D) as transformers makes them (views of (B, S, H, D)
    projections), and transformers' default angles as one tuple: the runner differentiates
    tensor inputs only, and rotary angles take no gradient in a model."""
    batch, heads, kv_heads, seq, dim = shape
    q = torch.randn(batch, seq, heads, dim, device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(batch, seq, kv_heads, dim, device=device, dtype=dtype).transpose(1, 2)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    freqs = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1).expand(batch, seq, dim)
    return q, k, (emb.cos().to(dtype), emb.sin().to(dtype))


def _rope_cost(shape: Shape, dtype: torch.dtype, direction: str) -> Cost:
    """q and k read and written once forward; their gradients read and written once backward (the
    angles, one row a token shared by every head, are noise)."""
    batch, heads, kv_heads, seq, dim = shape
    return Cost((2 if direction == "fwd" else 4) * batch * seq * (heads + kv_heads) * dim * dtype.itemsize)


def _transformers_rope(q, k, angles):
    """transformers' apply_rotary_pos_emb (rotate-half), as its models run it eagerly."""
    cos, sin = (a.unsqueeze(1) for a in angles)

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _liger_rope() -> Fn:
    from liger_kernel.ops.rope import LigerRopeFunction

    return lambda q, k, angles: LigerRopeFunction.apply(q, k, *angles)


def _rope_suite() -> Suite:
    """Rotary embedding of q and k, (batch, heads, kv heads, seq, head dim): a Llama-3-8B layer's
    at training and prefill lengths, a d64 GQA model's, then decoding's one token."""
    return Suite(op="rope", shapes=[(4, 32, 8, 2048, 128), (1, 32, 8, 8192, 128), (8, 16, 4, 2048, 64),
                                    (1, 32, 8, 1, 128), (8, 32, 8, 1, 128)],
                 quick_shapes=[(1, 4, 2, 128, 64), (1, 4, 2, 1, 64)], make_inputs=_rope_inputs, cost=_rope_cost,
                 kernelforge=lambda q, k, angles: kf.rope(q, k, *angles),
                 baselines=_baselines(_transformers_rope, _liger_rope), peers=LIGER)


def _linear_cross_entropy_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> tuple:
    """x (rows, hidden), an LM head's weight (vocab, hidden), targets."""
    rows, hidden, vocab = shape
    return (torch.randn(rows, hidden, device=device, dtype=dtype),
            torch.randn(vocab, hidden, device=device, dtype=dtype) / hidden ** 0.5,
            torch.randint(0, vocab, (rows,), device=device))


def _linear_cross_entropy_cost(shape: Shape, dtype: torch.dtype, direction: str) -> Cost:
    """The head's GEMMs (one forward; three more backward: the logits again, dx, dW) at the
    matmul ceiling; the weight and x read once per GEMM."""
    rows, hidden, vocab = shape
    gemms = 1 if direction == "fwd" else 4
    return Cost(gemms * (vocab + rows) * hidden * dtype.itemsize, gemms * 2 * rows * hidden * vocab,
                precision="bf16" if dtype == torch.bfloat16 else None)


def _liger_linear_cross_entropy() -> Fn:
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    return lambda x, w, t: LigerFusedLinearCrossEntropyFunction.apply(x, w, t)


def _linear_cross_entropy_suite() -> Suite:
    """An LM head and its mean loss, (tokens, hidden, vocabulary): Llama-3-1B-like (128k vocabulary)
    at 8k tokens, Llama-2-7B-like at 4k, GPT-2's at 8k, then a few tokens. The unfused baseline
    builds the logits and takes PyTorch's float32 recipe of the loss; the runner's memory column
    is the point."""
    eager = lambda x, w, t: torch.nn.functional.cross_entropy((x @ w.t()).float(), t)  # noqa: E731
    return Suite(op="fused_linear_cross_entropy", registry_op="cross_entropy",
                 shapes=[(8192, 2048, 128256), (4096, 4096, 32000), (8192, 768, 50257), (16, 2048, 128256)],
                 quick_shapes=[(64, 64, 1000), (4, 64, 1000)], make_inputs=_linear_cross_entropy_inputs,
                 cost=_linear_cross_entropy_cost, kernelforge=lambda x, w, t: kf.fused_linear_cross_entropy(x, w, t),
                 baselines=_baselines(eager, _liger_linear_cross_entropy), peers=LIGER)


# Norms and activations: the large target shapes, then the latency shapes.
ROW_OP_SHAPES = [(16384, 4096), (8192, 16384), (4096, 65536), (1, 4096), (8, 4096), (32, 4096)]
QUICK_SHAPES = [(256, 4096), (8, 4096)]
# Every row length a norm meets, 256 to 65536, powers of two and not (Llama's 5120 / 11008 / 13824,
# odd and prime lengths), at 2^25 elements a case (64 MiB of bf16: past L2, not host-bound)
NORM_ROW_LENGTHS = [256, 257, 512, 768, 1000, 1024, 2048, 3000, 4096, 5120, 8191, 8192, 11008, 13824, 16384,
                    32768, 65521, 65536]
NORM_ROW_SHAPES = [((1 << 25) // n, n) for n in NORM_ROW_LENGTHS]
def _gated_mlp_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> tuple:
    """x (tokens, hidden), gate / up weights (intermediate, hidden), the down weight (hidden, intermediate)."""
    tokens, hidden, inner = shape
    return (torch.randn(tokens, hidden, device=device, dtype=dtype),
            *(torch.randn(rows, cols, device=device, dtype=dtype) / cols ** 0.5
              for rows, cols in ((inner, hidden), (inner, hidden), (hidden, inner))))


def _gated_mlp_cost(shape: Shape, dtype: torch.dtype, direction: str) -> Cost:
    """Three GEMMs forward, six more backward, at the matmul ceiling (the recomputed activation and
    the elementwise kernels are a few percent of it)."""
    tokens, hidden, inner = shape
    gemms = 3 if direction == "fwd" else 9
    return Cost(gemms * (tokens * (hidden + inner) + hidden * inner) * dtype.itemsize,
                gemms * 2 * tokens * hidden * inner, precision="bf16" if dtype == torch.bfloat16 else None)


def _liger_gated_mlp() -> Fn:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return lambda x, wg, wu, wd: F.linear(LigerSiLUMulFunction.apply(F.linear(x, wg), F.linear(x, wu)), wd)


def _gated_mlp_suite() -> Suite:
    """A Llama MLP, (tokens, hidden, intermediate): Llama-3.2-1B's at 4 x 2048 tokens, Llama-3-8B's
    at 4096. The point is memory: the same GEMMs, one (tokens x intermediate) tensor less kept."""
    eager = lambda x, wg, wu, wd: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)  # noqa: E731
    return Suite(op="gated_mlp", registry_op="gated_activation", shapes=[(8192, 2048, 8192), (4096, 4096, 14336)],
                 quick_shapes=[(64, 64, 128)], make_inputs=_gated_mlp_inputs, cost=_gated_mlp_cost,
                 kernelforge=lambda x, wg, wu, wd: kf.gated_mlp(x, wg, wu, wd),
                 baselines=_baselines(eager, _liger_gated_mlp), peers=LIGER)


LIGER = {"liger": "liger_kernel"}


def _row_op_suite(op: str, registry_op: str, make_inputs, cost, ours: Fn, eager: Fn,
                  liger: Optional[Callable[[], Fn]] = None, shapes=ROW_OP_SHAPES, **extra) -> Suite:
    """A norm or activation on the row-op shape grid (or `shapes`) against eager, torch.compile
    and, when `liger` builds its version, Liger-Kernel."""
    return Suite(op=op, registry_op=registry_op, shapes=shapes, quick_shapes=QUICK_SHAPES,
                 make_inputs=make_inputs, cost=cost, kernelforge=ours, baselines=_baselines(eager, liger),
                 peers=LIGER if liger is not None else {}, **extra)


def _norm_suite(op: str, rms: bool, residual: bool, ours: Fn, eager: Fn, liger=None, shapes=ROW_OP_SHAPES) -> Suite:
    """layer / RMS norm, with weight (and bias for layer norm); the add_ forms also take and
    return the residual."""
    bias = not rms
    if residual:
        make_inputs = lambda shape, dtype, device: _add_norm_inputs(shape, dtype, device, bias)  # noqa: E731
        return _row_op_suite(op, "norms", make_inputs, _add_norm_cost, ours, eager, liger, shapes)
    make_inputs = lambda shape, dtype, device: _norm_inputs(shape, dtype, device, bias)  # noqa: E731
    return _row_op_suite(op, "norms", make_inputs, _norm_cost, ours, eager, liger, shapes,
                         kernel_only=_norm_kernel_only(rms))


def _activation_suite(op: str, kind: str, ours: Fn, eager: Fn, bias: bool = False) -> Suite:
    """An elementwise activation (of x + bias with `bias`): reads x and writes y forward; the
    backward reads dy and x (recomputing what it needs) and writes dx."""
    make_inputs = _bias_inputs if bias else (
        lambda shape, dtype, device: (torch.randn(shape, device=device, dtype=dtype),))
    cost = _elementwise_cost(reads=1, writes=1, grad_reads=2, grad_writes=1)
    return _row_op_suite(op, "activation", make_inputs, cost, ours, eager, support_options={"kind": kind})


def _gated_suite(op: str, ours: Fn, eager: Fn, liger: Callable[[], Fn]) -> Suite:
    """act(gate) * up: forward reads gate and up and writes y; backward reads dy, gate and up
    and writes both gradients."""
    return _row_op_suite(op, "gated_activation", _gated_inputs,
                         _elementwise_cost(reads=2, writes=1, grad_reads=3, grad_writes=2), ours, eager, liger)


SUITES: dict[str, Suite] = {
    "softmax": Suite(
        op="softmax",
        shapes=[(16384, 4096), (8192, 16384), (4096, 65536), (1024, 262144), (4096, 1024),
                (1, 4096), (8, 4096), (32, 4096)],
        quick_shapes=QUICK_SHAPES,
        make_inputs=lambda shape, dtype, device: (torch.randn(shape, device=device, dtype=dtype) * 3,),
        # read x, write y; backward reads dy and y and writes dx
        cost=lambda shape, dtype, direction: Cost(
            (2 if direction == "fwd" else 5) * torch.Size(shape).numel() * dtype.itemsize),
        kernelforge=lambda x: kf.softmax(x, -1),
        baselines=_baselines(lambda x: torch.softmax(x, -1), _liger_softmax),
        peers=LIGER,
        kernel_only=_softmax_kernel_only,
    ),
    "layer_norm": _norm_suite(
        "layer_norm", rms=False, residual=False, ours=lambda x, w, b: kf.layer_norm(x, w, b, 1e-5),
        eager=lambda x, w, b: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, 1e-5), liger=_liger_layer_norm),
    "rms_norm": _norm_suite(
        "rms_norm", rms=True, residual=False, ours=lambda x, w: kf.rms_norm(x, w, 1e-6),
        eager=lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6), liger=_liger_rms_norm),
    # the row-length sweep: forward+backward at every length >= the best of eager, compile, Liger
    "rms_norm_rows": _norm_suite(
        "rms_norm_rows", rms=True, residual=False, ours=lambda x, w: kf.rms_norm(x, w, 1e-6),
        eager=lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6), liger=_liger_rms_norm,
        shapes=NORM_ROW_SHAPES),
    "layer_norm_rows": _norm_suite(
        "layer_norm_rows", rms=False, residual=False, ours=lambda x, w, b: kf.layer_norm(x, w, b, 1e-5),
        eager=lambda x, w, b: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, 1e-5), liger=_liger_layer_norm,
        shapes=NORM_ROW_SHAPES),
    "gelu": _activation_suite("gelu", "gelu", lambda x: kf.gelu(x), lambda x: torch.nn.functional.gelu(x)),
    "bias_gelu": _activation_suite("bias_gelu", "gelu_tanh", lambda x, b: kf.bias_gelu(x, b, approximate="tanh"),
                                   lambda x, b: torch.nn.functional.gelu(x + b, approximate="tanh"), bias=True),
    "swiglu": _gated_suite("swiglu", lambda gate, up: kf.swiglu(gate, up),
                           lambda gate, up: torch.nn.functional.silu(gate) * up, _liger_swiglu),
    "add_layer_norm": _norm_suite(
        "add_layer_norm", rms=False, residual=True, ours=lambda x, r, w, b: kf.add_layer_norm(x, r, w, b, 1e-5),
        eager=_eager_add_norm(rms=False)),
    "add_rms_norm": _norm_suite(
        "add_rms_norm", rms=True, residual=True, ours=lambda x, r, w: kf.add_rms_norm(x, r, w, 1e-6),
        eager=_eager_add_norm(rms=True), liger=_liger_add_rms_norm),
    "gelu_tanh": _activation_suite("gelu_tanh", "gelu_tanh", lambda x: kf.gelu(x, approximate="tanh"),
                                   lambda x: torch.nn.functional.gelu(x, approximate="tanh")),
    "silu": _activation_suite("silu", "silu", lambda x: kf.silu(x), lambda x: torch.nn.functional.silu(x)),
    "relu": _activation_suite("relu", "relu", lambda x: kf.relu(x), lambda x: torch.nn.functional.relu(x)),
    "bias_silu": _activation_suite("bias_silu", "silu", lambda x, b: kf.bias_silu(x, b),
                                   lambda x, b: torch.nn.functional.silu(x + b), bias=True),
    "geglu": _gated_suite("geglu", lambda gate, up: kf.geglu(gate, up, approximate="tanh"),  # Liger's form
                          lambda gate, up: torch.nn.functional.gelu(gate, approximate="tanh") * up, _liger_geglu),
    "cross_entropy": _cross_entropy_suite(),
    "rope": _rope_suite(),
    "fused_linear_cross_entropy": _linear_cross_entropy_suite(),
    "gated_mlp": _gated_mlp_suite(),
    **attention_suites(),
    **gemm_suites(),
    **recurrent_suites(),
    **message_passing_suites(),
}


def kernelforge_implementations(suite: Suite, inputs: tuple, only: Optional[list[str]] = None,
                                direction: str = "fwd") -> dict[str, Fn]:
    """"kernelforge" (default choice) and "kernelforge[<backend>]" for each backend that can
    run `inputs` (one case's) here. The Triton interpreter is left out on CPU (far too slow
    to time) unless asked for by name. A support predicate that raises gives a row that the
    runner leaves out with the error as its note."""
    impls: dict[str, Fn] = {}
    if only is None:
        impls["kernelforge"] = suite.kernelforge
    args, options = (suite.support_args(inputs, direction) if suite.support_args is not None
                     else ((inputs[0],), suite.support_options))
    for name, impl in backends.implementations(suite.registry_op or suite.op).items():
        if only is not None and name not in only:
            continue
        if only is None and name == "triton" and args[0].device.type == "cpu":
            continue
        try:
            offered = impl.supports(*args, **options) is None
        except Exception as err:  # a broken predicate is noted, not a crash of the whole run
            impls[f"kernelforge[{name}]"] = _unavailable(f"its support check raised {type(err).__name__}: {err}")
            continue
        if offered:
            impls[f"kernelforge[{name}]"] = forced(name, suite.kernelforge)
    return impls


def _unavailable(reason: str) -> Fn:
    def run(*args):
        raise Unavailable(reason)

    return run


def forced(backend: str, fn: Fn) -> Fn:
    """fn on `backend`; tagged, so that a forward+backward run keeps the backend for the
    backward too (see kernelforge.bench.runner.prepare_call)."""
    def run(*args):
        with kf.use_backend(backend):
            return fn(*args)

    run.forced_backend = backend
    return run


def missing_peers(suite: Suite) -> list[str]:
    return [name for name, module in suite.peers.items() if importlib.util.find_spec(module) is None]
