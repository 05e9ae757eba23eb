"""A message-passing graph neural network (GraphSAGE-like) with graph pooling, at the five levels.

    model = GraphNeuralNetwork(node_features=64, hidden=128, num_classes=10, layers=3)
    logits = model(x, edge_index, batch)     # x (N, 64), edge_index (2, E), batch (N,) -> (graphs, 10)

Each layer lets every node i take the messages of the edges j -> i and computes

    h_i' = norm(h_i + act(W_self h_i + W_neigh AGG_{j -> i} h_j + b))

with AGG the sum or the mean over the incoming edges (a node no edge reaches aggregates 0),
the residual where the widths match (not in the first layer unless node_features == hidden).
W_self and W_neigh are one weight over [h | AGG h], so each layer is one GEMM with the bias and
the activation fused on the kernelforge levels, and the residual add is fused into the layer
norm. Graph pooling (mean, sum or max over each graph's nodes) and a linear head give one row of
logits per graph. The aggregation goes through the kernel set's gather_scatter: torch's
index_select + index_add_ at the native, torchscript and compile levels, kernelforge.gather_scatter
on the kernelforge levels (one fused Triton kernel on a GPU, with float32 atomics: its sums' last
bits vary from run to run unless torch.use_deterministic_algorithms is on, which runs the
reference instead); pooling is index_add / scatter_reduce at every level.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kernelforge.models.levels import Component, LevelledModel
from kernelforge.models.transformer import Linear, Norm

AGGREGATIONS = ("sum", "mean")
POOLINGS = ("mean", "sum", "max")
ACTIVATIONS = ("relu", "gelu", "silu")


@dataclass
class GraphNeuralNetworkConfig:
    node_features: int
    hidden: int = 128
    num_classes: int = 10
    layers: int = 3
    aggregation: str = "sum"  # of the messages into a node: "sum" | "mean" (over its in-edges)
    pooling: str = "mean"  # of a graph's nodes: "mean" | "sum" | "max" (an empty graph pools to 0)
    activation: str = "relu"  # fused into each layer's GEMM on the kernelforge levels
    eps: float = 1e-5
    check_indices: bool = True  # forward checks index ranges on the host (one sync per call)

    def __post_init__(self):
        for name in ("node_features", "hidden", "num_classes", "layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GraphNeuralNetwork: {name} must be a positive int, got {value!r}")
        for name, allowed in (("aggregation", AGGREGATIONS), ("pooling", POOLINGS), ("activation", ACTIVATIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"GraphNeuralNetwork: {name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not self.eps > 0:
            raise ValueError(f"GraphNeuralNetwork: eps must be positive, got {self.eps!r}")


class GraphLayer(Component):
    """One message-passing layer: (N, in_dim) -> (N, out_dim)."""

    def __init__(self, in_dim: int, out_dim: int, cfg: GraphNeuralNetworkConfig):
        super().__init__()
        self.aggregation = cfg.aggregation
        self.residual = in_dim == out_dim
        # weight (out, 2 * in) = [W_self | W_neigh]: one GEMM over [h | AGG h] (bias and activation in
        # its epilogue) instead of two GEMMs and an add; the concat costs one (N, 2 * in) write
        self.linear = Linear(2 * in_dim, out_dim, bias=True, activation=cfg.activation)
        self.norm = Norm(out_dim, "layer", cfg.eps, bias=True)

    def forward(self, h, src, dst):
        agg = self.kernels.ops.gather_scatter(h, src, dst, h.shape[0], self.aggregation)
        y = self.linear(torch.cat([h, agg], dim=-1))
        if self.residual:
            return self.norm.add(y, h)[0]
        return self.norm(y)


class GraphNeuralNetwork(LevelledModel):
    """Graph classifier; `level` as in kernelforge.models.LEVELS.

    forward(x, edge_index, batch=None, num_graphs=None):
        x (N, node_features) float node features, in the parameters' dtype and device;
        edge_index (2, E) int64, rows [source, target]: messages flow source -> target. Self
            loops and repeated edges count like any edge (a repeated edge is a repeated message);
        batch (N,) int64, each node's graph id in [0, num_graphs); None: one graph;
        num_graphs: how many graphs (rows of the output), by default batch.max() + 1, read on the
            host (a sync). Give it to keep graphs with no nodes at the end of the batch (they
            pool to 0), or with check_indices=False to skip the sync.
        -> (num_graphs, num_classes) logits.

    With check_indices (the default) forward checks on the host, in one sync, that edge_index
    and batch hold valid indices. Without it an out-of-range index raises from index_select /
    index_add on the CPU, and is a device-side assert on a GPU.

    The computation (compute) takes tensors only, so that a TorchScript trace, keyed by its
    inputs' shapes, is right for any values: the graph count enters as the shape of
    graph_size (the node count per graph, which mean pooling divides by), never as a number a
    trace would record.
    """

    # The fastest level compiles the forward whole without CUDA graphs: batches of graphs differ in
    # node and edge counts (graphs would be captured per shape) and a forward is GPU-bound (the
    # demo's, H200: 1.42 ms a call in CUDA graphs, 1.32 compiled without, the same 1.14-1.17 ms of
    # kernels: the graphs' input copies and their host bookkeeping after the host-side range check)
    CUDA_GRAPHS = False

    def __init__(self, node_features: int, hidden: int = 128, num_classes: int = 10, layers: int = 3, *,
                 aggregation: str = "sum", pooling: str = "mean", activation: str = "relu", eps: float = 1e-5,
                 check_indices: bool = True, level: str = "native"):
        super().__init__()
        self.config = cfg = GraphNeuralNetworkConfig(node_features, hidden, num_classes, layers, aggregation, pooling,
                                                     activation, eps, check_indices)
        self.layers = torch.nn.ModuleList(
            GraphLayer(node_features if i == 0 else hidden, hidden, cfg) for i in range(layers))
        self.head = Linear(hidden, num_classes)
        self._init_level(level)

    def forward(self, x, edge_index, batch=None, num_graphs: Optional[int] = None):
        x, edge_index, batch, graph_size = self.prepare(x, edge_index, batch, num_graphs)
        return self.run("compute", x, edge_index, batch, graph_size)

    def prepare(self, x, edge_index, batch=None, num_graphs: Optional[int] = None):
        """Checks the inputs on the host and returns compute's: (x, edge_index, batch, graph_size),
        batch filled in (zeros for one graph) and graph_size (num_graphs,) float32 node counts."""
        name, cfg = type(self).__name__, self.config
        param = self.head.weight
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != cfg.node_features:
            got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: x must be (num_nodes, node_features={cfg.node_features}), got {got}")
        if x.dtype != param.dtype or x.device != param.device:
            raise ValueError(f"{name}: x must be {param.dtype} on {param.device} like the model's parameters, got "
                             f"{x.dtype} on {x.device} (model.to(...) moves the model)")
        n = x.shape[0]
        if (not isinstance(edge_index, torch.Tensor) or edge_index.dim() != 2 or edge_index.shape[0] != 2
                or edge_index.dtype != torch.int64 or edge_index.device != x.device):
            got = (f"shape {tuple(edge_index.shape)} of {edge_index.dtype} on {edge_index.device}"
                   if isinstance(edge_index, torch.Tensor) else type(edge_index).__name__)
            raise ValueError(f"{name}: edge_index must be (2, num_edges) int64 [source, target] node ids on "
                             f"{x.device}, got {got}")
        if batch is not None and (not isinstance(batch, torch.Tensor) or tuple(batch.shape) != (n,)
                                  or batch.dtype != torch.int64 or batch.device != x.device):
            got = (f"shape {tuple(batch.shape)} of {batch.dtype} on {batch.device}"
                   if isinstance(batch, torch.Tensor) else type(batch).__name__)
            raise ValueError(f"{name}: batch must be (num_nodes,) = ({n},) int64 graph ids on {x.device} or None, "
                             f"got {got}")
        if num_graphs is not None and (not isinstance(num_graphs, int) or isinstance(num_graphs, bool)
                                       or num_graphs < 0):
            raise ValueError(f"{name}: num_graphs must be a non-negative int or None, got {num_graphs!r}")

        # One host sync for every range at once (the graph count needs it anyway when not given).
        check_edges = cfg.check_indices and edge_index.shape[1] > 0
        read_batch = batch is not None and n > 0 and (cfg.check_indices or num_graphs is None)
        stats = ([edge_index.min(), edge_index.max()] if check_edges else []) + (
            [batch.min(), batch.max()] if read_batch else [])
        values = torch.stack(stats).tolist() if stats else []
        if check_edges and (values[0] < 0 or values[1] >= n):
            raise ValueError(f"{name}: edge_index must hold node ids in [0, {n}) for x's {n} nodes, got ids "
                             f"from {values[0]} to {values[1]}")
        if batch is None:
            batch = torch.zeros(n, dtype=torch.int64, device=x.device)
            num_graphs = 1 if num_graphs is None else num_graphs
        elif read_batch:
            low, high = values[-2:]
            num_graphs = high + 1 if num_graphs is None else num_graphs
            if low < 0 or high >= num_graphs:
                raise ValueError(f"{name}: batch must hold graph ids in [0, num_graphs={num_graphs}), got ids from "
                                 f"{low} to {high}")
        elif num_graphs is None:  # no nodes
            num_graphs = 0
        if n and num_graphs == 0:
            raise ValueError(f"{name}: num_graphs is 0 but x has {n} nodes")
        graph_size = torch.zeros(num_graphs, dtype=torch.float32, device=x.device)
        graph_size.index_add_(0, batch, torch.ones(n, dtype=torch.float32, device=x.device))
        return x, edge_index, batch, graph_size

    def compute(self, x, edge_index, batch, graph_size):
        """The model on prepared inputs (see prepare): x (N, node_features), edge_index (2, E),
        batch (N,), graph_size (G,) -> logits (G, num_classes). Tensors only, no host reads."""
        src, dst = edge_index[0], edge_index[1]
        h = x
        for layer in self.layers:
            h = layer(h, src, dst)
        return self.head(self.pool(h, batch, graph_size))

    def pool(self, h, batch, graph_size):
        """(N, hidden) -> (G, hidden): each graph's mean, sum or max over its nodes (0 for a graph
        without nodes). Sums accumulate in float32 for half types."""
        num_graphs = graph_size.shape[0]
        if self.config.pooling == "max":  # include_self=False: a graph no node reaches keeps its 0
            index = batch[:, None].expand(-1, h.shape[1])
            return h.new_zeros(num_graphs, h.shape[1]).scatter_reduce(0, index, h, "amax", include_self=False)
        acc = torch.float32 if h.dtype in (torch.float16, torch.bfloat16) else h.dtype
        pooled = h.new_zeros(num_graphs, h.shape[1], dtype=acc).index_add_(0, batch, h.to(acc))
        if self.config.pooling == "mean":
            pooled = pooled / graph_size.to(acc).clamp(min=1)[:, None]
        return pooled.to(h.dtype)


__all__ = ["GraphLayer", "GraphNeuralNetwork", "GraphNeuralNetworkConfig"]
