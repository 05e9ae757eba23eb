"""Activations (gelu, gelu_tanh, silu, relu), bias + activation and gated activations
(swiglu / geglu, separate and packed): every backend against the float64 oracle,
gradients (bias gradient included), layouts, edge cases, the registered ops (opcheck),
torch.compile, the nn modules, backend selection and bad input."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import kernelforge as kf
from kernelforge.nn.activations import GELU, SiLU, SwiGLU
from kernelforge.ops import activations as ops
from kernelforge.ops import gated_activations as gated
from kernelforge.reference import activations as reference
from tests.conftest import backend_cases
from tests.numerics import assert_matches_oracle, same_layout

KINDS = reference.KINDS
GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# kind -> torch's own function (the same-dtype baseline and, in float64, the oracle)
TORCH_ACT = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": torch.relu,
}


# The CUDA extension implements bias + gelu / gelu_tanh only (kernelforge.ops.activations
# says so in its support predicate), so its cases cover exactly those; the gated ops have
# no CUDA implementation.
GATED_BACKENDS = ("reference", "triton")


def kinds_for(backend):
    return ops.CUDA_KINDS if backend == "cuda" else KINDS


def act_cases():
    """(backend, device, kind) for every kind each backend implements."""
    return [pytest.param(*case.values, kind, marks=case.marks, id=f"{case.id}-{kind}")
            for case in backend_cases() for kind in kinds_for(case.values[0])]


def gated_cases():
    return [pytest.param(*case.values, kind, marks=case.marks, id=f"{case.id}-{kind}")
            for case in backend_cases(GATED_BACKENDS) for kind in KINDS]


def dtypes_for(backend, device):
    if backend == "reference":
        return GPU_DTYPES + [torch.float64]
    if device == "cpu":
        # Triton's interpreter rounds bfloat16 stores wrongly (1 ulp off against a
        # round-to-nearest cast, seen here on gelu and silu), so bf16 Triton is GPU-only.
        return [torch.float32, torch.float16]
    return GPU_DTYPES


KF_ACT = {
    "gelu": ops.gelu,
    "gelu_tanh": lambda x: ops.gelu(x, approximate="tanh"),
    "silu": ops.silu,
    "relu": ops.relu,
}


def kf_activation(kind, x, bias=None):
    """The public function for kind (with a bias: bias_gelu / bias_silu, or the registered
    op for relu, which has no public bias form)."""
    if bias is None:
        return KF_ACT[kind](x)
    if kind in ("gelu", "gelu_tanh"):
        return ops.bias_gelu(x, bias, "tanh" if kind == "gelu_tanh" else "none")
    if kind == "silu":
        return ops.bias_silu(x, bias)
    return torch.ops.kernelforge.activation(x, bias, kind)


def kf_gated(kind, gate, up=None):
    if kind == "silu":
        return gated.swiglu(gate, up)
    if kind in ("gelu", "gelu_tanh"):
        return gated.geglu(gate, up, "tanh" if kind == "gelu_tanh" else "none")
    return torch.ops.kernelforge.gated_activation(gate, up, kind) if up is not None else \
        torch.ops.kernelforge.gated_activation_packed(gate, kind)


def torch_gated(kind, gate, up=None):
    if up is None:
        gate, up = gate.chunk(2, -1)
    return TORCH_ACT[kind](gate) * up


def leaf_copies(*tensors):
    return [same_layout(t).requires_grad_() for t in tensors]


def compare_with_oracle(what, ours_fn, torch_fn, inputs, reduced_over_rows=()):
    """Run ours (under the forced backend), torch at the same dtype and torch in float64 on
    the same inputs; compare outputs and every input gradient. reduced_over_rows: indices
    of inputs whose gradient is the row sum of input 0's gradient (a bias: d(x + b)), for
    the accuracy floor. In float32 those sums cancel: terms of either sign add to an output
    smaller than they are, and the accumulation rounds at the partial sums' scale, so the
    floor is taken at sum |term| per column (100 draws each at 2x5x6x4, 300x33, 2x4097: up
    to 6 ulp at the output's scale, at most 1.14 ulp of sum |term|). In float16/bfloat16
    the fp32 accumulation is exact enough that the output's one rounding dominates (at most
    0.5 ulp at the output's scale), so the floor stays there."""
    ours_in, torch_in = leaf_copies(*inputs), leaf_copies(*inputs)
    oracle_in = [t.detach().double().requires_grad_() for t in inputs]
    ours, same, oracle = ours_fn(*ours_in), torch_fn(*torch_in), torch_fn(*oracle_in)
    assert ours.shape == same.shape and ours.dtype == inputs[0].dtype and ours.device == inputs[0].device
    assert_matches_oracle(ours, same, oracle, what)
    if ours.numel() == 0:
        return ours
    g = torch.randn_like(same)
    ours.backward(g)
    same.backward(g)
    oracle.backward(g.double())
    rows = max(1, ours.numel() // max(1, ours.shape[-1])) if ours.dim() else 1
    column_terms = oracle_in[0].grad.abs().reshape(-1, ours.shape[-1]).sum(0).max().item() if ours.dim() else 0.0
    for i, (a, b, c) in enumerate(zip(ours_in, torch_in, oracle_in)):
        assert a.grad is not None, f"{what}: no gradient for input {i}"
        assert a.grad.dtype == a.dtype
        summed = i in reduced_over_rows and a.dtype == torch.float32
        assert_matches_oracle(a.grad, b.grad, c.grad, f"{what} grad[{i}]", reduced=rows if i in reduced_over_rows else 1,
                              terms_scale=column_terms if summed else 0.0)
    return ours


# ----------------------------------------------------------------------------- accuracy
SHAPES = [(3, 1), (4, 7), (2, 3, 199), (2, 4097), (17,), ()]
SHAPE_IDS = ["x".join(map(str, s)) or "scalar" for s in SHAPES]


@pytest.mark.parametrize("backend,device,kind", act_cases())
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_activation_matches_oracle(kind, backend, device, shape):
    for dtype in dtypes_for(backend, device):
        x = torch.randn(shape, device=device, dtype=dtype) * 3
        with kf.use_backend(backend):
            compare_with_oracle(f"{kind} {shape} {dtype} {backend}", lambda t: kf_activation(kind, t),
                                TORCH_ACT[kind], [x])


@pytest.mark.parametrize("backend,device,kind", act_cases())
@pytest.mark.parametrize("shape", [(3, 1), (4, 7), (2, 3, 199), (2, 4097), (300, 33)],
                         ids=["3x1", "4x7", "2x3x199", "2x4097", "300x33"])
def test_bias_activation_matches_oracle(kind, backend, device, shape):
    # 300 rows: the bias gradient is reduced over several row programs (two stages).
    for dtype in dtypes_for(backend, device):
        x = torch.randn(shape, device=device, dtype=dtype) * 3
        bias = torch.randn(shape[-1], device=device, dtype=dtype)
        with kf.use_backend(backend):
            compare_with_oracle(f"bias {kind} {shape} {dtype} {backend}", lambda t, b: kf_activation(kind, t, b),
                                lambda t, b: TORCH_ACT[kind](t + b), [x, bias], reduced_over_rows=(1,))


@pytest.mark.parametrize("backend,device", backend_cases())
def test_bias_of_another_dtype(backend, device):
    # A float32 bias on half activations (autocast's Linear output): y in x's dtype,
    # the bias gradient in the bias's.
    x = torch.randn(64, 40, device=device, dtype=torch.float16, requires_grad=True)
    bias = torch.randn(40, device=device, dtype=torch.float32, requires_grad=True)
    with kf.use_backend(backend):
        y = ops.bias_gelu(x, bias)
        g = torch.randn_like(y)
        y.backward(g)
    assert y.dtype == torch.float16 and x.grad.dtype == torch.float16 and bias.grad.dtype == torch.float32
    x64, b64 = x.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    y64 = F.gelu(x64 + b64)
    y64.backward(g.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(bias.grad.double(), b64.grad, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend,device,kind", gated_cases())
@pytest.mark.parametrize("shape", [(3, 1), (4, 7), (2, 3, 199), (2, 4097), (5,)],
                         ids=["3x1", "4x7", "2x3x199", "2x4097", "5"])
def test_gated_matches_oracle(kind, backend, device, shape):
    for dtype in dtypes_for(backend, device):
        gate = torch.randn(shape, device=device, dtype=dtype) * 3
        up = torch.randn(shape, device=device, dtype=dtype)
        packed = torch.cat([gate, up], -1)
        what = f"{kind} {shape} {dtype} {backend}"
        with kf.use_backend(backend):
            compare_with_oracle(f"gated {what}", lambda a, b: kf_gated(kind, a, b),
                                lambda a, b: torch_gated(kind, a, b), [gate, up])
            compare_with_oracle(f"packed gated {what}", lambda p: kf_gated(kind, p),
                                lambda p: torch_gated(kind, p), [packed])


@pytest.mark.parametrize("backend,device", backend_cases())
def test_large_magnitudes_stay_finite(backend, device):
    # |x| up to 100: exp(-x) overflows float32 past 88, so a naive sigmoid or 1 + tanh
    # form would make inf/NaN or lose everything to cancellation.
    x = torch.linspace(-100, 100, 4001, device=device)
    for kind in kinds_for(backend):
        with kf.use_backend(backend):
            compare_with_oracle(f"{kind} large {backend}", lambda t: kf_activation(kind, t), TORCH_ACT[kind], [x])


@pytest.mark.parametrize("backend,device", backend_cases())
def test_nan_propagates_like_torch(backend, device):
    x = torch.tensor([float("nan"), -1.0, 0.0, 2.0], device=device)
    with kf.use_backend(backend):
        for kind in kinds_for(backend):
            y = kf_activation(kind, x)
            assert torch.equal(y.isnan(), TORCH_ACT[kind](x).isnan()), kind


# ----------------------------------------------------------------------------- layouts
def strided_views(device):
    base = torch.randn(12, 80, device=device)
    return {
        "every-other-column": base[:, ::2],
        "transposed": base.t(),
        "column-slice": base[:, 3:71],
        "row-slice": base[::3],
        "broadcast": torch.randn(6, 1, device=device).expand(6, 50),
        "channels-last": torch.randn(2, 5, 6, 4, device=device).to(memory_format=torch.channels_last),
    }


@pytest.mark.parametrize("backend,device", backend_cases())
def test_strided_inputs(backend, device):
    with kf.use_backend(backend):
        for label, x in strided_views(device).items():
            bias = torch.randn(x.shape[-1], device=device)
            compare_with_oracle(f"gelu {label}", ops.gelu, F.gelu, [x])
            compare_with_oracle(f"bias gelu {label}", lambda t, b: ops.bias_gelu(t, b, "tanh"),
                                lambda t, b: F.gelu(t + b, approximate="tanh"), [x, bias], reduced_over_rows=(1,))


@pytest.mark.parametrize("backend,device", backend_cases(GATED_BACKENDS))
def test_strided_gated_inputs(backend, device):
    with kf.use_backend(backend):
        for label, x in strided_views(device).items():
            up = torch.randn(x.shape, device=device)
            compare_with_oracle(f"swiglu {label}", gated.swiglu, lambda a, b: F.silu(a) * b, [x, up])
            compare_with_oracle(f"swiglu {label} (up strided)", gated.swiglu, lambda a, b: F.silu(a) * b, [up, x])
            if x.shape[-1] % 2 == 0:
                compare_with_oracle(f"packed swiglu {label}", gated.swiglu, lambda p: torch_gated("silu", p), [x])


LAYOUTS = {"transposed": lambda device: torch.randn(9, 5, device=device).t(),
           "channels-last": lambda device: torch.randn(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last)}


@pytest.mark.parametrize("backend,device", backend_cases())
def test_elementwise_output_keeps_input_layout(backend, device):
    # Without a bias the op is elementwise: a transposed or channels-last input is read in
    # place and the result has its strides, as torch's own elementwise ops do.
    with kf.use_backend(backend):
        for make in LAYOUTS.values():
            x = make(device)
            assert ops.gelu(x).stride() == F.gelu(x).stride()


@pytest.mark.parametrize("backend,device", backend_cases(GATED_BACKENDS))
def test_gated_output_keeps_gate_layout(backend, device):
    with kf.use_backend(backend):
        for make in LAYOUTS.values():
            x = make(device)
            assert gated.swiglu(x, torch.randn_like(x)).stride() == x.stride()


@pytest.mark.parametrize("name", ["activation", "gated_activation", "gated_activation_packed"])
def test_output_layout_matches_fake(name):
    # The fake implementation must predict the real output's strides (torch.compile relies on it).
    op = getattr(torch.ops.kernelforge, name)
    for x in (torch.randn(4, 5, 6), torch.randn(4, 5, 6).transpose(0, 2), torch.randn(6, 4)[:, ::2],
              torch.randn(2, 4, 3, 6).to(memory_format=torch.channels_last)):
        args = {"activation": (x, None, "gelu"), "gated_activation": (x, torch.randn(x.shape), "silu"),
                "gated_activation_packed": (x, "silu")}[name]
        real = op(*args)
        with torch._subclasses.FakeTensorMode() as mode:
            fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        assert real.shape == fake.shape and real.stride() == fake.stride()


EMPTY_SHAPES = [(0, 6), (6, 0), (2, 0, 4)]
EMPTY_IDS = ["0x6", "6x0", "2x0x4"]


@pytest.mark.parametrize("backend,device", backend_cases())
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=EMPTY_IDS)
def test_empty(backend, device, shape):
    with kf.use_backend(backend):
        x = torch.randn(shape, device=device, requires_grad=True)
        bias = torch.randn(shape[-1], device=device, requires_grad=True)
        outputs = [ops.gelu(x), ops.bias_gelu(x, bias)]
        sum(y.sum() for y in outputs).backward()
    assert outputs[0].shape == outputs[1].shape == x.shape
    assert x.grad.shape == x.shape
    assert torch.equal(bias.grad, torch.zeros_like(bias))


@pytest.mark.parametrize("backend,device", backend_cases(GATED_BACKENDS))
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=EMPTY_IDS)
def test_empty_gated(backend, device, shape):
    with kf.use_backend(backend):
        gate = torch.randn(shape, device=device, requires_grad=True)
        up = torch.randn(shape, device=device, requires_grad=True)
        separate, packed = gated.swiglu(gate, up), gated.swiglu(gate)
        (separate.sum() + packed.sum()).backward()
    assert separate.shape == gate.shape
    assert packed.shape == (*shape[:-1], shape[-1] // 2)
    assert gate.grad.shape == gate.shape and up.grad.shape == up.shape


# ----------------------------------------------------------------------------- bias gradient reduction
def test_triton_bias_grad_two_stage_reduction_is_deterministic():
    # Drive the launcher with 1, 3 and 16 row programs and two tile shapes: each gives
    # the column sums of grad_x to float32 accuracy, and a repeat is bitwise identical.
    from kernelforge.triton import activations as triton_act

    x = torch.randn(41, 70)  # 11 row tiles of 4, 3 column blocks of 32: ragged both ways
    g = torch.randn(41, 70)
    bias = torch.randn(70)
    z = (x.double() + bias.double())
    expected = (g.double() * reference.activation_derivative(z, "gelu")).sum(0)
    for config in (None, triton_act.TileConfig(4, 32, 4)):
        for programs in (1, 3, 16):
            runs = [triton_act.act_backward_rows(g, x, bias, "gelu", True, config=config,
                                                 bias_grad_row_programs=programs)[1] for _ in range(2)]
            assert torch.equal(runs[0], runs[1])
            torch.testing.assert_close(runs[0].double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend,device", backend_cases())
def test_frozen_bias_takes_no_bias_gradient(backend, device):
    # A bias that needs no gradient goes through activation_backward (no reduction).
    x = torch.randn(5, 7, device=device, requires_grad=True)
    bias = torch.randn(7, device=device)
    with kf.use_backend(backend):
        y = ops.bias_gelu(x, bias)
        y.backward(torch.ones_like(y))
    assert bias.grad is None
    torch.testing.assert_close(x.grad, reference.activation_derivative(x.detach() + bias, "gelu"))


# ----------------------------------------------------------------------------- gradcheck
def _float64_cases():
    def x(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    for kind in KINDS:
        yield f"{kind}", (lambda t, k=kind: torch.ops.kernelforge.activation(t, None, k)), (x(3, 5),)
        yield f"bias {kind}", (lambda t, b, k=kind: torch.ops.kernelforge.activation(t, b, k)), (x(3, 5), x(5))
        yield f"gated {kind}", (lambda a, b, k=kind: torch.ops.kernelforge.gated_activation(a, b, k)), (x(3, 4), x(3, 4))
        yield f"packed {kind}", (lambda p, k=kind: torch.ops.kernelforge.gated_activation_packed(p, k)), (x(2, 3, 6),)
    # the public functions, through the eager fast path (its create_graph backward)
    yield "public bias_gelu", ops.bias_gelu, (x(3, 5), x(5))
    yield "public geglu", gated.geglu, (x(3, 4), x(3, 4))
    yield "public swiglu packed", gated.swiglu, (x(3, 8),)


@pytest.mark.parametrize("what,fn,inputs", list(_float64_cases()), ids=[c[0] for c in _float64_cases()])
def test_gradcheck_float64(what, fn, inputs):
    # Keep relu's inputs off 0, where it has no derivative for finite differences to find.
    for t in inputs:
        with torch.no_grad():
            t.add_(torch.sign(t) * 0.1)
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


# ----------------------------------------------------------------------------- registered ops
def activation_op_samples(device, kinds):
    """(op name, args) for the bias + activation ops on plain, strided and grad-requiring
    inputs (one kind per layout: the kinds share every code path but the kernel's math)."""
    strided = torch.randn(3, 20, device=device)[:, ::2]
    inputs = (torch.randn(4, 9, device=device), strided.t(), torch.randn(2, 3, 9, device=device, requires_grad=True))
    for i, t in enumerate(inputs):
        kind = kinds[i % len(kinds)]
        b = torch.randn(t.shape[-1], device=device)
        g = torch.randn(t.shape, device=device)
        yield "activation", (t, None, kind)
        yield "activation", (t, b.requires_grad_(t.requires_grad), kind)
        yield "activation_backward", (g, t.detach(), None, kind)
        yield "activation_backward", (g.requires_grad_(), t.detach().requires_grad_(), b.detach().requires_grad_(), kind)
        yield "bias_activation_backward", (g.detach().requires_grad_(), t.detach().requires_grad_(),
                                           b.detach().requires_grad_(), kind)


def gated_op_samples(device):
    strided = torch.randn(3, 20, device=device)[:, ::2]
    for t, kind in ((torch.randn(4, 9, device=device), "gelu"), (strided.t(), "silu")):
        up = torch.randn(t.shape, device=device, requires_grad=True)
        yield "gated_activation", (t.detach().requires_grad_(), up, kind)
        yield "gated_activation_backward", (torch.randn(t.shape, device=device, requires_grad=True),
                                            t.detach().requires_grad_(), up, kind)
        yield "gated_activation_backward_and_product", (torch.randn(t.shape, device=device), t.detach(),
                                                        up.detach(), kind)
    packed = torch.randn(2, 3, 10, device=device, requires_grad=True)
    yield "gated_activation_packed", (packed, "silu")
    yield "gated_activation_packed", (strided, "gelu")
    yield "gated_activation_packed_backward", (torch.randn(2, 3, 5, device=device, requires_grad=True), packed, "silu")


ACTIVATION_OPS = {"activation", "activation_backward", "bias_activation_backward"}
GATED_OPS = {"gated_activation", "gated_activation_backward", "gated_activation_backward_and_product",
             "gated_activation_packed", "gated_activation_packed_backward"}


def run_opchecks(backend, samples):
    tested = set()
    with kf.use_backend(backend):
        for name, args in samples:
            torch.library.opcheck(getattr(torch.ops.kernelforge, name).default, args)
            tested.add(name)
    return tested


@pytest.mark.parametrize("backend,device", backend_cases())
def test_opcheck_activation_ops(backend, device):
    assert run_opchecks(backend, activation_op_samples(device, kinds_for(backend))) == ACTIVATION_OPS


@pytest.mark.parametrize("backend,device", backend_cases(GATED_BACKENDS))
def test_backward_and_product_is_the_backward_and_the_forward(backend, device):
    # gated_activation_backward_and_product (gated_mlp's backward): the gradients of
    # gated_activation_backward and act(gate) * up as gated_activation makes it, from one pass; silu
    # and gelu_tanh form the product the forward's way (bit for bit), gelu rounds z * cdf once.
    for dtype in (torch.float32, torch.bfloat16):
        strided = torch.randn(5, 2 * 37, device=device, dtype=dtype)[:, ::2]
        for gate, kind in ((torch.randn(3, 4, 37, device=device, dtype=dtype) * 3, "silu"),
                           (strided, "gelu_tanh"), (torch.randn(2, 37, device=device, dtype=dtype), "gelu")):
            up, grad = torch.randn_like(gate), torch.randn_like(gate)
            with kf.use_backend(backend):
                grad_gate, grad_up, product = torch.ops.kernelforge.gated_activation_backward_and_product(
                    grad, gate, up, kind)
                want_gate, want_up = torch.ops.kernelforge.gated_activation_backward(grad, gate, up, kind)
                forward = torch.ops.kernelforge.gated_activation(gate, up, kind)
            label = f"{backend} {dtype} {kind}"
            assert torch.equal(grad_gate, want_gate) and torch.equal(grad_up, want_up), label
            assert product.shape == forward.shape and product.dtype == dtype, label
            if kind == "gelu":
                torch.testing.assert_close(product, forward, msg=label)
            else:
                assert torch.equal(product, forward), label


@pytest.mark.parametrize("backend,device", backend_cases(GATED_BACKENDS))
def test_opcheck_gated_ops(backend, device):
    assert run_opchecks(backend, gated_op_samples(device)) == GATED_OPS


def test_every_registered_op_is_opchecked():
    registered = {name for name in dir(torch.ops.kernelforge) if name.startswith(("activation", "bias_activation", "gated_activation"))}
    assert registered == ACTIVATION_OPS | GATED_OPS


def test_reference_is_the_definition():
    # The reference spells the math out; in float64 it agrees with torch to rounding
    # (outputs reach ~100 here: atol is a few ulp at that scale).
    x = torch.randn(7, 300, dtype=torch.float64) * 4
    close = {"rtol": 1e-14, "atol": 1e-13}
    for kind in KINDS:
        torch.testing.assert_close(reference.activation(x, kind), TORCH_ACT[kind](x), **close)
    gate, up = x[:, :150], x[:, 150:]
    torch.testing.assert_close(reference.swiglu(gate, up), F.silu(gate) * up, **close)
    torch.testing.assert_close(reference.geglu(gate, up, "tanh"), F.gelu(gate, approximate="tanh") * up, **close)


# ----------------------------------------------------------------------------- backend selection
def test_backend_rules():
    # measured on an H200: Triton's kernels are faster but for large gelu forwards, where CUDA's are
    cuda_like = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16, numel=lambda: 1 << 20)
    order, reason = ops._preference(cuda_like)
    assert order == ("cuda", "triton", "reference") and "forward from" in reason
    assert ops._preference(cuda_like, backward=True)[0] == ("triton", "cuda", "reference")
    small = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16, numel=lambda: (1 << 20) - 1)
    order, reason = ops._preference(small)
    assert order == ("triton", "cuda", "reference") and "less device time" in reason
    assert ops._choice_key(cuda_like) != ops._choice_key(small)
    assert ops._choice_key(cuda_like) != ops._choice_key(cuda_like, backward=True)
    assert ops._preference(torch.randn(2))[0] == ("reference",)
    assert "gelu and gelu_tanh only, got kind 'silu'" in ops._why_not_cuda(cuda_like, None, "silu")
    double_bias = SimpleNamespace(dtype=torch.float64)
    assert "got bias of torch.float64" in ops._why_not_cuda(cuda_like, double_bias, "gelu")
    # the gated ops have no CUDA implementation at all
    assert set(kf.backends.implementations("gated_activation")) == {"triton", "reference"}
    assert "runs on reference" in kf.explain("activation", torch.randn(3), bias=None, kind="silu")


def test_forced_backend_that_cannot_run_raises():
    x = torch.randn(3, 4, dtype=torch.float64)
    with kf.use_backend("triton"), pytest.raises(kf.BackendUnsupportedError, match="got x of torch.float64"):
        ops.gelu(x)
    with kf.use_backend("cuda"), pytest.raises(kf.BackendUnsupportedError, match="no cuda implementation"):
        gated.swiglu(x)


# ----------------------------------------------------------------------------- bad input
def test_bad_activation_inputs_are_rejected():
    x = torch.randn(3, 4)
    with pytest.raises(TypeError, match=r"kernelforge\.gelu: x must have dtype in .* got torch\.int64"):
        ops.gelu(torch.arange(6))
    with pytest.raises(TypeError, match=r"kernelforge\.bias_silu: bias must have dtype in .* got torch\.int32"):
        ops.bias_silu(x, torch.ones(4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"kernelforge\.bias_gelu: bias must have shape \(4,\) \(x's last dim\), got \(3,\)"):
        ops.bias_gelu(x, torch.randn(3))
    with pytest.raises(RuntimeError, match=r"bias must have shape \(4,\) .* got \(1, 4\)"):
        ops.bias_gelu(x, torch.randn(1, 4))
    with pytest.raises(RuntimeError, match=r"kernelforge\.bias_gelu: expected x, bias to have the same device, got x: cpu, bias: meta"):
        ops.bias_gelu(x, torch.randn(4, device="meta"))
    with pytest.raises(ValueError, match=r"kernelforge\.bias_gelu: x must have at least 1 dim .* got a 0-dim tensor"):
        ops.bias_gelu(torch.tensor(1.0), torch.randn(1))
    with pytest.raises(ValueError, match=r"kernelforge\.gelu: approximate must be 'none' or 'tanh', got 'fast'"):
        ops.gelu(x, "fast")
    with pytest.raises(ValueError, match=r"kernelforge\.activation: kind must be one of .* got 'tanh'"):
        torch.ops.kernelforge.activation(x, None, "tanh")


def test_bad_gated_inputs_are_rejected():
    gate = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"kernelforge\.swiglu: expected gate, up to have the same shape, got gate: \(3, 4\), up: \(4, 3\)"):
        gated.swiglu(gate, torch.randn(4, 3))
    with pytest.raises(RuntimeError, match=r"kernelforge\.geglu: expected gate, up to have the same dtype, got gate: torch.float32, up: torch.float16"):
        gated.geglu(gate, gate.half())
    with pytest.raises(RuntimeError, match=r"kernelforge\.swiglu: .*last dim, which must be even, got shape \(3, 5\)"):
        gated.swiglu(torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"kernelforge\.swiglu: gate must have at least 1 dim .* 0-dim"):
        gated.swiglu(torch.tensor(2.0))
    with pytest.raises(TypeError, match=r"kernelforge\.swiglu: gate must have dtype in .* got torch\.int64"):
        gated.swiglu(torch.ones(2, 4, dtype=torch.long))


def test_bad_backward_inputs_are_rejected():
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"gelu_backward: expected grad_output, x to have the same shape, got grad_output: \(4, 3\), x: \(3, 4\)"):
        torch.ops.kernelforge.activation_backward(torch.randn(4, 3), x, None, "gelu")
    with pytest.raises(RuntimeError, match=r"bias_silu_backward: expected grad_output, x to have the same dtype"):
        torch.ops.kernelforge.bias_activation_backward(x.half(), x, torch.randn(4), "silu")
    with pytest.raises(RuntimeError, match=r"swiglu_backward: expected grad_output, gate to have the same device, got grad_output: meta, gate: cpu"):
        torch.ops.kernelforge.gated_activation_backward(torch.randn(3, 4, device="meta"), x, x, "silu")
    with pytest.raises(RuntimeError, match=r"swiglu_backward: grad_output must have shape \(3, 2\) .* got \(3, 4\)"):
        torch.ops.kernelforge.gated_activation_packed_backward(x, x, "silu")


# ----------------------------------------------------------------------------- nn modules
@pytest.mark.parametrize("backend,device", backend_cases())
def test_nn_modules_match_torch(backend, device):
    x = torch.randn(5, 6, 8, device=device)
    with kf.use_backend(backend):
        torch.testing.assert_close(GELU()(x), torch.nn.GELU()(x))
        torch.testing.assert_close(GELU("tanh")(x), torch.nn.GELU("tanh")(x))
        if "silu" in kinds_for(backend):
            torch.testing.assert_close(SiLU()(x), torch.nn.SiLU()(x))


def test_nn_module_reprs_and_arguments_match_torch():
    assert repr(GELU()) == repr(torch.nn.GELU()) == "GELU(approximate='none')"
    assert repr(GELU(approximate="tanh")) == repr(torch.nn.GELU(approximate="tanh"))
    assert repr(SiLU()) == repr(torch.nn.SiLU()) == "SiLU()"
    with pytest.raises(ValueError, match="inplace=True is not supported"):
        SiLU(inplace=True)
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh'"):
        GELU("erf")


class LlamaFeedForward(torch.nn.Module):
    """Meta's Llama FeedForward, as its checkpoints are laid out."""

    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = torch.nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = torch.nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = torch.nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@pytest.mark.parametrize("backend,device", backend_cases(GATED_BACKENDS))
def test_swiglu_block_loads_llama_checkpoint(backend, device):
    llama = LlamaFeedForward(16, 40).to(device)
    block = SwiGLU(16, 40, device=device)
    assert set(block.state_dict()) == {"w1.weight", "w2.weight", "w3.weight"}
    block.load_state_dict(llama.state_dict())  # strict: same keys and shapes
    x = torch.randn(2, 3, 16, device=device)
    with kf.use_backend(backend):
        torch.testing.assert_close(block(x), llama(x))
        block(x).sum().backward()
    llama(x).sum().backward()
    torch.testing.assert_close(block.w1.weight.grad, llama.w1.weight.grad)
    torch.testing.assert_close(block.w3.weight.grad, llama.w3.weight.grad)
    assert set(SwiGLU(4, 8, bias=True).state_dict()) == {f"w{i}.{p}" for i in (1, 2, 3) for p in ("weight", "bias")}


# ----------------------------------------------------------------------------- eager fast path
FAST_PATH_CASES = {  # public function, the registered op, inputs, the Op the public function calls
    "bias_gelu": (lambda a, b: ops.bias_gelu(a, b, "tanh"), lambda a, b: torch.ops.kernelforge.activation(a, b, "gelu_tanh"),
                  lambda: (torch.randn(6, 5, 7).transpose(0, 1), torch.randn(7)), ops.activation_op),
    "silu": (ops.silu, lambda a: torch.ops.kernelforge.activation(a, None, "silu"),
             lambda: (torch.randn(6, 5, 7).transpose(0, 2),), ops.activation_op),
    "swiglu": (gated.swiglu, lambda a, b: torch.ops.kernelforge.gated_activation(a, b, "silu"),
               lambda: (torch.randn(6, 5).t(), torch.randn(5, 6)), gated.gated_activation_op),
    "swiglu packed": (gated.swiglu, lambda a: torch.ops.kernelforge.gated_activation_packed(a, "silu"),
                      lambda: (torch.randn(4, 3, 10)[:, :, :8],), gated.gated_activation_packed_op),
}


@pytest.mark.parametrize("case", FAST_PATH_CASES)
def test_eager_fast_path_equals_registered_op(case):
    # In plain eager mode the public functions skip the dispatcher (with their own autograd
    # glue when a gradient is needed); under a mode, a transform or torch.compile they go
    # through torch.ops. Both must give the same values, layout and gradients.
    public, via_op, make_inputs, op = FAST_PATH_CASES[case]
    inputs = make_inputs()
    fast, reference_out = public(*inputs), via_op(*inputs)
    assert torch.equal(fast, reference_out) and fast.stride() == reference_out.stride()
    a, b = leaf_copies(*inputs), leaf_copies(*inputs)
    ya, yb = public(*a), via_op(*b)
    assert op.is_eager_node(ya.grad_fn) and not op.is_eager_node(yb.grad_fn)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    for ta, tb in zip(a, b):
        assert torch.equal(ta.grad, tb.grad)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = public(*(mode.from_tensor(t) for t in inputs))
        assert fake.stride() == fast.stride()
    # vmap runs through the op too (functorch transforms are active inside)
    in_dims = tuple(None if t.dim() == 1 else 0 for t in inputs)  # a bias is shared, not mapped
    torch.testing.assert_close(torch.vmap(public, in_dims=in_dims)(*inputs), via_op(*inputs))
