"""kf.gemm's few-row kernel (kernelforge/triton/gemv.py): a single row of a (a decoding step's
token) goes through it, forward and the backward's one-row product, on every layout, dtype and
epilogue, split over K or not, against the float64 oracle; the rule's edges."""
import pytest
import torch

from kernelforge.triton import gemm as triton_gemm
from kernelforge.triton import gemv
from tests.conftest import backend_cases, needs_cuda
from tests.ops.test_gemm import check, dtypes_for

# these tests count the launchers' calls, which a replayed eager plan does not make
pytestmark = pytest.mark.usefixtures("no_eager_plans")


@pytest.fixture
def gemv_calls(monkeypatch):
    """The signatures gemv.Launch ran, one entry a call: (rows, N, K)."""
    calls = []
    run = gemv.Launch.__call__

    def counted(self, a, b, *rest):
        calls.append((a.shape[1], b.shape[2], a.shape[2]))
        return run(self, a, b, *rest)

    monkeypatch.setattr(triton_gemm, "_PLANS", {})
    monkeypatch.setattr(gemv.Launch, "__call__", counted)
    return calls


def layouts(device, dtype, rows, K, N):
    """(label, a, b): a Linear's weight read transposed (K contiguous), a row-major (K, N) b, and
    a strided a (every other column of a wider tensor)."""
    weight = torch.randn(N, K, device=device, dtype=dtype) / K ** 0.5
    return [("a rows, b = W^T", torch.randn(rows, K, device=device, dtype=dtype), weight.t()),
            ("strided a, b rows", torch.randn(rows, 2 * K, device=device, dtype=dtype)[:, ::2],
             weight.t().contiguous())]


@pytest.mark.parametrize("backend,device", backend_cases(("triton",)))
@pytest.mark.parametrize("K,N", [(77, 37), (None, 300)], ids=["odd", "even-k"])
def test_one_row_runs_the_few_row_kernel(backend, device, K, N, gemv_calls):
    # even-k: a multiple of every K tile the device's candidates take (the loop without masks)
    K = K or (1024 if device == "cuda" else 128)
    for dtype in dtypes_for(backend, device):
        for label, a, b in layouts(device, dtype, 1, K, N):
            for bias, activation, residual in [(None, None, None),
                                               (torch.randn(N, device=device, dtype=dtype), "gelu_tanh",
                                                torch.randn(1, N, device=device, dtype=dtype))]:
                gemv_calls.clear()
                check(backend, device, dtype, a, b, bias, activation, residual, what=label)
                # the forward, and the backward's dA = grad (1 x N) @ b^T: one row too
                assert (1, N, K) in gemv_calls and (1, K, N) in gemv_calls, gemv_calls


@pytest.mark.parametrize("backend,device", backend_cases(("triton",)))
@pytest.mark.parametrize("split", [2, 4])
def test_split_k_and_forced_rows(backend, device, split, gemv_calls, monkeypatch):
    # gemm.SPLIT_K fixes the slice count: the slices meet through the arrival counts, the last
    # adds them in order and runs the epilogue; at 4 slices the last has no K tile (3 of 32 on the
    # CPU, 9 of 512 on the GPU: slices of 1 and 3 tiles) and still arrives. Forced (USE_GEMV True),
    # 3 rows (ROWS 4: a padded row never stored) take the kernel as well.
    monkeypatch.setattr(triton_gemm, "SPLIT_K", split)
    monkeypatch.setattr(triton_gemm, "USE_GEMV", True)
    K, N = (70, 24) if device == "cpu" else (4100, 72)
    for rows in (1, 3):
        for label, a, b in layouts(device, torch.float32, rows, K, N):
            bias = torch.randn(N, device=device)
            check(backend, device, torch.float32, a, b, bias, "silu", torch.randn(rows, N, device=device), what=label)
    assert (3, N, K) in gemv_calls and (1, N, K) in gemv_calls


@pytest.mark.parametrize("backend,device", backend_cases(("triton",)))
def test_the_rule(backend, device, gemv_calls, monkeypatch):
    # By the rule only one row takes it (two rows run the tensor-core kernel); USE_GEMV False
    # turns it off; a batch of single rows against a batch of b is not one matrix.
    import kernelforge as kf

    a, b = torch.randn(2, 40, device=device), torch.randn(40, 24, device=device)
    with kf.use_backend(backend):
        kf.gemm(a, b)
        assert not gemv_calls
        kf.gemm(a[:1], b)
        assert gemv_calls == [(1, 24, 40)]
        kf.gemm(a[:, None], torch.randn(2, 40, 24, device=device))
        assert len(gemv_calls) == 1
        monkeypatch.setattr(triton_gemm, "USE_GEMV", False)
        kf.gemm(a[:1], b)
        assert len(gemv_calls) == 1


@pytest.mark.gpu
@needs_cuda
def test_split_k_inside_a_captured_graph(monkeypatch):
    # Split-K's arrival counts made during a capture are the graph's own and zeroed on each
    # replay: two graphs captured one after the other (torch.cuda.graph captures on one stream)
    # both give the product, replayed in either order.
    import kernelforge as kf

    monkeypatch.setattr(triton_gemm, "SPLIT_K", 4)
    monkeypatch.setattr(triton_gemm, "_PLANS", {})
    a, w = torch.randn(1, 4096, device="cuda"), torch.randn(64, 4096, device="cuda") / 64
    with kf.use_backend("triton"):
        kf.gemm(a, w.t())  # compiled before the captures
        graphs, outs = [], []
        for _ in range(2):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs.append(kf.gemm(a, w.t()))
            graphs.append(graph)
    want = a.double() @ w.double().t()
    for graph, out in [(graphs[1], outs[1]), (graphs[0], outs[0]), (graphs[1], outs[1])]:
        out.zero_()
        graph.replay()
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_autotuned_on_the_gpu_at_decode_shapes(gemv_calls):
    # The autotuner's candidates at a one-row product: a narrow output (split-K candidates
    # too) and a wide one, bf16 with a fused bias + GELU and residual.
    for K, N in [(4096, 64), (2048, 6144)]:
        a, b = torch.randn(1, K, device="cuda", dtype=torch.bfloat16), torch.randn(N, K, device="cuda",
                                                                              dtype=torch.bfloat16).t() / K ** 0.5
        check("triton", "cuda", torch.bfloat16, a, b, torch.randn(N, device="cuda", dtype=torch.bfloat16), "gelu",
              torch.randn(1, N, device="cuda", dtype=torch.bfloat16), what="autotuned")
        assert (1, N, K) in gemv_calls
