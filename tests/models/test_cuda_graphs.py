"""The example models in CUDA graphs (GPU suite): torch.compile(mode="reduce-overhead") of each model on
kernelforge's kernels captures whole graphs (no cudagraph skip reported), and a training step at the
triton level captured by hand with torch.cuda.CUDAGraph replays to the eager step's numbers. Both need
every kernelforge path a model uses to be free of host syncs and per-call host tensors."""
import copy

import pytest
import torch

from kernelforge.models import GraphNeuralNetwork, LanguageModel, VisionTransformer
from kernelforge.models.levels import KERNELFORGE_KERNELS
from tests.conftest import needs_cuda

pytestmark = [pytest.mark.gpu, needs_cuda]


def _lm():
    return LanguageModel(vocab_size=512, dim=128, n_layers=2, n_heads=2, max_seq_len=256)


def _workloads():
    """name -> (model, inputs, method): the demo's workloads at small sizes, bf16 on the GPU."""
    torch.manual_seed(0)
    lm = _lm().cuda().bfloat16()
    vit = VisionTransformer(image_size=64, patch_size=16, num_classes=10, dim=128, depth=2, heads=2).cuda().bfloat16()
    gnn = GraphNeuralNetwork(32, hidden=64, num_classes=5, layers=2, aggregation="mean").cuda().bfloat16()
    n = 300
    x = torch.randn(n, 32, device="cuda", dtype=torch.bfloat16)
    edge_index = torch.randint(0, n, (2, 1200), device="cuda")
    batch = torch.arange(n, device="cuda") // 100
    ids = torch.randint(0, 512, (4, 128), device="cuda")
    return {
        "lm-forward": (lm.eval(), (ids,), "compute"),
        "lm-loss": (copy.deepcopy(lm).train(), (ids,), "compute_loss"),
        "vit-forward": (vit.eval(), (torch.randn(8, 3, 64, 64, device="cuda", dtype=torch.bfloat16),), "compute"),
        "gnn-forward": (gnn.eval(), gnn.prepare(x, edge_index, batch), "compute"),
    }


@pytest.mark.parametrize("kernel_set", ["fastest", "kernelforge"])
@pytest.mark.parametrize("name", ["lm-forward", "lm-loss", "vit-forward", "gnn-forward"])
def test_reduce_overhead_captures_whole_graphs(name, kernel_set):
    """'fastest': the fastest level as it runs (the GNN's without CUDA graphs: its CUDA_GRAPHS).
    'kernelforge': every function on kernelforge's ops (opaque GEMM and attention included) compiled
    with reduce-overhead: each must be capturable."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, inputs, method = _workloads()[name]
    expected = getattr(copy.deepcopy(model), method)(*inputs).float()
    if kernel_set == "fastest":
        model.set_level("fastest")
        run = (lambda *a: model.run(method, *a))
    else:
        model.kernels.ops = KERNELFORGE_KERNELS
        run = torch.compile(getattr(model, method), mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        if kernel_set == "kernelforge":  # the fastest level marks its steps itself
            torch.compiler.cudagraph_mark_step_begin()
        out = run(*inputs)
        if name == "lm-loss":
            out.backward()
            model.zero_grad(set_to_none=True)  # gradients are graph outputs: the next step reuses them
        got = out.detach().float().clone()
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    tolerance = 3e-2 * expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=3e-2, atol=tolerance)


def test_a_train_step_captured_by_hand_replays_correctly():
    """Forward, loss, backward and an SGD step of the LM at the triton level in one torch.cuda.CUDAGraph,
    replayed on new batches: the parameters follow the eager steps' (float32, so the two runs agree to
    rounding)."""
    torch.manual_seed(0)
    model = _lm().cuda().set_level("triton")
    eager = copy.deepcopy(model)
    batches = [torch.randint(0, 512, (2, 64), device="cuda") for _ in range(4)]

    def step(m, ids, optimizer):
        with m.kernel_scope():
            loss = m.loss(ids)
            loss.backward()
        optimizer.step()
        return loss

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    static_ids = batches[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles and autotunes outside the capture
        for _ in range(2):
            optimizer.zero_grad(set_to_none=False)
            step(model, static_ids, optimizer)
    torch.cuda.current_stream().wait_stream(side)
    model.load_state_dict(eager.state_dict())  # undo the warm-up's steps
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        static_loss = step(model, static_ids, optimizer)
    model.load_state_dict(eager.state_dict())  # capture ran the step once too: start again from the same weights
    for ids in batches:
        static_ids.copy_(ids)
        for p in model.parameters():
            p.grad.zero_()
        graph.replay()
        eager_optimizer.zero_grad()
        eager_loss = step(eager, ids, eager_optimizer)
        torch.testing.assert_close(static_loss, eager_loss, rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=name)
