"""gather_scatter (message passing's sum / mean aggregation): schemas, input checks, fake
implementations, autograd, dispatch.

    out = kernelforge.gather_scatter(x, src, dst, num_nodes, reduce="sum")
    out[i] = sum over the edges e with dst[e] == i of x[src[e]]       (reduce="mean": / max(1, in-degree))

x (N, ...) floating, rows are nodes (trailing dims are features, flattened to F for the kernels);
src, dst (E,) int32 or int64 on x's device; out (num_nodes, ...) in x's dtype, 0 where no edge
arrives. Definition: kernelforge/reference/gather_scatter.py. Gradients flow to x only:
grad_x[src[e]] += grad_out[dst[e]] (/ in-degree of dst[e] for the mean), the same aggregation with
src and dst swapped, which every backend runs through its forward kernel.

Ops (kernelforge.ops._opdef.define_op: a fake, autograd, the lean eager call):
    kernelforge::gather_scatter(Tensor x, Tensor src, Tensor dst, int num_nodes, str reduce) -> Tensor
    kernelforge::gather_scatter_backward(Tensor grad_output, Tensor src, Tensor dst, int num_rows,
                                         str reduce) -> Tensor
The backward is linear in grad_output and its own gradient is the forward op, so any order of
derivatives works.

Backends: registry "gather_scatter" (gather_scatter_rows, gather_scatter_backward_rows on
(rows, F) views with unit feature stride): triton and reference. The Triton kernel adds with
float32 atomics, so its sums round in a different order from run to run: while
torch.use_deterministic_algorithms is on it is refused (a forced use_backend("triton") raises
BackendUnsupportedError) and the reference, which torch runs deterministically, is chosen.
Indices are not range-checked on the GPU: the reference raises from index_select / index_add_,
the Triton kernel reads and writes out of bounds (undefined, as torch's CUDA index_add_); the GNN
model (kernelforge.models.GraphNeuralNetwork) checks ranges on the host. Both backends are
traceable: under torch.compile the ops decompose into the Triton kernels (their atomics add into
float32 buffers the launcher allocates and zeroes) or the reference's torch ops; the
deterministic-mode refusal holds there too (Dynamo guards on the setting).
"""
from __future__ import annotations

import math

import torch

from kernelforge import backends
from kernelforge.ops._common import FLOAT_DTYPES, GPU_FLOAT_DTYPES, check_floating, check_same, require
from kernelforge.ops._opdef import define_op, is_traced
from kernelforge.reference.gather_scatter import REDUCTIONS

OP = "gather_scatter"  # the backend registry's name
NAME = "gather_scatter"  # what the messages call the public function
INDEX_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------- dispatch
# The predicates look at x (grad_output in the backward) only; the rest of the op's arguments
# are accepted so that kernelforge.explain("gather_scatter", x, src, dst, num_nodes) works.
def _why_not_triton(x: torch.Tensor, src=None, dst=None, num_nodes=None, reduce: str = "sum"):
    from kernelforge.triton import why_unavailable

    if x.dtype not in GPU_FLOAT_DTYPES:
        return f"Triton kernels take float32/float16/bfloat16, got {x.dtype}"
    if torch.are_deterministic_algorithms_enabled():
        return ("torch.use_deterministic_algorithms is on and the Triton kernel sums with float32 atomics, "
                "whose order (and so the result's rounding) varies from run to run")
    return why_unavailable(x.device)


def _why_not_reference(x: torch.Tensor, src=None, dst=None, num_nodes=None, reduce: str = "sum"):
    return None


def _preference(x: torch.Tensor, src=None, dst=None, num_nodes=None, reduce: str = "sum"):
    """Fastest-first backend order for these inputs."""
    if x.device.type != "cuda":
        return ("reference",), "the reference is the CPU implementation"
    # Measured on the H200 (kernelforge bench gather_scatter's cases, the demo GNN's graph): 6.6-9.3x
    # index_select + index_add_ forward, 7.7-9.4x forward + backward.
    return ("triton", "reference"), (
        "the Triton kernel gathers each message straight into a float32 accumulator, where "
        "index_select + index_add_ write the (E, F) messages and read them back")


def _choice_key(x: torch.Tensor, src=None, dst=None, num_nodes=None, reduce: str = "sum"):
    # everything _preference and the _why_not_* predicates look at
    return x.device.type, x.dtype, torch.are_deterministic_algorithms_enabled()


backends.register(OP, "triton", "kernelforge.triton.gather_scatter", _why_not_triton)
backends.register(OP, "reference", "kernelforge.reference.gather_scatter", _why_not_reference)
backends.set_preference(OP, _preference, _choice_key)


# ----------------------------------------------------------------------------- checks
def _check_count(name: str, arg: str, n) -> None:
    # the registered ops' schema says int; the public function may be handed anything
    if isinstance(n, bool) or not isinstance(n, (int, torch.SymInt)):
        raise TypeError(f"kernelforge.{name}: {arg} must be an int, got {type(n).__name__}")
    require(n >= 0, lambda: f"kernelforge.{name}: {arg} must be non-negative, got {n}")


def _check(name: str, values_arg: str, values: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, rows_arg: str,
           rows, reduce: str) -> None:
    """`values` is x (forward) or grad_output (backward); `rows` the output's row count."""
    check_floating(name, values_arg, values, FLOAT_DTYPES)
    if values.dim() == 0:
        raise ValueError(f"kernelforge.{name}: {values_arg} must have at least 1 dim (one row per node), "
                         "got a 0-dim tensor")
    for arg, idx in (("src", src), ("dst", dst)):
        if idx.dtype not in INDEX_DTYPES:
            raise TypeError(f"kernelforge.{name}: {arg} must have dtype in (int32, int64), got {idx.dtype}")
        if idx.dim() != 1:
            raise ValueError(f"kernelforge.{name}: {arg} must be 1-D (one node id per edge), got shape "
                             f"{tuple(idx.shape)}")
    check_same(name, "device", (values_arg, "src", "dst"), (values.device, src.device, dst.device))
    require(src.shape[0] == dst.shape[0],
            lambda: f"kernelforge.{name}: expected src, dst to have the same length (one entry per edge), got "
                    f"src: {src.shape[0]}, dst: {dst.shape[0]}")
    _check_count(name, rows_arg, rows)
    if reduce not in REDUCTIONS:
        raise ValueError(f"kernelforge.{name}: reduce must be 'sum' or 'mean', got {reduce!r}")


def _check_forward(x, src, dst, num_nodes, reduce) -> None:
    _check(NAME, "x", x, src, dst, "num_nodes", num_nodes, reduce)


def _check_ids_on_the_host(x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, num_nodes: int) -> None:
    """Real CPU tensors only (reading them costs no device sync; a tracer's have no values): every
    id inside its range, else an IndexError naming the argument, the id and the range (torch's
    index_add_ into zero rows accepts any id, and its other messages name neither). On a GPU the
    kernels do not check."""
    for arg, ids, bound, of in (("src", src, x.shape[0], "x's rows"), ("dst", dst, num_nodes, "num_nodes")):
        if is_traced(ids) or ids.device.type != "cpu" or ids.numel() == 0:
            continue
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= bound:
            raise IndexError(f"kernelforge.{NAME}: {arg} holds node id {low if low < 0 else high}, outside "
                             f"[0, {bound}) ({of})")


def _check_backward(grad_output, src, dst, num_rows, reduce) -> None:
    _check(f"{NAME}_backward", "grad_output", grad_output, src, dst, "num_rows", num_rows, reduce)


# ----------------------------------------------------------------------------- implementation
def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """t (rows, ...) as (rows, F) with unit feature stride (a copy only when the layout needs one)."""
    t2d = t.reshape(t.shape[0], math.prod(t.shape[1:]))
    return t2d if t2d.shape[1] <= 1 or t2d.stride(1) == 1 else t2d.contiguous()


def _choose(t: torch.Tensor) -> backends.Choice:
    return backends.select(OP, t)


def _forward(x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, num_nodes: int, reduce: str) -> torch.Tensor:
    _check_forward(x, src, dst, num_nodes, reduce)
    _check_ids_on_the_host(x, src, dst, num_nodes)
    y2d = _choose(x).implementation.launchers().gather_scatter_rows(_rows_view(x), src, dst, num_nodes,
                                                                     reduce == "mean")
    return y2d.view((num_nodes,) + tuple(x.shape[1:]))


def _backward(grad_output: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, num_rows: int,
              reduce: str) -> torch.Tensor:
    _check_backward(grad_output, src, dst, num_rows, reduce)
    grad2d = _choose(grad_output).implementation.launchers().gather_scatter_backward_rows(
        _rows_view(grad_output), src, dst, num_rows, reduce == "mean")
    return grad2d.view((num_rows,) + tuple(grad_output.shape[1:]))


def _fake(check):
    """The forward's and the backward's fake: each is the aggregation from one side,
    (rows, *t.shape[1:]) in t's dtype."""
    def fake(t, src, dst, rows, reduce):
        check(t, src, dst, rows, reduce)
        return t.new_empty((rows,) + tuple(t.shape[1:]))

    return fake


# ----------------------------------------------------------------------------- definitions
def _save(ctx, inputs, output):
    t, src, dst, _, reduce = inputs
    ctx.save_for_backward(src, dst)
    ctx.input_rows, ctx.reduce = t.shape[0], reduce


# Either op's gradient is the other op, back to the input's rows: the forward is out = D A x (A the
# (num_nodes, N) edge-count matrix, D the inverse in-degrees for the mean, else I), the backward
# A^T D g, and each is linear in its tensor, so any order of derivatives works.
def _forward_gradient(ctx, grad_output):
    src, dst = ctx.saved_tensors
    return gather_scatter_backward_op(grad_output, src, dst, ctx.input_rows, ctx.reduce), None, None, None, None


def _backward_gradient(ctx, grad_grad):
    src, dst = ctx.saved_tensors
    return gather_scatter_op(grad_grad, src, dst, ctx.input_rows, ctx.reduce), None, None, None, None


gather_scatter_op = define_op(
    "kernelforge::gather_scatter(Tensor x, Tensor src, Tensor dst, int num_nodes, str reduce) -> Tensor",
    impl=_forward, fake=_fake(_check_forward),
    choose=lambda x, src, dst, num_nodes, reduce: _choose(x),
    setup_context=_save, backward=_forward_gradient, state=torch.are_deterministic_algorithms_enabled)
gather_scatter_backward_op = define_op(
    "kernelforge::gather_scatter_backward(Tensor grad_output, Tensor src, Tensor dst, int num_rows, str reduce) "
    "-> Tensor",
    impl=_backward, fake=_fake(_check_backward),
    choose=lambda grad_output, src, dst, num_rows, reduce: _choose(grad_output),
    setup_context=_save, backward=_backward_gradient, state=torch.are_deterministic_algorithms_enabled)


def gather_scatter(x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, num_nodes: int,
                   reduce: str = "sum") -> torch.Tensor:
    """Message passing's aggregation: out[i] = the sum (reduce="sum") or mean (reduce="mean") of
    x[src[e]] over the edges e with dst[e] == i, (num_nodes, *x.shape[1:]) in x's dtype, 0 where no
    edge arrives (the mean divides by the in-degree clamped to 1). Half types accumulate in
    float32 and round once. x (N, ...) float32 / float16 / bfloat16 / float64; src, dst (E,) int32
    or int64 node ids on x's device, not range-checked on the GPU (an out-of-range id there is
    undefined behaviour; the CPU reference raises). Differentiable in x; works under
    torch.compile. On a GPU it runs a fused Triton kernel whose float32 atomics make the result's
    last bits vary from run to run; with torch.use_deterministic_algorithms(True) the
    deterministic reference (index_select + index_add_) runs instead."""
    _check_count(NAME, "num_nodes", num_nodes)  # before the dispatcher's own, vaguer, type error
    return gather_scatter_op(x, src, dst, num_nodes, reduce)
