"""GraphNeuralNetwork against an independent float64 oracle (dense adjacency and one-hot pooling
matrices on the same weights): both aggregations, every pooling, isolated nodes, self loops,
repeated edges, a batch of graphs of odd sizes in shuffled node order, parameter gradients; the
levels agree (TorchScript stays right on new edge sets and graph assignments of the same shapes);
the kernelforge levels on the CPU; input errors; the GPU suite runs every level at fp32 and bf16."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from kernelforge import backends
from kernelforge.models import (GraphNeuralNetwork, GraphNeuralNetworkConfig, KernelOptimizedGraphNeuralNetwork,
                                LanguageModel, LevelUnavailableError, why_level_unavailable)
from kernelforge.models.levels import KERNELFORGE_KERNELS, TORCH_KERNELS
from kernelforge.triton import interpreter_enabled
from tests.conftest import HAS_CUDA

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def make_graphs(sizes, features, *, device="cpu", dtype=torch.float32):
    """x, edge_index, batch of len(sizes) graphs in a shuffled node order. Each graph of 3 or
    more nodes has a node with no edges at all and one with out-edges only; random edges
    among the rest, two self loops and a repeated edge. A 1-node graph has no edge."""
    edges, batch, start = [], [], 0
    for g, n in enumerate(sizes):
        batch += [g] * n
        if n >= 3:  # node start + n - 1 isolated; node start + n - 2 only sends
            active = torch.arange(start, start + n - 2)
            src = torch.cat([active[torch.randint(len(active), (2 * n,))], torch.tensor([start + n - 2])])
            dst = active[torch.randint(len(active), (2 * n + 1,))]
            loops = active[torch.randint(len(active), (2,))]
            e = torch.cat([torch.stack([src, dst]), torch.stack([loops, loops])], dim=1)
            edges.append(torch.cat([e, e[:, :1]], dim=1))  # one edge twice
        start += n
    edge_index = torch.cat(edges, dim=1) if edges else torch.zeros(2, 0, dtype=torch.int64)
    edge_index = edge_index[:, torch.randperm(edge_index.shape[1])]
    perm = torch.randperm(start)  # node k is renamed perm[k]
    new_batch = torch.empty(start, dtype=torch.int64)
    new_batch[perm] = torch.tensor(batch, dtype=torch.int64)
    x = torch.randn(start, features, dtype=dtype)
    return x.to(device), perm[edge_index].to(device), new_batch.to(device)


def randomized(model):
    """Norm weights of ones and zero biases would hide a swapped weight or bias: draw them all."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if p.dim() == 1 else 0.0))
    return model


def oracle(model, x, edge_index, batch, num_graphs):
    """float64 logits from dense matrices and loops, and the float64 parameters they used (leaves,
    for gradients): A[i, j] counts the edges j -> i; P[g, i] = 1 when node i is in graph g."""
    cfg = model.config
    p = {k: v.detach().double().requires_grad_() for k, v in model.named_parameters()}
    n = x.shape[0]
    adj = torch.zeros(n, n, dtype=torch.float64)
    for s, d in edge_index.t().tolist():
        adj[d, s] += 1
    if cfg.aggregation == "mean":
        adj = adj / adj.sum(1, keepdim=True).clamp(min=1)
    onehot = torch.zeros(num_graphs, n, dtype=torch.float64)
    for i, g in enumerate(batch.tolist()):
        onehot[g, i] = 1
    h = x.detach().double().cpu()
    for i in range(cfg.layers):
        w, b = p[f"layers.{i}.linear.weight"], p[f"layers.{i}.linear.bias"]
        k = w.shape[1] // 2
        y = ACTIVATIONS[cfg.activation](h @ w[:, :k].T + (adj @ h) @ w[:, k:].T + b)
        if y.shape == h.shape:
            y = y + h
        mu, var = y.mean(1, keepdim=True), y.var(1, unbiased=False, keepdim=True)
        h = (y - mu) / torch.sqrt(var + cfg.eps) * p[f"layers.{i}.norm.weight"] + p[f"layers.{i}.norm.bias"]
    if cfg.pooling == "max":
        pooled = torch.stack([h[onehot[g].bool()].amax(0) if onehot[g].any() else h.new_zeros(h.shape[1])
                              for g in range(num_graphs)])
    else:
        pooled = onehot @ h
        if cfg.pooling == "mean":
            pooled = pooled / onehot.sum(1, keepdim=True).clamp(min=1)
    return pooled @ p["head.weight"].T + p["head.bias"], p


def assert_close_to(got, want, what, rtol=1e-5):
    """float32 against the float64 oracle: max error within rtol of the oracle's largest value (at
    least 1), about 2x the float32 error PyTorch's own ops make on these sizes."""
    scale = max(1.0, want.abs().max().item())
    err = (got.detach().double().cpu() - want.detach()).abs().max().item()
    assert err <= rtol * scale, f"{what}: max error {err:.3e} > {rtol * scale:.3e}"


@pytest.mark.parametrize("pooling", ["mean", "sum", "max"])
@pytest.mark.parametrize("aggregation", ["sum", "mean"])
def test_matches_dense_oracle_with_gradients(aggregation, pooling):
    model = randomized(GraphNeuralNetwork(6, hidden=12, num_classes=5, layers=3, aggregation=aggregation,
                                          pooling=pooling, activation="gelu" if pooling == "sum" else "relu"))
    x, edge_index, batch = make_graphs([1, 7, 13], 6)
    indegree = torch.zeros(21).index_add_(0, edge_index[1], torch.ones(edge_index.shape[1]))
    assert (indegree == 0).sum() >= 3 and (edge_index[0] == edge_index[1]).any()  # the cases we mean to cover
    got = model(x, edge_index, batch)
    want, params = oracle(model, x, edge_index, batch, 3)
    assert got.shape == (3, 5) and torch.isfinite(got).all()
    assert_close_to(got, want, "logits")

    weights = torch.randn(3, 5, dtype=torch.float64)
    (got * weights.float()).sum().backward()
    (want * weights).sum().backward()
    for name, param in model.named_parameters():
        assert_close_to(param.grad, params[name].grad, f"grad of {name}", rtol=2e-5)


def test_defaults_alias_one_graph_and_empty_graphs():
    model = KernelOptimizedGraphNeuralNetwork(node_features=64, num_classes=10)
    cfg = model.config
    assert (cfg.hidden, cfg.layers, cfg.aggregation, cfg.pooling) == (128, 3, "sum", "mean")
    x, edge_index, _ = make_graphs([9], 64)
    got = model(x, edge_index)  # batch=None: one graph
    assert_close_to(got, oracle(model, x, edge_index, torch.zeros(9, dtype=torch.int64), 1)[0], "one graph")

    # graphs 1 and 3 have no nodes: they pool to 0 (max pooling too), so their logits are the head's bias
    for pooling in ("mean", "sum", "max"):
        model = randomized(GraphNeuralNetwork(5, hidden=8, num_classes=3, layers=2, pooling=pooling))
        x, edge_index, batch = make_graphs([4, 6], 5)
        batch = batch * 2  # graph ids 0 and 2
        got = model(x, edge_index, batch, num_graphs=4)
        assert got.shape == (4, 3)
        torch.testing.assert_close(got[[1, 3]], model.head.bias.detach().expand(2, 3), rtol=0, atol=0)
        assert_close_to(got, oracle(model, x, edge_index, batch, 4)[0], f"{pooling} with empty graphs")


def test_no_edges_and_mean_of_isolated_nodes_is_zero_not_nan():
    x = torch.randn(5, 4)
    edge_index = torch.zeros(2, 0, dtype=torch.int64)
    for kernels in (TORCH_KERNELS, KERNELFORGE_KERNELS):
        agg = kernels.gather_scatter(x, edge_index[0], edge_index[1], 5, "mean")
        assert torch.equal(agg, torch.zeros(5, 4))
    model = randomized(GraphNeuralNetwork(4, hidden=6, num_classes=2, layers=2, aggregation="mean"))
    assert_close_to(model(x, edge_index), oracle(model, x, edge_index, torch.zeros(5, dtype=torch.int64), 1)[0],
                    "no edges")


def test_gather_scatter_both_kernel_sets():
    x = torch.randn(9, 3, dtype=torch.float64)
    src, dst = torch.tensor([0, 0, 4, 8, 8, 2]), torch.tensor([1, 1, 1, 0, 8, 5])

    def dense_sum(x):
        out = torch.zeros(9, 3, dtype=torch.float64)
        for s, d in zip(src.tolist(), dst.tolist()):
            out[d] += x[s].double()
        return out

    want_sum = dense_sum(x)
    count = torch.tensor([1, 3, 0, 0, 0, 1, 0, 0, 1], dtype=torch.float64).clamp(min=1)
    for kernels in (TORCH_KERNELS, KERNELFORGE_KERNELS):
        torch.testing.assert_close(kernels.gather_scatter(x, src, dst, 9, "sum"), want_sum)
        torch.testing.assert_close(kernels.gather_scatter(x, src, dst, 9, "mean"), want_sum / count[:, None])
        half = kernels.gather_scatter(x.half(), src, dst, 9, "sum")  # accumulates in float32, then rounds
        assert half.dtype == torch.float16
        torch.testing.assert_close(half, dense_sum(x.half()).half())
        with pytest.raises(ValueError, match="reduce must be 'sum' or 'mean', got 'max'"):
            kernels.gather_scatter(x, src, dst, 9, "max")


def test_torchscript_matches_native_and_retraces_rightly():
    model = randomized(GraphNeuralNetwork(5, hidden=8, num_classes=3, layers=2, aggregation="mean", pooling="max"))
    traced = GraphNeuralNetwork(5, hidden=8, num_classes=3, layers=2, aggregation="mean", pooling="max",
                                level="torchscript")
    traced.load_state_dict(model.state_dict())
    x, edge_index, batch = make_graphs([1, 7, 13], 5)
    torch.testing.assert_close(traced(x, edge_index, batch), model(x, edge_index, batch), rtol=1e-6, atol=1e-6)

    # same shapes, other values: other edges, other graph sizes (1, 9, 11), nodes in another order.
    # One trace serves both, and it must read them as inputs, not as constants it recorded.
    x2, edge_index2, batch2 = make_graphs([1, 9, 11], 5)
    assert edge_index2.shape == edge_index.shape and not torch.equal(edge_index2, edge_index)
    got = traced(x2, edge_index2, batch2)
    assert len(traced._wrapped) == 1
    assert_close_to(got, oracle(model, x2, edge_index2, batch2, 3)[0], "torchscript on new values")

    # the same node count in 4 graphs: a new trace, keyed by graph_size's shape
    batch3 = batch2.clone()
    batch3[batch2 == 2] = 3
    batch3[(batch2 == 2).nonzero()[0]] = 2
    got = traced(x2, edge_index2, batch3)
    assert got.shape == (4, 3) and len(traced._wrapped) == 2
    assert_close_to(got, oracle(model, x2, edge_index2, batch3, 4)[0], "torchscript with 4 graphs")


@pytest.mark.slow
@pytest.mark.parametrize("level", ["compile", "fastest"])
def test_compiled_levels_match_native(level):
    """The torch.compile tests (Inductor's first CPU compile costs seconds): one layer, two calls of
    the same shapes and other values, one compiled graph, at the compile and the fastest level."""
    model = randomized(GraphNeuralNetwork(5, hidden=8, num_classes=3, layers=1, aggregation="mean", pooling="sum",
                                          activation="silu"))
    x, edge_index, batch = make_graphs([2, 6], 5)
    want = [model(x, edge_index, batch), model(x.flip(0), edge_index.flip(0), 1 - batch)]
    others = [make_graphs(sizes, 5) for sizes in ([3, 4, 7], [9, 1, 5, 2])]  # batches of other sizes
    want += [model(*graphs) for graphs in others]
    model.set_level(level)
    torch._dynamo.reset()
    counters.clear()
    torch.testing.assert_close(model(x, edge_index, batch), want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(x.flip(0), edge_index.flip(0), 1 - batch), want[1], rtol=1e-5, atol=1e-5)
    for graphs, expected in zip(others, want[2:]):
        torch.testing.assert_close(model(*graphs), expected, rtol=1e-5, atol=1e-5)
    # the first new shape compiles again with dynamic shapes, the next reuses that graph
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def test_the_fastest_level_compiles_the_gnn_without_cuda_graphs_or_static_shapes():
    # batches change shape: a CUDA graph (and a static-shape compile) per batch would be rebuilt for each
    gnn = GraphNeuralNetwork(5, hidden=8, num_classes=3, layers=1)
    lm = LanguageModel(vocab_size=32, dim=16, n_layers=1, n_heads=2, max_seq_len=8)
    for device in ("cpu", "cuda"):
        assert gnn.whole_graph_options(torch.device(device)) == {"fullgraph": True}
    assert lm.whole_graph_options(torch.device("cuda")) == {"fullgraph": True, "dynamic": False,
                                                            "mode": "reduce-overhead"}
    assert lm.whole_graph_options(torch.device("cpu")) == {"fullgraph": True, "dynamic": False}


def test_triton_level_on_cpu_through_the_interpreter():
    if not interpreter_enabled():
        pytest.fail("the CPU suite runs Triton through its interpreter: set TRITON_INTERPRET=1")
    model = randomized(GraphNeuralNetwork(4, hidden=8, num_classes=3, layers=2, aggregation="sum", pooling="mean"))
    native = copy.deepcopy(model)
    x, edge_index, batch = make_graphs([3, 5], 4)
    weights = torch.randn(2, 3)
    want = native(x, edge_index, batch)
    (want * weights).sum().backward()
    model.set_level("triton")
    with backends.recording() as ran, model.kernel_scope():  # the backward's ops on Triton too
        got = model(x, edge_index, batch)
        (got * weights).sum().backward()
    assert {"gemm", "norms", "gather_scatter"} <= {op for op, _ in ran} and {b for _, b in ran} == {"triton"}, ran
    assert_close_to(got, oracle(model, x, edge_index, batch, 2)[0], "triton level")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), native.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("level", ["triton", "cuda"])
def test_kernelforge_levels_refuse_cpu_tensors_without_the_interpreter(level, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, edge_index, batch = make_graphs([3, 4], 4)
    hint = "TRITON_INTERPRET=1" if level == "triton" else "need a CUDA GPU and CUDA tensors"
    with pytest.raises(LevelUnavailableError, match=hint):
        # without a GPU the constructor refuses; with one, the call on CPU tensors does
        GraphNeuralNetwork(4, hidden=8, num_classes=3, layers=1, level=level)(x, edge_index, batch)


def test_check_indices_off_still_computes_and_counts_graphs():
    model = GraphNeuralNetwork(4, hidden=8, num_classes=3, layers=2, check_indices=False)
    x, edge_index, batch = make_graphs([3, 6, 2], 4)
    assert_close_to(model(x, edge_index, batch), oracle(model, x, edge_index, batch, 3)[0], "unchecked")
    bad = edge_index.clone()
    bad[0, 0] = 11
    with pytest.raises((IndexError, RuntimeError), match="index"):  # index_select's own error
        model(x, bad, batch)


def test_bad_config():
    for kwargs, match in [
        (dict(node_features=0), "node_features must be a positive int, got 0"),
        (dict(node_features=4, hidden=2.5), "hidden must be a positive int, got 2.5"),
        (dict(node_features=4, layers=True), "layers must be a positive int, got True"),
        (dict(node_features=4, aggregation="max"), r"aggregation must be one of \('sum', 'mean'\), got 'max'"),
        (dict(node_features=4, pooling="min"), r"pooling must be one of \('mean', 'sum', 'max'\), got 'min'"),
        (dict(node_features=4, activation="tanh"), "activation must be one of"),
        (dict(node_features=4, eps=0.0), "eps must be positive"),
    ]:
        with pytest.raises(ValueError, match=match):
            GraphNeuralNetwork(**kwargs)
        with pytest.raises(ValueError, match=match):
            GraphNeuralNetworkConfig(**kwargs)
    with pytest.raises(ValueError, match="level must be one of"):
        GraphNeuralNetwork(4, level="jit")


def test_bad_inputs():
    model = GraphNeuralNetwork(4, hidden=8, num_classes=3, layers=1)
    x, edge_index, batch = make_graphs([3, 5], 4)
    too_high, negative = edge_index.clone(), edge_index.clone()
    too_high[1, 3], negative[0, 5] = 8, -1
    cases = [
        ((x[:, :3], edge_index, batch), {}, r"x must be \(num_nodes, node_features=4\), got shape \(8, 3\)"),
        ((x[0], edge_index, batch), {}, r"x must be \(num_nodes, node_features=4\), got shape \(4,\)"),
        ((x.double(), edge_index, batch), {}, "x must be torch.float32 on cpu .* got torch.float64 on cpu"),
        ((x, edge_index.t(), batch), {}, r"edge_index must be \(2, num_edges\) int64 .* got shape \(\d+, 2\)"),
        ((x, edge_index.int(), batch), {}, "edge_index must be .* int64 .* of torch.int32"),
        ((x, edge_index[0], batch), {}, r"edge_index must be \(2, num_edges\).* got shape \(\d+,\)"),
        ((x, edge_index, batch[:-1]), {}, r"batch must be \(num_nodes,\) = \(8,\) int64 .* got shape \(7,\)"),
        ((x, edge_index, batch.float()), {}, "batch must be .* of torch.float32"),
        ((x, too_high, batch), {}, r"edge_index must hold node ids in \[0, 8\) for x's 8 nodes, got ids from "
                                   "[0-7] to 8"),
        ((x, negative, batch), {}, r"edge_index must hold node ids in \[0, 8\).* from -1 to [0-7]$"),
        ((x, edge_index, batch), dict(num_graphs=1), r"batch must hold graph ids in \[0, num_graphs=1\), got ids "
                                                     "from 0 to 1"),
        ((x, edge_index, batch - 1), {}, "batch must hold graph ids in .* from -1 to 0"),
        ((x, edge_index, batch), dict(num_graphs=2.0), "num_graphs must be a non-negative int or None, got 2.0"),
        ((x, edge_index), dict(num_graphs=0), "num_graphs is 0 but x has 8 nodes"),
    ]
    for args, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            model(*args, **kwargs)
            pytest.fail(f"no error for {match!r}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("level", ["torchscript", "compile", "triton", "cuda", "fastest"])
def test_levels_on_gpu_match_the_oracle_as_native_does(level, dtype):
    """Each level's error against the float64 oracle is at most twice native's in the same dtype,
    plus a floor (the rule of tests/models/test_transformer_models.py)."""
    why = why_level_unavailable(level, torch.device("cuda"))
    if why is not None:
        pytest.skip(why)
    torch.manual_seed(1)  # bf16 errors vary by draw; one draw keeps the 2x rule meaningful
    model = randomized(GraphNeuralNetwork(24, hidden=64, num_classes=10, layers=3, aggregation="mean"))
    x, edge_index, batch = make_graphs([1, 7, 13, 300, 41], 24)
    want = oracle(model, x, edge_index, batch, 5)[0].detach()
    x, edge_index, batch = x.to("cuda", dtype), edge_index.cuda(), batch.cuda()
    native = copy.deepcopy(model).to("cuda", dtype)
    native_err = (native(x, edge_index, batch).double().cpu() - want).abs().max().item()
    model = model.to("cuda", dtype).set_level(level)
    floor = (1e-5 if dtype == torch.float32 else 1e-2) * want.abs().max().item()
    for _ in range(2):  # the second call reuses the trace / compiled graph
        got = model(x, edge_index, batch)
        err = (got.double().cpu() - want).abs().max().item()
        assert got.dtype == dtype and got.shape == (5, 10)
        assert err <= 2 * native_err + floor, f"{level} {dtype}: error {err:.3g}, native's {native_err:.3g}"
