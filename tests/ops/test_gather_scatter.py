"""gather_scatter: every backend against a float64 oracle (forward and x's gradient) on odd
sizes, trailing dims, int32 / int64 ids, duplicate edges, self loops, nodes no edge reaches,
more or fewer output nodes than x has rows, strided inputs and empty cases; the registered ops
(opcheck, gradcheck), torch.compile, the deterministic-mode fallback, bad input, and a build of
the Triton kernels for sm_90a. The GPU suite adds the current stream, a second device, and ids
past 2^31 elements."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernelforge as kf
from kernelforge import backends
from kernelforge.models.levels import TORCH_KERNELS
from kernelforge.ops.gather_scatter import gather_scatter_op
from kernelforge.reference import gather_scatter as reference
from tests.conftest import backend_cases, device_cases, needs_cuda
from tests.numerics import assert_matches_oracle, same_layout
from tests.op_paths import assert_eager_path_equals_registered_op, assert_inductor_launches, compiled_code

BACKENDS = ("reference", "triton")
REDUCES = ("sum", "mean")
GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def dtypes_for(backend, device):
    if device == "cpu" and backend == "triton":
        # Triton's interpreter truncates float32 -> bfloat16 stores instead of rounding to
        # nearest (see test_softmax.py): bf16 Triton runs in the GPU suite, compiled.
        return [torch.float32, torch.float16]
    return GPU_DTYPES + ([torch.float64] if backend == "reference" else [])


def make_edges(n_rows, num_nodes, n_edges, device, index_dtype=torch.int64):
    """(src, dst) of n_edges edges (more when self loops and duplicates are added): src in
    [0, n_rows), dst in [0, num_nodes); about a fifth of the nodes get no in-edge, a hub node
    takes a sixth of the edges (a long sum), some edges are self loops and some repeat (a
    repeated edge is a repeated message), in shuffled order."""
    if n_edges == 0:
        empty = torch.zeros(0, dtype=index_dtype, device=device)
        return empty, empty.clone()
    reached = torch.nonzero(torch.rand(num_nodes) >= 0.2).flatten()
    if reached.numel() == 0:
        reached = torch.tensor([num_nodes - 1])
    src = torch.randint(0, n_rows, (n_edges,))
    dst = reached[torch.randint(0, reached.numel(), (n_edges,))]
    dst[: n_edges // 6] = reached[0]
    loops = reached[reached < n_rows][:3]
    src, dst = torch.cat([src, loops, src[:4]]), torch.cat([dst, loops, dst[:4]])
    order = torch.randperm(src.numel())
    return src[order].to(device, index_dtype), dst[order].to(device, index_dtype)


def degrees(idx, n):
    return torch.bincount(idx.long().cpu(), minlength=n)


def oracle(x64, src, dst, num_nodes, reduce):
    """float64, differentiable: index_add of the gathered rows, the mean from bincount's degrees
    (counted apart from the implementations' index_add of ones / atomics)."""
    out = torch.zeros((num_nodes,) + tuple(x64.shape[1:]), dtype=torch.float64, device=x64.device)
    out = out.index_add(0, dst, x64.index_select(0, src))
    if reduce == "mean":
        deg = degrees(dst, num_nodes).clamp(min=1).to(x64.device, torch.float64)
        out = out / deg.view((num_nodes,) + (1,) * (x64.dim() - 1))
    return out


def torch_same_dtype(x, src, dst, num_nodes, reduce):
    """What a user writes in torch at x's dtype (index_add_ sums in that dtype): the error baseline."""
    out = x.new_zeros((num_nodes,) + tuple(x.shape[1:])).index_add(0, dst, x.index_select(0, src))
    if reduce == "mean":
        deg = degrees(dst, num_nodes).clamp(min=1).to(x.device, x.dtype)
        out = out / deg.view((num_nodes,) + (1,) * (x.dim() - 1))
    return out


def check(x, src, dst, num_nodes, reduce, backend, what=""):
    """Forward and x's gradient against the float64 oracle (tests/numerics.py's 2x rule); returns
    kernelforge's output."""
    what = f"{what} {tuple(x.shape)} -> {num_nodes} nodes, E={src.numel()} {x.dtype} {reduce} {backend}"
    g = torch.randn((num_nodes,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    ours, theirs = same_layout(x).requires_grad_(), same_layout(x).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    with kf.use_backend(backend):
        y = kf.gather_scatter(ours, src, dst, num_nodes, reduce)
        y.backward(g)
    y_torch = torch_same_dtype(theirs, src, dst, num_nodes, reduce)
    y_torch.backward(g)
    y64 = oracle(x64, src, dst, num_nodes, reduce)
    y64.backward(g.double())
    assert y.shape == y64.shape and y.dtype == x.dtype and y.device == x.device and y.is_contiguous()
    max_in = int(degrees(dst, num_nodes).max()) if src.numel() else 1
    max_out = int(degrees(src, x.shape[0]).max()) if src.numel() else 1
    # the Triton kernel's float32 atomics sum in a run-dependent order (tests/numerics.py), and so does
    # torch's index_add_ on a GPU (atomics too), which the reference backend runs there
    unordered = backend == "triton" or x.device.type == "cuda"
    assert_matches_oracle(y.detach(), y_torch.detach(), y64.detach(), what, reduced=max_in, unordered=unordered)
    assert_matches_oracle(ours.grad, theirs.grad, x64.grad, f"grad {what}", reduced=max_out, unordered=unordered)
    return y.detach()


# (rows of x, num_nodes, edges, x's trailing shape)
CASES = [
    (1, 1, 1, (1,)),
    (7, 7, 7, (3,)),
    (7, 9, 20, ()),  # 1-D x: one feature a node
    (199, 199, 1000, (129,)),
    (1000, 1000, 1200, (1,)),
    (199, 150, 1000, (300,)),  # fewer nodes than x's rows: gather from a larger x
    (7, 40, 60, (2, 5)),  # more nodes than x's rows; trailing dims
    (1000, 7, 1100, (3,)),  # many rows into a few nodes: long sums
]


@pytest.mark.parametrize("backend,device", backend_cases(BACKENDS))
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("n,num_nodes,n_edges,trailing", CASES, ids=[str(c) for c in CASES])
def test_forward_and_backward_match_oracle(backend, device, reduce, index_dtype, n, num_nodes, n_edges, trailing):
    src, dst = make_edges(n, num_nodes, n_edges, device, index_dtype)
    unreached = degrees(dst, num_nodes) == 0
    for dtype in dtypes_for(backend, device):
        x = torch.randn((n,) + trailing, device=device, dtype=dtype)
        y = check(x, src, dst, num_nodes, reduce, backend)
        # a node no edge reaches gets exactly 0 (the mean too: no 0 / 0)
        assert torch.equal(y[unreached.to(device)], torch.zeros_like(y[unreached.to(device)]))


@pytest.mark.parametrize("backend,device", backend_cases(BACKENDS))
def test_mixed_index_dtypes_and_strided_inputs(backend, device):
    # x with a row stride (a column slice), x whose features are not contiguous (a transpose:
    # the op copies), ids as rows of an (E, 2) tensor (stride 2), int32 src with int64 dst
    n, num_nodes, n_edges = 50, 30, 200
    src, dst = make_edges(n, num_nodes, n_edges, device)
    pairs = torch.stack([src, dst], dim=1)  # (E, 2): pairs[:, 0] has stride 2
    base = torch.randn(n, 80, device=device)
    for x in (base[:, 3:70], torch.randn(9, n, device=device).t(), torch.randn(n, 4, 6, device=device)[:, ::2]):
        for reduce in REDUCES:
            check(x, pairs[:, 0], pairs[:, 1], num_nodes, reduce, backend, "strided ids")
            check(x, src.int(), dst, num_nodes, reduce, backend, "int32 src, int64 dst")


@pytest.mark.parametrize("backend,device", backend_cases(BACKENDS))
@pytest.mark.parametrize("reduce", REDUCES)
def test_expanded_gradient(backend, device, reduce):
    # y.sum().backward() hands the backward an expanded (stride 0) gradient of ones
    x = torch.randn(20, 6, device=device, requires_grad=True)
    src, dst = make_edges(20, 11, 90, device)
    with kf.use_backend(backend):
        kf.gather_scatter(x, src, dst, 11, reduce).sum().backward()
    per_node = 1.0 / degrees(dst, 11).clamp(min=1).double() if reduce == "mean" else torch.ones(11, dtype=torch.float64)
    want = torch.zeros(20, dtype=torch.float64).index_add_(0, src.cpu(), per_node[dst.cpu()])
    torch.testing.assert_close(x.grad.cpu().double(), want[:, None].expand(20, 6), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend,device", backend_cases(BACKENDS))
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("n,num_nodes,n_edges,trailing", [
    (6, 4, 0, (3,)),  # no edges: zeros
    (0, 5, 0, (3,)),  # no rows in x
    (6, 0, 0, (3,)),  # no output nodes
    (6, 4, 9, (0,)),  # no features
    (6, 4, 9, (2, 0)),  # no features, trailing dims
    (0, 0, 0, (0,)),
], ids=["E=0", "N=0", "nodes=0", "F=0", "F=2x0", "all-empty"])
def test_empty(backend, device, reduce, n, num_nodes, n_edges, trailing):
    x = torch.randn((n,) + trailing, device=device, requires_grad=True)
    src, dst = make_edges(max(n, 1), max(num_nodes, 1), n_edges, device)
    with kf.use_backend(backend):
        y = kf.gather_scatter(x, src, dst, num_nodes, reduce)
        y.backward(torch.randn_like(y))
    assert y.shape == (num_nodes,) + trailing and y.dtype == x.dtype
    assert torch.equal(y, torch.zeros_like(y)) and torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("backend,device", backend_cases(("triton",)))
@pytest.mark.parametrize("reduce", REDUCES)
def test_triton_feature_loop_and_small_tiles(monkeypatch, backend, device, reduce):
    # A grid capped below the feature blocks (CUDA caps the second grid dimension at 65535) makes
    # each program walk several feature blocks, and the in-degree must still be counted once per
    # edge; small tiles give many edge blocks on a small case.
    from kernelforge.triton import gather_scatter as tgs

    monkeypatch.setattr(tgs, "MAX_GRID_Y", 2)
    n, num_nodes, n_edges = 40, 25, 150
    src, dst = make_edges(n, num_nodes, n_edges, device)
    x, g = torch.randn(n, 300, device=device), torch.randn(num_nodes, 300, device=device)
    x64 = x.double().requires_grad_()
    want = oracle(x64, src, dst, num_nodes, reduce)
    want_grad = torch.autograd.grad(want, x64, g.double())[0]
    for config in (None, tgs.Config(block_e=8, block_f=16, num_warps=1)):
        got = tgs.gather_scatter_rows(x, src, dst, num_nodes, reduce == "mean", config=config)
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)
        got_grad = tgs.gather_scatter_backward_rows(g, src, dst, n, reduce == "mean", config=config)
        torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-5, atol=1e-5)


# Run by a fresh Python without TRITON_INTERPRET (tests.conftest sets it): the interpreter runs the
# kernels without compiling them, so this is where a CPU run learns that they build for the GPU.
BUILD_SCRIPT = """
import json, torch
from kernelforge.triton import gather_scatter
builds = [(torch.bfloat16, torch.int64, 128), (torch.float32, torch.int32, 256), (torch.float16, torch.int64, 3)]
print(json.dumps({f"{d} {i} F={f}": gather_scatter.compile_for_sm90(d, i, f) for d, i, f in builds}))
"""
# Two programs of 8 warps an SM at least (65536 registers / (2 x 256 threads)); the 32-elements-a-
# thread tile this replaced took 215-238.
MAX_REGISTERS = 128


def test_kernels_build_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", BUILD_SCRIPT], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-4000:]
    builds = json.loads(run.stdout.splitlines()[-1])
    assert len(builds) == 3
    for build, usage in builds.items():
        assert set(usage) == {"gather_scatter sum", "gather_scatter mean forward", "gather_scatter mean backward",
                              "finish mean", "in-degree"}, build
        for variant, use in usage.items():
            assert use["spills"] == 0 and 0 < use["registers"] <= MAX_REGISTERS, (build, variant, use)


def test_reference_is_the_definition():
    # The reference spells the sum out with index ops; it must equal a plain loop over the edges,
    # and TorchKernels (the native / torchscript / compile levels) must run exactly it.
    x = torch.randn(9, 2, 3, dtype=torch.float64)
    src, dst = torch.tensor([0, 0, 4, 8, 8, 2, 3]), torch.tensor([1, 1, 1, 0, 8, 5, 1])
    want = torch.zeros(10, 2, 3, dtype=torch.float64)
    count = [0] * 10
    for s, d in zip(src.tolist(), dst.tolist()):
        want[d] += x[s]
        count[d] += 1
    torch.testing.assert_close(reference.gather_scatter(x, src, dst, 10), want, rtol=1e-15, atol=1e-15)
    mean = want / torch.tensor([max(c, 1) for c in count], dtype=torch.float64)[:, None, None]
    torch.testing.assert_close(reference.gather_scatter(x, src, dst, 10, "mean"), mean, rtol=1e-15, atol=1e-15)
    for reduce in REDUCES:
        for dtype in (torch.float64, torch.bfloat16):
            assert torch.equal(TORCH_KERNELS.gather_scatter(x.to(dtype), src, dst, 10, reduce),
                               reference.gather_scatter(x.to(dtype), src, dst, 10, reduce))


def op_samples(device):
    for reduce in REDUCES:
        src, dst = make_edges(8, 6, 20, device)
        yield torch.randn(8, 5, device=device), src, dst, 6, reduce
        src, dst = make_edges(8, 11, 15, device, torch.int32)
        yield torch.randn(8, 2, 3, device=device, requires_grad=True), src, dst, 11, reduce


@pytest.mark.parametrize("backend,device", backend_cases(BACKENDS))
def test_opcheck(backend, device):
    fwd, bwd = torch.ops.kernelforge.gather_scatter.default, torch.ops.kernelforge.gather_scatter_backward.default
    with kf.use_backend(backend):
        for x, src, dst, num_nodes, reduce in op_samples(device):
            torch.library.opcheck(fwd, (x, src, dst, num_nodes, reduce))
            g = torch.randn((num_nodes,) + tuple(x.shape[1:]), device=device)
            torch.library.opcheck(bwd, (g, src, dst, x.shape[0], reduce))
            torch.library.opcheck(bwd, (g.requires_grad_(), src, dst, x.shape[0], reduce))


@pytest.mark.parametrize("reduce", REDUCES)
def test_gradcheck_float64(reduce):
    # through the registered ops too (a FunctionMode-free double backward: the backward's own
    # gradient is the forward op)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    src, dst = make_edges(6, 5, 14, "cpu")
    for fn in (lambda t: kf.gather_scatter(t, src, dst, 5, reduce),
               lambda t: torch.ops.kernelforge.gather_scatter(t, src, dst, 5, reduce)):
        assert torch.autograd.gradcheck(fn, (x,))
        assert torch.autograd.gradgradcheck(fn, (x,))


@pytest.mark.slow
@pytest.mark.parametrize("device", device_cases())
def test_torch_compile_fullgraph(device):
    # A GNN layer's aggregation between two dense ops; the CPU runs the reference backend (the
    # default there), the GPU suite the Triton kernel.
    def layer(x, w, src, dst):
        h = kf.gather_scatter(x @ w, src, dst, 7, "mean")
        return (kf.gather_scatter(h.relu(), dst, src, 9) * 2.0).sum()

    x = torch.randn(9, 4, device=device, requires_grad=True)
    w = torch.randn(4, 5, device=device, requires_grad=True)
    src, dst = make_edges(9, 7, 30, device)
    _, code = compiled_code(layer, x, w, src, dst, dynamic=False, backward=True)
    assert "torch.ops.kernelforge" not in code  # traced into the reference's torch ops / the Triton kernels
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    expected = layer(x, w, src, dst)
    gx, gw = torch.autograd.grad(expected, (x, w))
    got = compiled(x, w, src, dst)
    cgx, cgw = torch.autograd.grad(got, (x, w))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(cgx, gx)
    torch.testing.assert_close(cgw, gw)


@pytest.mark.parametrize("backend,device", backend_cases(("triton",)))
def test_deterministic_mode_refuses_triton(backend, device):
    # float32 atomics sum in a run-dependent order: with deterministic algorithms on, a forced
    # Triton backend raises, a preference for it (the triton level; on a GPU also the default
    # choice) falls back to the reference, forward and backward, and the results repeat bitwise.
    x = torch.randn(30, 8, device=device, requires_grad=True)
    src, dst = make_edges(30, 12, 100, device)
    with backends.prefer_backend("triton"), backends.recording() as before:
        kf.gather_scatter(x, src, dst, 12, "mean").sum().backward()  # the choice is cached under its key
    assert before[("gather_scatter", "triton")] == 2 and before[("gather_scatter", "reference")] == 0
    was_on = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with kf.use_backend("triton"), pytest.raises(kf.BackendUnsupportedError, match="deterministic"):
            kf.gather_scatter(x, src, dst, 12)
        assert "deterministic" in kf.explain("gather_scatter", x)
        outputs = []
        for _ in range(2):
            x.grad = None
            with backends.prefer_backend("triton"), backends.recording() as used:
                y = kf.gather_scatter(x, src, dst, 12, "mean")
                y.backward(torch.ones_like(y))
            assert used[("gather_scatter", "reference")] == 2 and used[("gather_scatter", "triton")] == 0
            outputs.append((y.detach(), x.grad.clone()))
            if device == "cuda":
                assert kf.backends.select("gather_scatter", x).backend == "reference"
        assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=warn_only)
    if device == "cuda":  # and back: the default choice on a GPU is the Triton kernel again
        assert kf.backends.select("gather_scatter", x).backend == "triton"


def test_eager_fast_path_equals_registered_op():
    # In plain eager mode kf.gather_scatter skips the dispatcher (with its own autograd glue when
    # a gradient is needed); under a mode, a transform or torch.compile it goes through torch.ops.
    # Both must give the same values and gradients.
    x = torch.randn(12, 5, 2)
    src, dst = make_edges(12, 8, 40, "cpu")
    op = torch.ops.kernelforge.gather_scatter
    assert gather_scatter_op._plain_eager((x, src, dst, 8, "mean"))
    fast = assert_eager_path_equals_registered_op(lambda t: kf.gather_scatter(t, src, dst, 8, "mean"),
                                                  gather_scatter_op, lambda t: op(t, src, dst, 8, "mean"), x)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = kf.gather_scatter(mode.from_tensor(x), mode.from_tensor(src), mode.from_tensor(dst), 8)
        assert fake.shape == (8, 5, 2) and fake.stride() == fast.stride()


# ----------------------------------------------------------------------------- bad input
def _ids(*values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize("path", ["public", "op", "fake"])
def test_bad_input_is_rejected(path):
    def call(x, src, dst, num_nodes=4, reduce="sum"):
        if path == "public":
            return kf.gather_scatter(x, src, dst, num_nodes, reduce)
        if path == "fake":  # the fake implementation runs the same checks (torch.compile relies on it)
            x, src, dst = x.to("meta"), src.to("meta"), dst.to("meta")
        return torch.ops.kernelforge.gather_scatter(x, src, dst, num_nodes, reduce)

    x, src, dst = torch.randn(5, 3), _ids(0, 4, 2), _ids(1, 3, 3)
    with pytest.raises(TypeError, match=r"kernelforge\.gather_scatter: x must have dtype in .* got torch\.int64"):
        call(torch.arange(6).reshape(3, 2), src, dst)
    with pytest.raises(ValueError, match=r"x must have at least 1 dim \(one row per node\), got a 0-dim tensor"):
        call(torch.tensor(1.0), src, dst)
    with pytest.raises(TypeError, match=r"src must have dtype in \(int32, int64\), got torch\.float32"):
        call(x, src.float(), dst)
    with pytest.raises(TypeError, match=r"dst must have dtype in \(int32, int64\), got torch\.int16"):
        call(x, src, dst.to(torch.int16))
    with pytest.raises(ValueError, match=r"dst must be 1-D \(one node id per edge\), got shape \(3, 1\)"):
        call(x, src, dst[:, None])
    with pytest.raises(RuntimeError, match=r"expected src, dst to have the same length \(one entry per edge\), "
                                           r"got src: 3, dst: 2"):
        call(x, src, dst[:2])
    with pytest.raises(RuntimeError, match="num_nodes must be non-negative, got -1"):
        call(x, src, dst, num_nodes=-1)
    with pytest.raises(ValueError, match="reduce must be 'sum' or 'mean', got 'max'"):
        call(x, src, dst, reduce="max")
    if path != "fake":
        with pytest.raises(RuntimeError, match=r"same device, got x: meta, src: cpu, dst: cpu"):
            call(x.to("meta"), src, dst)


def test_num_nodes_must_be_an_int():
    x, src, dst = torch.randn(5, 3), _ids(0, 4), _ids(1, 3)
    for bad, name in ((4.0, "float"), (True, "bool"), (torch.tensor(4), "Tensor")):
        with pytest.raises(TypeError, match=f"kernelforge.gather_scatter: num_nodes must be an int, got {name}"):
            kf.gather_scatter(x, src, dst, bad)


def test_backward_op_rejects_bad_input():
    bwd = torch.ops.kernelforge.gather_scatter_backward
    g, src, dst = torch.randn(4, 3), _ids(0, 4), _ids(1, 3)
    with pytest.raises(TypeError, match=r"gather_scatter_backward: grad_output must have dtype in .* got torch\.int64"):
        bwd(g.long(), src, dst, 5, "sum")
    with pytest.raises(RuntimeError, match="gather_scatter_backward: num_rows must be non-negative, got -2"):
        bwd(g, src, dst, -2, "mean")
    with pytest.raises(RuntimeError, match=r"same device, got grad_output: meta, src: cpu, dst: cpu"):
        bwd(g.to("meta"), src, dst, 5, "sum")


@pytest.mark.parametrize("reduce", REDUCES)
def test_out_of_range_ids_on_the_cpu_are_named(reduce):
    # CPU tensors: every id checked, the argument, the id and the range named (num_nodes=0 too,
    # where torch's index_add_ into zero rows accepts any id); a GPU kernel does not check (an
    # out-of-range id there is undefined, as in torch's CUDA index_add_)
    x = torch.randn(5, 3)
    cases = (((0, 5), (1, 2), 4, r"src holds node id 5, outside \[0, 5\) \(x's rows\)"),
             ((0, 1), (1, 4), 4, r"dst holds node id 4, outside \[0, 4\) \(num_nodes\)"),
             ((-1, 1), (1, 2), 4, r"src holds node id -1, outside \[0, 5\)"),
             ((0, 1), (1, 7), 0, r"dst holds node id 7, outside \[0, 0\) \(num_nodes\)"))
    for src, dst, num_nodes, message in cases:
        for backend in ("reference", "triton"):
            with kf.use_backend(backend), pytest.raises(IndexError, match=message):
                kf.gather_scatter(x, _ids(*src), _ids(*dst), num_nodes, reduce)
    assert kf.gather_scatter(x, _ids(0, 0)[:0], _ids(0, 0)[:0], 0, reduce).shape == (0, 3)


# ----------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_runs_on_the_current_stream(backend):
    # On a side stream: a long sleep, then the write of x, then the op. A kernel (or a zero fill
    # of the accumulator) on any other stream would run before x is written, or race the sleep.
    source = torch.randn(5000, 64, device="cuda")
    src, dst = make_edges(5000, 3000, 40000, "cuda")
    g = torch.randn(3000, 64, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), kf.use_backend(backend):
        torch.cuda._sleep(100_000_000)
        x = (source * 2).requires_grad_()
        y = kf.gather_scatter(x, src, dst, 3000, "mean")
        (dx,) = torch.autograd.grad(y, x, g)
    side.synchronize()
    x64 = (source * 2).double().requires_grad_()
    want = oracle(x64, src, dst, 3000, "mean")
    (want_dx,) = torch.autograd.grad(want, x64, g.double())
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.double(), want_dx, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_zero_device_index(backend):
    assert torch.cuda.current_device() == 0
    x = torch.randn(300, 40, device="cuda:1", requires_grad=True)
    src, dst = make_edges(300, 200, 2000, "cuda:1", torch.int32)
    with kf.use_backend(backend):
        y = kf.gather_scatter(x, src, dst, 200)
        y.backward(torch.ones_like(y))
    assert y.device == x.device and x.grad.device == x.device
    torch.testing.assert_close(y, reference.gather_scatter(x.detach(), src, dst, 200), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, degrees(src, 300).to(x.device, torch.float32)[:, None].expand(300, 40))


@pytest.mark.gpu
@pytest.mark.slow
@needs_cuda
def test_int32_ids_past_two_to_the_31_elements():
    # x's last rows start past element 2^31 (4 GiB of bf16): int32 ids must be widened before
    # they scale the row stride, in the forward's gather and the backward's scatter (whose float32
    # accumulator is 8 GiB).
    rows, n_cols = 2**31 // 128 + 64, 128
    x = torch.randn(rows, n_cols, device="cuda", dtype=torch.bfloat16)
    src = torch.tensor([rows - 1, rows - 2, 5, rows - 1, rows - 40], device="cuda", dtype=torch.int32)
    dst = torch.tensor([0, 1, 1, 2, 2], device="cuda", dtype=torch.int32)
    with kf.use_backend("triton"):
        y = kf.gather_scatter(x, src, dst, 3)
        grad = torch.ops.kernelforge.gather_scatter_backward(torch.ones(3, n_cols, device="cuda",
                                                                        dtype=torch.bfloat16), src, dst, rows, "sum")
    torch.testing.assert_close(y, reference.gather_scatter(x, src.long(), dst.long(), 3))
    touched = torch.unique(src.long())
    assert torch.equal(grad[touched].float(), degrees(src, rows)[touched.cpu()].to("cuda", torch.float32)[:, None]
                       .expand(-1, n_cols))
    assert grad.sum(dtype=torch.float32).item() == src.numel() * n_cols  # nothing written elsewhere


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("reduce", REDUCES)
def test_inductor_launches_the_triton_kernels(reduce):
    # Under torch.compile Inductor launches the Triton kernels itself, forward and backward (lowered with
    # the forward here). Positive x: no sum cancels, so the atomics' rounding stays within bf16's tolerance.
    x = torch.rand(3000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    src, dst = make_edges(3000, 2000, 20000, "cuda")

    def layer(x):
        return kf.gather_scatter(x, src, dst, 2000, reduce).float().square().sum()

    kernels = ["_gather_scatter_kernel", "_finish_kernel"] + (["_in_degree_kernel"] if reduce == "mean" else [])
    got = assert_inductor_launches(layer, (x,), kernels, backward=True)
    expected = layer(x)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=0)
    torch.testing.assert_close(torch.autograd.grad(got, x)[0], torch.autograd.grad(expected, x)[0])
