"""kernelforge.gemm(precision="fp8"): e4m3 operands with per-tensor or per-row scales.

Two yardsticks, as the issue asks for fp8:
- exactness on the quantized operands: against the float64 product of what the e4m3
  operands and their scales stand for, the 2x-PyTorch rule with PyTorch's float32 product of
  the same values (and torch._scaled_mm on the GPU) as the same-precision computation;
- quantization noise against the unquantized inputs: signal-to-quantization-noise ratio
  (e4m3 keeps 3 mantissa bits: ~29 dB measured on Gaussian inputs; a wrong scale or a lost
  tile drops far below the 25 dB bound).
Also: the straight-through backward, scale shapes and errors, opcheck, torch.compile.
"""
import pytest
import torch

import kernelforge as kf
from kernelforge.ops import gemm as gemm_ops
from kernelforge.ops import gemm_checks
from kernelforge.reference import gemm as reference
from tests.conftest import backend_cases
from tests.numerics import assert_compiled_matches_eager, assert_matches_oracle

FP8 = torch.float8_e4m3fn
MIN_SQNR_DB = 25.0
# (batch_a, batch_b, M, K, N): one element, odd sizes, K past one tile, a b shared across a's
# batch (folded into rows), both batched.
SHAPES = [((), (), 1, 1, 1), ((), (), 7, 13, 5), ((), (), 37, 64, 29), ((), (), 199, 96, 130),
          ((2,), (), 19, 48, 40), ((2, 3), (3,), 9, 32, 11)]
SHAPE_IDS = ["1x1x1", "7x13x5", "37x64x29", "199x96x130", "batch2-shared-b", "batch2x3-b3"]


def sqnr_db(ours: torch.Tensor, exact: torch.Tensor) -> float:
    noise = (ours.double() - exact).pow(2).mean()
    return float(10 * torch.log10(exact.pow(2).mean() / noise))


def dequantized(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.double() * scale.double()


def quantize(x: torch.Tensor, scaling: str, k_dim: int):
    scale = reference.fp8_scale(x, scaling, k_dim)
    return reference.quantize_fp8(x, scale), scale


def epilogue64(acc, bias, activation, residual):
    return reference.epilogue(acc, None if bias is None else bias.double(), activation,
                              None if residual is None else residual.double())


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
@pytest.mark.parametrize("scaling", reference.FP8_SCALINGS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_matches_oracle_on_the_quantized_operands(backend, device, scaling, shape):
    batch_a, batch_b, M, K, N = shape
    a = torch.randn(*batch_a, M, K, device=device) * 3
    b = torch.randn(*batch_b, K, N, device=device) / K ** 0.5
    bias = torch.randn(N, device=device)
    out_batch = torch.broadcast_shapes(batch_a, batch_b)
    residual = torch.randn(*out_batch, M, N, device=device)
    qa, sa = quantize(a, scaling, -1)
    qb, sb = quantize(b, scaling, -2)
    for epilogue in ((None, None, None), (bias, "gelu_tanh", residual)):
        with kf.use_backend(backend):  # quantized inside from the float32 inputs, and given quantized
            from_float = kf.gemm(a, b, bias=epilogue[0], activation=epilogue[1], residual=epilogue[2],
                                 precision="fp8", fp8_scaling=scaling, out_dtype=torch.bfloat16)
            given = kf.gemm(qa, qb, bias=epilogue[0], activation=epilogue[1], residual=epilogue[2],
                            scale_a=sa, scale_b=sb)
        assert given.dtype == torch.bfloat16  # the default output of e4m3 operands
        oracle = epilogue64(torch.matmul(dequantized(qa, sa), dequantized(qb, sb)), *epilogue)
        same = epilogue64(torch.matmul(qa.float(), qb.float()) * sa * sb, *epilogue).to(torch.bfloat16)
        scale = torch.matmul(dequantized(qa, sa).abs(), dequantized(qb, sb).abs()).max().item()
        label = f"{backend} {scaling} {shape} act={epilogue[1]}"
        assert_matches_oracle(from_float, same, oracle, f"{label} from float32", reduced=K, terms_scale=scale)
        assert_matches_oracle(given, same, oracle, f"{label} given e4m3", reduced=K, terms_scale=scale)
        exact = epilogue64(torch.matmul(a.double(), b.double()), *epilogue)
        if M * N >= 100:  # enough outputs for a noise ratio
            assert sqnr_db(from_float, exact) >= MIN_SQNR_DB, f"{label}: SQNR {sqnr_db(from_float, exact):.1f} dB"


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_float32_output_long_k_and_fast_accumulation(backend, device):
    # K = 1030 crosses many K tiles (and is not a multiple of 16: the pointer kernel's masked
    # tail). Precise accumulation sums each K tile into float32: within a few times the
    # tensor cores' in-tile error of the exact product of the e4m3 values; fast accumulation
    # is allowed its reduced precision over all of K (1.5e-3 of the largest output measured
    # at K = 1024 for it and for cuBLAS's), yet far under the quantization noise.
    a = torch.randn(70, 1030, device=device)
    b = torch.randn(1030, 48, device=device) / 1030 ** 0.5
    qa, sa = quantize(a, "row", -1)
    qb, sb = quantize(b, "row", -2)
    exact = torch.matmul(dequantized(qa, sa), dequantized(qb, sb))
    with kf.use_backend(backend):
        out = kf.gemm(a, b, precision="fp8")
        fast = kf.gemm(a, b, precision="fp8", fp8_fast_accum=True)
    assert out.dtype == fast.dtype == torch.float32
    top = exact.abs().max().item()
    precise_bound, fast_bound = (1e-3, 1e-2) if device == "cuda" else (1e-6, 1e-6)
    assert (out.double() - exact).abs().max().item() <= precise_bound * top
    assert (fast.double() - exact).abs().max().item() <= fast_bound * top
    assert sqnr_db(out, a.double() @ b.double()) >= MIN_SQNR_DB


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_given_scales_broadcast_and_layouts(backend, device):
    # A Linear weight (N, K) read transposed, a row-major b (copied to K-major inside), scales
    # as 0-dim, (1,), (M, 1) and (1, N), and scales given for float32 operands (delayed scaling).
    M, K, N = 33, 80, 24
    a = torch.randn(M, K, device=device)
    weight = torch.randn(N, K, device=device) / K ** 0.5
    oracle = a.double() @ weight.double().t()
    with kf.use_backend(backend):
        for sa, sb in ((torch.tensor(0.01, device=device), torch.tensor([0.002], device=device)),
                       (a.abs().amax(1, keepdim=True) / 448, weight.abs().amax(1)[None, :] / 448)):
            for b in (weight.t(), weight.t().contiguous()):
                out = kf.gemm(a, b, precision="fp8", scale_a=sa, scale_b=sb, out_dtype=torch.float32)
                assert sqnr_db(out, oracle) >= MIN_SQNR_DB - 5, f"scales {tuple(sa.shape)} {tuple(sb.shape)}"
        # float8 operands without scales: scale 1
        qa, qb = a.clamp(-448, 448).to(FP8), weight.t().to(FP8)
        out = kf.gemm(qa, qb, out_dtype=torch.float32)
    exact = qa.double() @ qb.double()
    # Within one K tile the GPU's fp8 tensor cores accumulate at reduced precision (cuBLAS's
    # too: 2.3e-4 of the largest output at K = 1024, docs/notes/gemm.md);
    # the CPU sums in float32.
    bound = (2e-3 if device == "cuda" else 1e-6) * exact.abs().max().item()
    assert (out.double() - exact).abs().max().item() <= bound


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_straight_through_backward(backend, device):
    # The rounding counts as the identity: the gradients are those of the unquantized
    # product, computed at bf16 (the yardstick: PyTorch's bf16 autograd of the same).
    a = torch.randn(2, 23, 40, device=device, requires_grad=True)
    b = (torch.randn(40, 17, device=device) / 40 ** 0.5).requires_grad_()
    bias = torch.randn(17, device=device, requires_grad=True)
    residual = torch.randn(23, 17, device=device, requires_grad=True)
    with kf.use_backend(backend):
        out = kf.gemm(a, b, bias=bias, residual=residual, precision="fp8")
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (a, b, bias, residual), grad)
    exact = [t.detach().double().requires_grad_() for t in (a, b, bias, residual)]
    want = torch.autograd.grad(exact[0] @ exact[1] + exact[2] + exact[3], exact, grad.double())
    half = [t.detach().bfloat16().requires_grad_() for t in (a, b, bias, residual)]
    base = torch.autograd.grad(half[0] @ half[1] + half[2] + half[3], half, grad.bfloat16())
    terms = {"a": 40 * 3.0, "b": 46 * 3.0, "bias": grad.abs().sum().item(), "residual": 0.0}
    for name, g, w, s, t in zip(("a", "b", "bias", "residual"), got, want, base, (a, b, bias, residual)):
        assert g.shape == t.shape and g.dtype == t.dtype, name
        # the bf16 operands' rounding bounds the gradient's error: judge it at bf16
        assert_matches_oracle(g.bfloat16(), s, w, f"{backend} grad {name}", reduced=46, terms_scale=terms[name])


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_opcheck_and_compile(backend, device):
    a = torch.randn(2, 9, 32, device=device, requires_grad=True)
    b = torch.randn(32, 10, device=device, requires_grad=True)
    bias = torch.randn(10, device=device, requires_grad=True)
    qa, sa = quantize(a.detach(), "row", -1)
    with kf.use_backend(backend):
        for args in ((a, b, bias, None, "gelu", "fp8", torch.bfloat16, True, None, None, "row"),
                     (a, b, None, None, "none", "fp8", torch.float32, False, None, None, "tensor")):
            torch.library.opcheck(torch.ops.kernelforge.gemm.default, args)
        # an e4m3 input: opcheck's schema test compares inputs with arithmetic that float8 lacks
        # on the CPU ("mul_cpu_reduced_float" not implemented), so it runs the other three
        torch.library.opcheck(torch.ops.kernelforge.gemm.default,
                              (qa, b.detach(), None, None, "none", "fp8", torch.bfloat16, False, sa, None, "row"),
                              test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))

    def f(a, b, bias):
        return kf.gemm(a, b, bias=bias, activation="silu", precision="fp8").float().square().sum()

    compiled = torch.compile(f, backend="aot_eager" if device == "cpu" else "inductor", fullgraph=True)
    # On a GPU the compiled graph's bf16 products may come from another kernel route than eager's
    # (another autotuned signature): a bf16 rounding apart, 5e-5 of the sum measured (H200).
    with kf.use_backend(backend):
        assert_compiled_matches_eager(f, compiled, (a, b, bias), relative_floor=0.0 if device == "cpu" else 2 ** -8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with float8 tensor cores")
@pytest.mark.parametrize("scaling", reference.FP8_SCALINGS)
def test_agrees_with_torch_scaled_mm(scaling):
    # torch._scaled_mm (cuBLAS) on the same e4m3 operands and scales is the same-precision
    # yardstick: both accumulate on the fp8 tensor cores.
    M, K, N = 256, 1024, 384
    a = torch.randn(M, K, device="cuda")
    weight = torch.randn(N, K, device="cuda") / K ** 0.5
    qa, sa = quantize(a, scaling, -1)
    qw, sw = quantize(weight, scaling, -1)  # per output column of b = W^T: W's rows
    sb = sw.reshape(1, -1)
    ours = kf.gemm(qa, qw.t(), scale_a=sa, scale_b=sb)
    theirs = torch._scaled_mm(qa, qw.t(), scale_a=sa.reshape(-1, 1) if scaling == "row" else sa.reshape(()),
                              scale_b=sb if scaling == "row" else sb.reshape(()), out_dtype=torch.bfloat16)
    oracle = torch.matmul(dequantized(qa, sa), dequantized(qw, sw).t())
    scale = torch.matmul(dequantized(qa, sa).abs(), dequantized(qw, sw).abs().t()).max().item()
    assert_matches_oracle(ours, theirs, oracle, f"fp8 {scaling} vs torch._scaled_mm", reduced=K, terms_scale=scale)


@pytest.mark.parametrize("backend,device", backend_cases(("triton",)))
@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointers"])
def test_both_triton_kernels(backend, device, use_tma, monkeypatch):
    # Either kernel forced (the interpreter runs the TMA kernel's code on the CPU too), both
    # scalings, the two layouts of b (row-major b is copied to K-major for e4m3).
    from kernelforge.triton import gemm as triton_gemm

    monkeypatch.setattr(triton_gemm, "USE_TMA", use_tma)
    a = torch.randn(70, 64, device=device)
    weight = torch.randn(48, 64, device=device) / 8
    exact = a.double() @ weight.double().t()
    with kf.use_backend(backend):
        for scaling in reference.FP8_SCALINGS:
            for b in (weight.t(), weight.t().contiguous()):
                out = kf.gemm(a, b, precision="fp8", fp8_scaling=scaling, out_dtype=torch.float32)
                assert sqnr_db(out, exact) >= MIN_SQNR_DB, f"{scaling} b strides {b.stride()}"


@pytest.mark.parametrize("backend,device", backend_cases(("triton",)))
def test_split_k(backend, device, monkeypatch):
    # Split-K on e4m3 operands: each slice's float32 partial unscaled, the scales and the
    # epilogue applied once, after the slices are summed. Both scalings, both accumulation
    # modes, K = 1040 (rows TMA can read) in 3 slices.
    from kernelforge.triton import gemm as triton_gemm
    from tests.ops.test_gemm import record_tma_splits

    splits = record_tma_splits(monkeypatch)
    monkeypatch.setattr(triton_gemm, "SPLIT_K", 3)
    M, K, N = 70, 1040, 48
    a = torch.randn(M, K, device=device)
    b = torch.randn(K, N, device=device) / K ** 0.5
    bias, residual = torch.randn(N, device=device), torch.randn(M, N, device=device)
    for scaling in reference.FP8_SCALINGS:
        qa, sa = quantize(a, scaling, -1)
        qb, sb = quantize(b, scaling, -2)
        oracle = epilogue64(torch.matmul(dequantized(qa, sa), dequantized(qb, sb)), bias, "silu", residual)
        same = epilogue64(torch.matmul(qa.float(), qb.float()) * sa * sb, bias, "silu", residual).float()
        scale = torch.matmul(dequantized(qa, sa).abs(), dequantized(qb, sb).abs()).max().item()
        for fast in (False, True):
            with kf.use_backend(backend):
                out = kf.gemm(qa, qb, bias=bias, activation="silu", residual=residual, scale_a=sa, scale_b=sb,
                              out_dtype=torch.float32, fp8_fast_accum=fast)
            label = f"split 3 {scaling} fast={fast}"
            if device == "cuda":  # the fp8 tensor cores' reduced precision within a K tile (see the test above)
                bound = (1e-2 if fast else 1e-3) * scale
                assert (out.double() - oracle).abs().max().item() <= bound, label
            else:
                assert_matches_oracle(out, same, oracle, label, reduced=K, terms_scale=scale)
    assert splits == [3] * 4


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_empty_operands(backend, device):
    bias = torch.randn(3, device=device)
    with kf.use_backend(backend):
        for scaling in reference.FP8_SCALINGS:
            assert kf.gemm(torch.randn(0, 4, device=device), torch.randn(4, 3, device=device), precision="fp8",
                           fp8_scaling=scaling).shape == (0, 3)
            # K = 0: the product is zeros, the epilogue still runs
            out = kf.gemm(torch.randn(5, 0, device=device), torch.randn(0, 3, device=device), bias=bias,
                          activation="gelu", precision="fp8", fp8_scaling=scaling)
            torch.testing.assert_close(out, torch.nn.functional.gelu(bias).expand(5, 3))


# ----------------------------------------------------------------------------- errors
def test_precision_auto_takes_fp8_for_e4m3_operands():
    a, b = torch.randn(4, 16).to(FP8), torch.randn(16, 8).to(FP8)
    assert gemm_ops.resolve_compute(a, b, "auto") == "fp8"
    assert kf.gemm(a, b).dtype == torch.bfloat16


def test_gpus_without_fp8_are_refused_clearly():
    assert gemm_checks.why_no_fp8(torch.device("cpu")) is None
    assert gemm_checks.why_no_fp8(torch.device("cuda"), capability=(9, 0)) is None
    why = gemm_checks.why_no_fp8(torch.device("cuda"), capability=(8, 0))
    assert "compute capability 8.9+" in why and "got 8.0" in why


@pytest.mark.parametrize("call,error,match", [
    (lambda: kf.gemm(torch.randn(3, 4), torch.randn(4, 2), precision="fp8", fp8_scaling="block"), ValueError,
     "fp8_scaling must be one of"),
    (lambda: kf.gemm(torch.randn(3, 4), torch.randn(4, 2), precision="fp8", scale_a=torch.ones(3)), ValueError,
     r"scale_a must broadcast to \(3, 1\)"),
    (lambda: kf.gemm(torch.randn(3, 4), torch.randn(4, 2), precision="fp8", scale_b=torch.ones(2, 1)), ValueError,
     r"scale_b must broadcast to \(1, 2\)"),
    (lambda: kf.gemm(torch.randn(3, 4), torch.randn(4, 2), precision="bf16", scale_a=torch.ones(1)), ValueError,
     "go with precision='fp8'"),
    (lambda: kf.gemm(torch.randn(3, 4).to(FP8), torch.randn(4, 2), precision="bf16"), TypeError,
     "a must have dtype in"),
    (lambda: kf.gemm(torch.randn(3, 4).to(FP8).requires_grad_(), torch.randn(4, 2)), TypeError,
     "a is float8_e4m3fn and requires grad"),
    (lambda: kf.gemm(torch.randn(3, 4), torch.randn(4, 2), precision="fp8", scale_a=torch.ones(1).int()), TypeError,
     "scale_a must have dtype in"),
])
def test_bad_fp8_input_is_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_fp8_is_a_precision_mode_of_the_policy():
    a, b = torch.randn(5, 32), torch.randn(32, 6)
    with kf.precision("fp8"):
        out = kf.gemm(a, b)
    qa, sa = quantize(a, "row", -1)
    qb, sb = quantize(b, "row", -2)
    torch.testing.assert_close(out, ((qa.float() @ qb.float()) * sa * sb), rtol=1e-5, atol=1e-5)
