"""kernelforge.gemm: every backend against the float64 oracle (outputs and the gradients of
a, b, bias and residual), every epilogue combination, odd shapes, transposed / strided /
broadcast operands, batches, precision modes, empty inputs, opcheck, torch.compile, double
backward, backend selection and bad input."""
import pytest
import torch
import torch.nn.functional as F

import kernelforge as kf
from kernelforge.ops import gemm as gemm_ops
from kernelforge.reference import gemm as reference
from tests.conftest import backend_cases, device_cases
from tests.numerics import assert_compiled_matches_eager, assert_matches_oracle, same_layout

# these tests spy on or swap the launchers' Python, which a replayed eager plan does not run
pytestmark = pytest.mark.usefixtures("no_eager_plans")

GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TORCH_ACT = {None: lambda z: z, "gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
             "silu": F.silu, "relu": torch.relu}


def dtypes_for(backend, device):
    if backend == "cuda":  # the CUDA kernel computes at the 16-bit operands' own dtype
        return [torch.float16, torch.bfloat16]
    if backend == "reference":
        return GPU_DTYPES + [torch.float64]
    if device == "cpu":  # the interpreter's bf16 tl.dot is wrong: bf16 Triton is GPU-only
        return [torch.float32, torch.float16]
    return GPU_DTYPES


def torch_gemm(a, b, bias=None, activation=None, residual=None):
    """What a user writes in eager PyTorch, at the inputs' dtype (the 2x-PyTorch yardstick;
    in float64, the oracle)."""
    z = torch.matmul(a, b)
    if bias is not None:
        z = z + bias.to(z.dtype)
    y = TORCH_ACT[activation](z)
    return y if residual is None else y + residual.to(y.dtype)


def term_scale(a, b):
    """max over outputs of sum_k |a_ik b_kj|: the scale of a dot product's rounding errors,
    which cancellation does not shrink."""
    if a.numel() == 0 or b.numel() == 0:
        return 0.0
    return torch.matmul(a.detach().double().abs(), b.detach().double().abs()).max().item()


# tf32 keeps float16's 10 mantissa bits: the same ulp
GRAD_FLOOR_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float16}


def check(backend, device, dtype, a, b, bias=None, activation=None, residual=None, precision="auto",
          yardstick=None, what="", select=kf.use_backend):
    """kf.gemm on `backend` against float64 autograd of the same expression, outputs and
    every input gradient, with the same computation at `dtype` as the yardstick (or
    `yardstick`, a function of the inputs, for a precision other than the inputs'). `select`:
    how the backend is set (kf.prefer_backend for one that only some ops of the backward have)."""
    inputs = [a, b, bias, residual]
    mine = [None if t is None else same_layout(t).requires_grad_() for t in inputs]
    theirs = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    exact = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    with select(backend):
        out = kf.gemm(mine[0], mine[1], bias=mine[2], activation=activation, residual=mine[3], precision=precision)
    same = (yardstick or torch_gemm)(theirs[0], theirs[1], theirs[2], activation, theirs[3])
    oracle = torch_gemm(exact[0], exact[1], exact[2], activation, exact[3])
    K = a.shape[-1]
    label = f"{backend} {dtype} {what} a{tuple(a.shape)} b{tuple(b.shape)} act={activation} precision={precision}"
    assert out.shape == oracle.shape and out.dtype == dtype and out.device == a.device, label
    scale = term_scale(a, b)
    assert_matches_oracle(out, same.to(dtype), oracle, f"{label} out", reduced=K, terms_scale=scale)
    if out.numel() == 0:
        return
    grad = torch.randn_like(out)
    with select(backend):
        got = torch.autograd.grad(out, [t for t in mine if t is not None], grad)
    want = torch.autograd.grad(oracle, [t for t in exact if t is not None], grad.double())
    base = torch.autograd.grad(same, [t for t in theirs if t is not None], grad.to(same.dtype))
    names = [n for n, t in zip(("a", "b", "bias", "residual"), inputs) if t is not None]
    rows = out.numel() // out.shape[-1]
    g_scale = {"a": term_scale(grad, b.transpose(-1, -2)) * 1.2, "b": term_scale(a.transpose(-1, -2), grad) * 1.2,
               "bias": grad.abs().sum().item(), "residual": 0.0}
    reduced = {"a": out.shape[-1], "b": rows, "bias": rows, "residual": 1}
    # At a precision narrower than the inputs, the backward GEMMs round the incoming gradient to
    # it as well, which the yardstick's autograd (rounding the operands only) does not: one more
    # rounding at that precision, so the gradients' floor is one of its ulps at the terms' scale.
    floor_dtype = GRAD_FLOOR_DTYPES.get(precision) if yardstick is not None else None
    for name, g, w, s, t in zip(names, got, want, base, [t for t in inputs if t is not None]):
        assert g.shape == t.shape and g.dtype == t.dtype, f"{label} grad {name}"
        assert_matches_oracle(g, s.to(g.dtype), w, f"{label} grad {name}", reduced=reduced[name],
                              terms_scale=g_scale[name], floor_dtype=floor_dtype)


def operands(device, dtype, batch_a, batch_b, M, K, N):
    a = torch.randn(*batch_a, M, K, device=device, dtype=dtype)
    b = torch.randn(*batch_b, K, N, device=device, dtype=dtype) / K ** 0.5
    return a, b


# ----------------------------------------------------------------------------- accuracy
# (batch_a, batch_b, M, K, N): odd sizes, one-element dims, a tile edge crossed in each dim,
# a b shared across a's batch (folded into rows), both batched, a broadcast against b's batch.
SHAPES = [((), (), 1, 1, 1), ((), (), 7, 13, 5), ((), (), 33, 65, 17), ((2,), (), 19, 24, 40),
          ((2, 3), (3,), 9, 20, 11), ((1,), (4,), 16, 33, 8)]
SHAPE_IDS = ["1x1x1", "7x13x5", "33x65x17", "batch2-shared-b", "batch2x3-b3", "a-broadcast"]


def _params(backends=("reference", "triton")):
    out = []
    for bc in backend_cases(backends):
        backend, device = bc.values
        for dtype in dtypes_for(backend, device):
            out.append(pytest.param(backend, device, dtype, marks=bc.marks, id=f"{bc.id}-{str(dtype)[6:]}"))
    return out


@pytest.mark.parametrize("backend,device,dtype", _params())
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_matches_oracle(backend, device, dtype, shape):
    batch_a, batch_b, M, K, N = shape
    a, b = operands(device, dtype, batch_a, batch_b, M, K, N)
    bias = torch.randn(N, device=device, dtype=dtype)
    out_batch = torch.broadcast_shapes(batch_a, batch_b)
    residual = torch.randn(*out_batch, M, N, device=device, dtype=dtype)
    check(backend, device, dtype, a, b, bias, "gelu_tanh", residual)
    check(backend, device, dtype, a, b)


@pytest.mark.parametrize("backend,device,dtype", _params())
@pytest.mark.parametrize("activation", gemm_ops.ACTIVATIONS, ids=[str(a) for a in gemm_ops.ACTIVATIONS])
def test_every_epilogue(backend, device, dtype, activation):
    a, b = operands(device, dtype, (), (), 37, 29, 23)
    bias = torch.randn(23, device=device, dtype=dtype)
    residual = torch.randn(37, 23, device=device, dtype=dtype)
    for with_bias in (False, True):
        for with_residual in (False, True):
            check(backend, device, dtype, a, b, bias if with_bias else None, activation,
                  residual if with_residual else None, what=f"bias={with_bias} residual={with_residual}")


@pytest.mark.parametrize("backend,device,dtype", _params())
def test_strided_transposed_and_broadcast_operands(backend, device, dtype):
    K, M, N = 24, 21, 18
    weight = torch.randn(N, K, device=device, dtype=dtype) / K ** 0.5  # nn.Linear's layout: b = weight.t()
    cases = {
        "b transposed (a Linear weight)": (torch.randn(M, K, device=device, dtype=dtype), weight.t()),
        "a transposed": (torch.randn(K, M, device=device, dtype=dtype).t(), weight.t().contiguous()),
        "every other column": (torch.randn(M, 2 * K, device=device, dtype=dtype)[:, ::2], weight.t()),
        "batched a, transposed batch": (torch.randn(M, 3, K, device=device, dtype=dtype).transpose(0, 1), weight.t()),
        "expanded a rows": (torch.randn(1, K, device=device, dtype=dtype).expand(M, K), weight.t()),
    }
    bias = torch.randn(N, device=device, dtype=torch.float32)  # a float32 bias with any operand dtype
    for label, (a, b) in cases.items():
        check(backend, device, dtype, a, b, bias.to(dtype), "silu", what=label)
    every_other = torch.randn(2 * N, device=device, dtype=dtype)[::2]  # a bias whose stride is not 1
    check(backend, device, dtype, cases["b transposed (a Linear weight)"][0], weight.t(), every_other, "silu",
          what="strided bias")
    a = torch.randn(2, M, K, device=device, dtype=dtype)
    for label, residual in {"residual (N,)": torch.randn(N, device=device, dtype=dtype),
                            "residual (M, 1)": torch.randn(M, 1, device=device, dtype=dtype),
                            "residual (2, 1, N)": torch.randn(2, 1, N, device=device, dtype=dtype)}.items():
        check(backend, device, dtype, a, weight.t(), None, "relu", residual, what=label)


@pytest.mark.parametrize("backend,device,dtype", _params(("cuda",)))
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_cuda_backend_through_the_op(backend, device, dtype, shape):
    # The CUDA extension as the op's backend (its own tests, tests/cuda/test_gemm_cuda.py, cover
    # layouts and every epilogue at the launcher). Forced, every op of the backward runs on
    # CUDA too: without an activation the backward is GEMMs and a sum, all of which it has.
    batch_a, batch_b, M, K, N = shape
    a, b = operands(device, dtype, batch_a, batch_b, M, K, N)
    bias = torch.randn(N, device=device, dtype=dtype)
    residual = torch.randn(*torch.broadcast_shapes(batch_a, batch_b), M, N, device=device, dtype=dtype)
    check(backend, device, dtype, a, b, bias, None, residual)
    check(backend, device, dtype, a.transpose(-1, -2).contiguous().transpose(-1, -2), b)
    with torch.no_grad(), kf.use_backend(backend):
        out = kf.gemm(a, b, bias=bias, activation="gelu_tanh", residual=residual)
    oracle = torch_gemm(a.double(), b.double(), bias.double(), "gelu_tanh", residual.double())
    same = torch_gemm(a, b, bias, "gelu_tanh", residual)
    assert_matches_oracle(out, same, oracle, f"cuda gelu_tanh {shape}", reduced=K, terms_scale=term_scale(a, b))


@pytest.mark.parametrize("backend,device", backend_cases(("triton",)))
@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointers"])
def test_both_triton_kernels_on_every_layout(backend, device, use_tma, monkeypatch):
    # The TMA kernel takes one matrix of 16-bit operands with 16-byte-aligned rows, either
    # memory order; the pointer kernel takes anything. Forced each way here (the GPU's own
    # rule sends these 70-row products through TMA); the backward's GEMMs read the operands
    # transposed, so each layout reaches both kernels in both orders. N = 52 (104-byte rows)
    # is one TMA cannot read: it falls back to pointers.
    from kernelforge.triton import gemm as triton_gemm

    launches = []
    launch_tma = triton_gemm._TmaLaunch.__call__

    def counted(self, *tensors):
        launches.append(tensors)
        return launch_tma(self, *tensors)

    monkeypatch.setattr(triton_gemm, "USE_TMA", use_tma)
    monkeypatch.setattr(triton_gemm._TmaLaunch, "__call__", counted)
    M, K, N = 70, 40, 56
    for dtype in [torch.float16] + ([torch.bfloat16] if device == "cuda" else []):
        weight = torch.randn(N, K, device=device, dtype=dtype) / K ** 0.5
        layouts = {"a rows, b = Linear weight^T": (torch.randn(M, K, device=device, dtype=dtype), weight.t()),
                   "a^T, b rows": (torch.randn(K, M, device=device, dtype=dtype).t(), weight.t().contiguous())}
        for label, (a, b) in layouts.items():
            bias = torch.randn(N, device=device, dtype=dtype)
            residual = torch.randn(M, N, device=device, dtype=dtype)
            check(backend, device, dtype, a, b, bias, "gelu_tanh", residual, what=f"{label} tma={use_tma}")
    assert bool(launches) == use_tma
    launches.clear()
    a, b = torch.randn(M, K, device=device, dtype=torch.float16), torch.randn(K, 52, device=device, dtype=torch.float16)
    check(backend, device, torch.float16, a, b / K ** 0.5, None, "relu", what="unaligned rows")
    assert not launches


@pytest.mark.parametrize("backend,device", backend_cases(("triton",)))
@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointers"])
def test_tf32_on_both_triton_kernels(backend, device, use_tma, monkeypatch):
    # tf32 through TMA: a separate pass rounds the float32 operands into K-major copies, the
    # tensor cores take them as they are. Forced each way, gradients included (the backward's
    # GEMMs take the transposed operands through the same path).
    from kernelforge.triton import gemm as triton_gemm

    copies = []
    tf32_copy = triton_gemm._tf32_copy

    def counted(t, k_dim):
        copies.append(k_dim)
        return tf32_copy(t, k_dim)

    monkeypatch.setattr(triton_gemm, "USE_TMA", use_tma)
    monkeypatch.setattr(triton_gemm, "_tf32_copy", counted)
    M, K, N = 70, 40, 56
    weight = torch.randn(N, K, device=device) / K ** 0.5

    def yardstick(x, w, bias_, activation, residual):
        xr, wr = reference.operands(x, w, "tf32")
        return torch_gemm(xr, wr, bias_, activation, residual)

    for label, (a, b) in {"a rows, b = Linear weight^T": (torch.randn(M, K, device=device), weight.t()),
                          "a^T, b rows": (torch.randn(K, M, device=device).t(), weight.t().contiguous())}.items():
        check(backend, device, torch.float32, a, b, torch.randn(N, device=device), "gelu_tanh",
              torch.randn(M, N, device=device), precision="tf32", yardstick=yardstick, what=f"{label} tma={use_tma}")
    assert bool(copies) == use_tma


def record_tma_splits(monkeypatch):
    """Force the TMA kernel and return the list each of its launches appends its slice
    count to: the interpreter's, or the config the autotuner chose on the GPU."""
    from kernelforge.triton import gemm as triton_gemm

    splits = []
    launch = triton_gemm._TmaLaunch.__call__

    def recorded(self, *tensors):
        launch(self, *tensors)
        splits.append(self.chosen[4])  # chosen by the call's signature's first call (the tuner, or the interpreter's)

    monkeypatch.setattr(triton_gemm, "USE_TMA", True)
    monkeypatch.setattr(triton_gemm._TmaLaunch, "__call__", recorded)
    return splits


@pytest.mark.parametrize("backend,device", backend_cases(("triton",)))
@pytest.mark.parametrize("split", [2, 3, 5])
def test_split_k(backend, device, split, monkeypatch):
    # Split-K: each tile's K in `split` slices, float32 partials; the last slice of a tile to
    # finish sums them in order and runs the epilogue. Forced here on the TMA kernel (on the
    # GPU the autotuner may split only products of few output tiles). K = 40 is 3 of the
    # interpreter's 16-deep K tiles, so 5 slices leave two empty; K = 300 gives every slice
    # several, and a partial last tile. The backward's GEMMs split too (the preact the split
    # forward saves feeds act').
    from kernelforge.triton import gemm as triton_gemm

    splits = record_tma_splits(monkeypatch)
    monkeypatch.setattr(triton_gemm, "SPLIT_K", split)
    M, N = 70, 56
    for K in (40, 300):
        for dtype in [torch.float16] + ([torch.bfloat16] if device == "cuda" else []):
            a = torch.randn(M, K, device=device, dtype=dtype)
            weight = torch.randn(N, K, device=device, dtype=dtype) / K ** 0.5
            bias, residual = torch.randn(N, device=device, dtype=dtype), torch.randn(M, N, device=device, dtype=dtype)
            check(backend, device, dtype, a, weight.t(), bias, "gelu_tanh", residual, what=f"split {split} K {K}")
            check(backend, device, dtype, a, weight.t(), what=f"split {split} K {K} plain")
    assert splits and set(splits) == {split}


@pytest.mark.parametrize("M,N,K,sms,choices", [
    (128, 4096, 4096, 132, (1, 2, 4)),  # 32 tiles of 128 x 128
    (16, 4096, 14336, 132, (1, 2, 4)),
    (128, 14336, 4096, 132, (1,)),  # 112 tiles: more than half the SMs already
    (4096, 4096, 4096, 132, (1,)),
    (128, 4096, 1024, 132, (1, 2)),  # slices of 512 at least
    (128, 4096, 4096, 60, (1,)),  # fewer SMs
])
def test_split_k_choices(M, N, K, sms, choices, monkeypatch):
    from kernelforge.triton import gemm as triton_gemm

    assert triton_gemm._split_choices(M, N, K, sms) == choices
    monkeypatch.setattr(triton_gemm, "SPLIT_K", 3)
    assert triton_gemm._split_choices(M, N, K, sms) == (3,)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_precision_modes(backend, device):
    # float32 inputs computed at 16 bits, float16 inputs at float32: the yardstick is PyTorch
    # on operands rounded the same way (kernelforge/reference/gemm.py says what each mode means).
    a, b = operands(device, torch.float32, (), (), 30, 40, 20)
    bias = torch.randn(20, device=device)
    modes = ["fp16", "tf32", "fp32"] + (["bf16"] if backend == "reference" or device == "cuda" else [])
    for mode in modes:
        def yardstick(x, w, bias_, activation, residual, mode=mode):
            xr, wr = reference.operands(x, w, mode)
            return torch_gemm(xr, wr, bias_, activation, residual)

        check(backend, device, torch.float32, a, b, bias, "gelu", precision=mode, yardstick=yardstick, what=mode)
    a16, b16 = a.half(), b.half()
    check(backend, device, torch.float16, a16, b16, bias.half(), "gelu", precision="fp32",
          yardstick=lambda x, w, bi, act, r: torch_gemm(x.float(), w.float(), bi.float(), act, r), what="fp32")


def test_reference_tf32_rounding():
    x = torch.tensor([1.0 + 2 ** -11, 1.0 + 2 ** -10 + 2 ** -11, -(1.0 + 3 * 2 ** -12), float("inf"), float("nan")])
    got = reference.round_to_tf32(x)
    assert got[0].item() == 1.0 + 2 ** -10  # a tie rounds away from zero
    assert got[1].item() == 1.0 + 2 ** -9
    assert got[2].item() == -(1.0 + 2 ** -10)
    assert got[3].item() == float("inf") and got[4].isnan()


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_output_dtype_and_mixed_inputs(backend, device):
    a = torch.randn(5, 6, device=device, dtype=torch.float16)
    b = torch.randn(6, 7, device=device, dtype=torch.float32)
    with kf.use_backend(backend):
        out = kf.gemm(a, b, precision="fp32")
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, a.float() @ b)
        out16 = kf.gemm(a, b, precision="fp16", out_dtype=torch.float16)
        assert out16.dtype == torch.float16
        torch.testing.assert_close(out16, (a @ b.half()), rtol=2e-3, atol=2e-3)
    with pytest.raises(TypeError, match="same dtype"):
        kf.gemm(a, b)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_empty_inputs(backend, device):
    bias = torch.randn(3, device=device)
    with kf.use_backend(backend):
        assert kf.gemm(torch.randn(0, 4, device=device), torch.randn(4, 3, device=device)).shape == (0, 3)
        assert kf.gemm(torch.randn(2, 0, 4, device=device), torch.randn(4, 3, device=device)).shape == (2, 0, 3)
        # K = 0: the product is zeros, the epilogue still runs
        out = kf.gemm(torch.randn(5, 0, device=device), torch.randn(0, 3, device=device), bias=bias, activation="gelu")
    torch.testing.assert_close(out, F.gelu(bias).expand(5, 3))


# ----------------------------------------------------------------------------- the registered op
@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_opcheck(backend, device):
    a = torch.randn(2, 9, 12, device=device, requires_grad=True)
    b = torch.randn(12, 10, device=device, requires_grad=True)
    bias = torch.randn(10, device=device, requires_grad=True)
    residual = torch.randn(9, 10, device=device, requires_grad=True)
    with kf.use_backend(backend):
        for args in ((a, b, bias, residual, "gelu", "fp32", torch.float32, True),
                     (a, b, None, None, "none", "fp32", torch.float32, False),
                     (a, b.detach().t().contiguous().t(), bias, None, "silu", "fp16", torch.float32, False)):
            torch.library.opcheck(torch.ops.kernelforge.gemm.default, args)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_torch_compile_matches_eager(backend, device):
    a = torch.randn(3, 17, 20, device=device, requires_grad=True)
    b = torch.randn(20, 11, device=device, requires_grad=True)
    bias = torch.randn(11, device=device, requires_grad=True)

    def f(a, b, bias):
        return kf.gemm(a, b, bias=bias, activation="gelu").square().sum()

    compiled = torch.compile(f, backend="aot_eager" if device == "cpu" else "inductor", fullgraph=True)
    with kf.use_backend(backend):
        assert_compiled_matches_eager(f, compiled, (a, b, bias))


def test_double_backward_float64():
    a = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, requires_grad=True)
    residual = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)

    def f(a, b, bias, residual):
        return kf.gemm(a, b, bias=bias, activation="gelu", residual=residual)

    assert torch.autograd.gradcheck(f, (a, b, bias, residual))
    assert torch.autograd.gradgradcheck(f, (a, b, bias, residual))


def test_direct_op_call_without_saved_preact_still_differentiates():
    a = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    out = torch.ops.kernelforge.gemm(a, b, None, None, "silu", "fp64", torch.float64, False)[0]
    got = torch.autograd.grad(out.sum(), (a, b))
    want = torch.autograd.grad(F.silu(a @ b).sum(), (a, b))
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y)


# ----------------------------------------------------------------------------- selection and errors
def test_explain_names_the_gemm_backends():
    a, b = torch.randn(4, 5), torch.randn(5, 6)
    assert "reference" in kf.explain("gemm", a, b, compute="fp32")


@pytest.mark.parametrize("call,error,match", [
    (lambda: kf.gemm(torch.randn(3), torch.randn(3, 2)), ValueError, "a must have at least 2 dims"),
    (lambda: kf.gemm(torch.randn(3, 4), torch.randn(5, 2)), RuntimeError, r"a's last dim \(4\) must equal"),
    (lambda: kf.gemm(torch.randn(2, 3, 4), torch.randn(3, 4, 2)), ValueError, "do not broadcast"),
    (lambda: kf.gemm(torch.randn(3, 4), torch.randn(4, 2), bias=torch.randn(3)), RuntimeError,
     r"bias must have shape \(2,\)"),
    (lambda: kf.gemm(torch.randn(3, 4), torch.randn(4, 2), residual=torch.randn(4, 2)), ValueError,
     "residual of shape"),
    (lambda: kf.gemm(torch.randn(3, 4), torch.randn(4, 2), activation="tanh"), ValueError, "activation must be one of"),
    (lambda: kf.gemm(torch.randn(3, 4), torch.randn(4, 2), precision="fp4"), ValueError, "precision must be one of"),
    (lambda: kf.gemm(torch.randn(3, 4).int(), torch.randn(4, 2), precision="fp32"), TypeError, "a must have dtype"),
    (lambda: kf.gemm(torch.randn(3, 4), torch.randn(4, 2), out_dtype=torch.int32), TypeError, "out_dtype"),
    (lambda: kf.gemm(torch.randn(3, 4), torch.randn(4, 2), precision="fp64"), ValueError, "precision must be one of"),
])
def test_bad_input_is_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("backend,device", backend_cases(("triton",)))
def test_triton_refuses_float64(backend, device):
    a = torch.randn(3, 4, dtype=torch.float64, device=device)
    with kf.use_backend("triton"), pytest.raises(kf.BackendUnsupportedError, match="computes in"):
        kf.gemm(a, a.t())


@pytest.mark.parametrize("device", device_cases())
def test_transposed_weight_gets_its_gradient_in_the_weights_layout(device):
    """b = W.t() (a Linear's weight read in place): the gradient autograd hands to W.t() is W's
    gradient transposed in place, so W's arrives dense in W's layout and AccumulateGrad need not copy
    it (it copies a gradient whose strides differ from the parameter's)."""
    w = torch.randn(24, 40, device=device)
    x = torch.randn(3, 7, 40, device=device)
    seen = []
    w_t = w.clone().requires_grad_()
    view = w_t.t()
    view.register_hook(lambda g: seen.append(g.stride()))
    kf.gemm(x, view, activation="gelu").sum().backward()
    assert seen == [(1, 40)]
    expected = w.clone().requires_grad_()
    torch.nn.functional.gelu(torch.nn.functional.linear(x, expected)).sum().backward()
    torch.testing.assert_close(w_t.grad, expected.grad, rtol=1e-4, atol=1e-4)
