"""The warp-specialized Gluon GEMM (kernelforge/triton/gemm_gluon.py): on an sm_90 GPU, through
kf.gemm against the float64 oracle (outputs and gradients: the backward's plain GEMMs take it
too) at tile-edge and odd TMA-readable sizes, both layouts of b, with a check that it really
ran; which calls its rule sends to it; everywhere: it builds for sm_90a without spills, in the
shared memory of one SM."""
import pytest
import torch

from tests.conftest import HAS_CUDA
from tests.ops.test_gemm import check

gemm_gluon = pytest.importorskip("kernelforge.triton.gemm_gluon")

ON_HOPPER = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU (wgmma)")
SM90_SHARED_BYTES = 227 * 1024  # the most one block may opt into on an H100 / H200


@pytest.fixture
def gluon_calls(monkeypatch):
    calls = []
    run = gemm_gluon.gemm_into

    def counted(a, b, out, sms, **config):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return run(a, b, out, sms, **config)

    monkeypatch.setattr(gemm_gluon, "gemm_into", counted)
    return calls


# (M, K, N): one tile, edges crossed in every dim (TMA zero-fills the loads past them and
# clips the store), a long odd K, rows not a multiple of anything
SHAPES = [(128, 64, 256), (200, 72, 264), (4097, 1000, 520), (33, 4104, 8)]


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_matches_oracle_on_both_layouts(dtype, shape, gluon_calls, monkeypatch):
    from kernelforge.triton import gemm as triton_gemm

    monkeypatch.setattr(triton_gemm, "USE_GLUON", True)
    M, K, N = shape
    weight = torch.randn(N, K, device="cuda", dtype=dtype) / K ** 0.5
    for label, b in (("b = Linear weight^T", weight.t()), ("b rows", weight.t().contiguous())):
        gluon_calls.clear()
        check("triton", "cuda", dtype, torch.randn(M, K, device="cuda", dtype=dtype), b, what=label)
        # forward, dA = grad @ b^T and dB = a^T @ grad: each operand order the kernel reads
        assert len(gluon_calls) == 3, (label, gluon_calls)


@needs_hopper
@pytest.mark.gpu
def test_rule_takes_large_plain_products_only(gluon_calls):
    import kernelforge as kf

    a = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    kf.gemm(a, w.t())
    assert len(gluon_calls) == 1  # 16 x 16 tiles of 128 x 256: every SM has one
    kf.gemm(a[:256], w.t())  # 2 x 16 tiles: the Triton kernels' smaller tiles fill the GPU better
    kf.gemm(a, w.t(), bias=torch.randn(4096, device="cuda", dtype=torch.bfloat16), activation="gelu")  # an epilogue
    kf.gemm(a.half(), w.t().half(), precision="bf16")  # fp16 inputs computed at bf16: rounded first
    kf.gemm(a.view(2, 1024, 512), w.t())  # a batch folded into rows goes; a batch of both does not
    kf.gemm(a.view(2, 1024, 512), w.t().expand(2, 512, 4096))
    assert len(gluon_calls) == 2, gluon_calls


@pytest.mark.parametrize("a_m_major,b_k_major", [(False, True), (False, False), (True, True)],
                         ids=["a-rows-b-k-major", "a-rows-b-rows", "a-m-major-b-k-major"])
def test_compiles_for_sm90_in_one_sm(a_m_major, b_k_major):
    """Builds for sm_90a with this Triton (no GPU needed: ptxas ships with Triton), without
    spills, within the shared memory one program may take."""
    usage = gemm_gluon.compile_for_sm90(a_m_major, b_k_major)
    assert usage["spills"] == 0, usage
    assert usage["shared"] <= SM90_SHARED_BYTES, usage
