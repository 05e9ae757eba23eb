"""The gather-scatter suite (message passing's sum / mean aggregation): kf.gather_scatter (the
Triton kernel on a GPU) against torch's index_select + index_add_ ("torch eager": kernelforge's
reference, what the GNN's native level runs) and torch.compile of that reference, at the demo
GNN's sizes (kernelforge.demo: 256 graphs of 400 nodes, N = 102400, 8 random in-graph edges a node,
E = 819200), F in (128, 256), sum and mean; forward and forward+backward (the gradient of x).

Shapes are (graphs, nodes a graph, edges a node, F, reduce); the rows name them by N, E, F and the
reduction.

Bytes counted (the floor a fused kernel could reach): forward E*F*elt (each message gathered once)
+ N*F*elt (each output row written once); forward+backward twice that (the backward gathers
grad_out's rows at dst and writes grad_x's N rows). Not counted: the ids (16 bytes an edge), the
float32 accumulator's zero fill and atomics and the finishing pass of the Triton kernel,
index_select's (E, F) intermediate written and read back by index_add_ (eager). So GB/s is the
rate of useful bytes, not of traffic; the peak memory column shows eager's (E, F) messages.

Measured on an H200 at 70fb624 by this suite's predecessor, benchmarks/gather_scatter_bench.py
(benchmarks/results/nvidia-h200/0.1.0/models/70fb624-loss-kernels/gs-bench.log; docs/performance.md):
6-9x eager forward and forward+backward; torch.compile's forward is the same kernel in effect (at
par), its bf16 backward ~3x slower than ours (the reference's backward adds bf16 gradients
atomically). The float32 atomics bound the kernel at 30-75% of the copy rate. A sweep of the
Triton kernel's block shapes (block_e 16-128, block_f 32-256, 2-8 warps; 696c065-gather-scatter/
gs-bench.log there) found the defaults of kernelforge/triton/gather_scatter.py within 4% of the
best at every case.

Outputs are not checked here (tests/bench/test_harness.py checks that the rows compute the same
aggregation, the op's tests its accuracy). Comparing bf16 rows needs a bound of ~3e-2 of the largest
value: the eager reference's own backward adds the E gathered gradients with bf16 atomics, several
roundings an element in a run-dependent order (two eager runs differed by 1.2e-2 on the H200);
float32 rows differ by the summation order only.
"""
from __future__ import annotations

import torch

import kernelforge as kf
from kernelforge.bench.roofline import Cost
from kernelforge.bench.suite_types import Suite
from kernelforge.demo import random_graphs
from kernelforge.reference.gather_scatter import gather_scatter as reference_gather_scatter

GRAPH = (256, 400, 8)  # graphs, nodes a graph, edges a node: the demo's realistic GNN input
QUICK_GRAPH = (4, 50, 4)  # the demo's small one has 8 graphs of 50 nodes
SHAPES = [(*GRAPH, features, reduce) for features in (128, 256) for reduce in ("sum", "mean")]
QUICK_SHAPES = [(*QUICK_GRAPH, 16, reduce) for reduce in ("sum", "mean")]


def _inputs(shape, dtype: torch.dtype, device: torch.device) -> tuple:
    """x (N, F), src and dst (E,) from random in-graph edges, num_nodes N, the reduction."""
    graphs, nodes, edges, features, reduce = shape
    x, edge_index, _ = random_graphs(graphs, nodes, edges, features, device, dtype)
    return x, edge_index[0], edge_index[1], x.shape[0], reduce


def _sizes(shape) -> tuple[int, int, int]:
    graphs, nodes, edges, features, _ = shape
    return graphs * nodes, graphs * nodes * edges, features


def _cost(shape, dtype: torch.dtype, direction: str) -> Cost:
    n_nodes, n_edges, features = _sizes(shape)
    useful = (n_edges + n_nodes) * features * dtype.itemsize
    return Cost(useful * (1 if direction == "fwd" else 2))


def _label(shape) -> str:
    n_nodes, n_edges, features = _sizes(shape)
    return f"N{n_nodes} E{n_edges} F{features} {shape[4]}"


def message_passing_suites() -> dict:
    return {"gather_scatter": Suite(
        op="gather_scatter", shapes=SHAPES, quick_shapes=QUICK_SHAPES, make_inputs=_inputs, cost=_cost,
        kernelforge=kf.gather_scatter,
        baselines=lambda: {"torch eager": reference_gather_scatter,
                           "torch.compile": torch.compile(reference_gather_scatter, dynamic=False)},
        label=_label,
    )}
