"""The gemm op's cublas backend (kernelforge/cublas/gemm.py): each of its four paths against the
float64 oracle through the op (CUDA: outputs and gradients, every epilogue, shared and batched b,
strided operands), that it is the backend that ran, its refusals with their reasons; on the CPU
its launcher's paths that torch's CPU matmul also has (the fused bias epilogues, the float32
product), and the refusal of CPU tensors."""
import pytest
import torch

import kernelforge as kf
from kernelforge import backends
from kernelforge.cublas import gemm as cublas
from kernelforge.reference import gemm as reference
from tests.conftest import needs_cuda
from tests.ops.test_gemm import SHAPE_IDS, SHAPES, check, operands, torch_gemm

gpu = [pytest.mark.gpu, needs_cuda]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _ran_on(fn) -> set:
    """The backends the gemm calls inside fn ran on."""
    with backends.recording() as counts:
        fn()
    return {backend for (op, backend) in counts if op == "gemm"}


# ----------------------------------------------------------------------------- CPU: the launcher's paths
@pytest.mark.parametrize("batch_b", [1, 3], ids=["shared-b", "batched-b"])
def test_launcher_paths_on_the_cpu(batch_b):
    """Paths 1-4 of the launcher on float32 CPU tensors (torch's CPU matmul has mm, bmm, addmm and
    _addmm_activation with relu): the reference launcher's results, outputs that are no views."""
    a = torch.randn(2 if batch_b == 1 else 3, 7, 5)
    b = torch.randn(batch_b, 5, 4)
    bias, residual = torch.randn(4), torch.randn(a.shape[0], 7, 4)
    shape = (a.shape[0], 7, 4)
    cases = {"product": (None, None, None, False), "bias": (bias, None, None, False),
             "bias+relu": (bias, None, "relu", False), "residual+silu+preact": (bias, residual, "silu", True)}
    for label, (bias_, residual_, activation, save_preact) in cases.items():
        got, preact = cublas.gemm(a, b, bias_, residual_, activation, "fp32", torch.float32, save_preact,
                                  out_shape=shape)
        want, want_preact = reference.gemm(a, b, bias_, residual_, activation, "fp32", torch.float32, save_preact,
                                           out_shape=shape)
        assert got.shape == shape and not got._is_view(), label
        torch.testing.assert_close(got, want, msg=lambda m: f"{label}: {m}")
        assert (preact is None) == (want_preact is None), label
        if preact is not None:
            torch.testing.assert_close(preact, want_preact)


def test_cpu_tensors_are_refused_with_the_reason():
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    with kf.use_backend("cublas"), pytest.raises(kf.BackendUnsupportedError, match="cuBLAS runs on CUDA tensors"):
        kf.gemm(a, b)
    assert "cublas: cannot: cuBLAS runs on CUDA tensors" in kf.explain("gemm", a, b, compute="fp32")


# ----------------------------------------------------------------------------- GPU: through the op
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_matches_oracle(device, dtype, shape):
    batch_a, batch_b, M, K, N = shape
    a, b = operands(device, dtype, batch_a, batch_b, M, K, N)
    bias = torch.randn(N, device=device, dtype=dtype)
    residual = torch.randn(*torch.broadcast_shapes(batch_a, batch_b), M, N, device=device, dtype=dtype)
    # preferred, not forced: the backward's activation step has no cuBLAS implementation
    check("cublas", device, dtype, a, b, bias, "gelu_tanh", residual, select=kf.prefer_backend)
    check("cublas", device, dtype, a, b, select=kf.prefer_backend)
    with kf.use_backend("cublas"):
        assert _ran_on(lambda: kf.gemm(a, b, bias=bias)) == {"cublas"}


@pytest.mark.parametrize("activation", [None, "relu", "gelu_tanh", "gelu", "silu"], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_every_path(device, dtype, activation):
    """Inference (paths 1-3 where they apply, the fused bias epilogues) and training (path 4: the
    preact kept), with and without a bias, a residual, a float32 out."""
    a, b = operands(device, dtype, (3,), (), 37, 29, 23)
    bias = torch.randn(23, device=device, dtype=dtype)
    residual = torch.randn(3, 37, 23, device=device, dtype=dtype)
    for with_bias in (False, True):
        for with_residual in (False, True):
            check("cublas", device, dtype, a, b, bias if with_bias else None, activation,
                  residual if with_residual else None, what=f"bias={with_bias} residual={with_residual}",
                  select=kf.prefer_backend)
            with torch.no_grad(), kf.use_backend("cublas"):
                out = kf.gemm(a, b, bias=bias if with_bias else None, activation=activation,
                              residual=residual if with_residual else None)
            oracle = torch_gemm(a.double(), b.double(), bias.double() if with_bias else None, activation,
                                residual.double() if with_residual else None)
            # one rounding to dtype after float32 accumulation (cuBLAS's split-K or tile order aside)
            tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
            torch.testing.assert_close(out.double(), oracle, rtol=tol, atol=tol * 2)
    with torch.no_grad(), kf.use_backend("cublas"):
        wide = kf.gemm(a, b, bias=bias, activation=activation, out_dtype=torch.float32)
    assert wide.dtype == torch.float32


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_strided_operands(device):
    K, M, N = 24, 21, 18
    weight = torch.randn(N, K, device=device, dtype=torch.bfloat16) / K ** 0.5
    for label, a in {"rows": torch.randn(M, K, device=device, dtype=torch.bfloat16),
                     "transposed": torch.randn(K, M, device=device, dtype=torch.bfloat16).t(),
                     "every other column": torch.randn(M, 2 * K, device=device, dtype=torch.bfloat16)[:, ::2],
                     "batched, transposed batch": torch.randn(M, 3, K, device=device,
                                                              dtype=torch.bfloat16).transpose(0, 1)}.items():
        check("cublas", device, torch.bfloat16, a, weight.t(), torch.randn(N, device=device, dtype=torch.bfloat16),
              "relu", what=label, select=kf.prefer_backend)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_refusals_name_the_reason(device):
    a = torch.randn(8, 8, device=device)
    with kf.use_backend("cublas"):
        with pytest.raises(kf.BackendUnsupportedError, match="no fp8 path"):
            kf.gemm(a, a, precision="fp8")
        with pytest.raises(kf.BackendUnsupportedError, match="operands in the compute dtype"):
            kf.gemm(a, a, precision="bf16")
        with pytest.raises(kf.BackendUnsupportedError, match="computes in"):
            kf.gemm(a.double(), a.double())
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        with kf.use_backend("cublas"), pytest.raises(kf.BackendUnsupportedError, match="allow_tf32"):
            kf.gemm(a, a, precision="fp32")
        # the choice made under tf32 is not reused once it is off: fp32 then runs on cuBLAS in IEEE float32
        torch.backends.cuda.matmul.allow_tf32 = False
        with kf.use_backend("cublas"):
            out = kf.gemm(a, a, precision="fp32")
        torch.testing.assert_close(out.double(), a.double() @ a.double(), rtol=1e-5, atol=1e-5)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_opcheck(device):
    a = torch.randn(2, 9, 12, device=device, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(12, 10, device=device, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(10, device=device, dtype=torch.bfloat16, requires_grad=True)
    with kf.prefer_backend("cublas"):
        for args in ((a, b, bias, None, "gelu_tanh", "bf16", torch.bfloat16, False),
                     (a, b, bias, None, "silu", "bf16", torch.bfloat16, True),
                     (a, b, None, None, "none", "bf16", torch.float32, False)):
            torch.library.opcheck(torch.ops.kernelforge.gemm.default, args)
