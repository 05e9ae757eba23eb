"""ConvRNN: every backend against the float64 oracle (forward and backward through time), odd
sizes, layouts, empty inputs, the registered ops (opcheck, the CUDA kernels registered from
C++), torch.compile, and bad input."""
import pytest
import torch
import torch.nn.functional as F

import kernelforge as kf
from kernelforge.ops.convrnn import convrnn_op
from kernelforge.reference.convrnn import convrnn_backward as reference_backward
from kernelforge.reference.convrnn import convrnn_forward as reference_forward
from tests.conftest import backend_cases, device_cases, needs_cuda
from tests.numerics import assert_matches_oracle
from tests.op_paths import assert_eager_path_equals_registered_op, assert_inductor_launches, compiled_code

GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (batch, time, features, taps): odd features, one step, one feature, a tap wider than the row
SHAPES = [(2, 17, 33, 3), (1, 1, 1, 1), (3, 6, 199, 5), (2, 40, 64, 7), (1, 3, 2, 5)]
GPU_SHAPES = SHAPES + [(4, 300, 1000, 3), (2, 64, 4097, 3), (3, 33, 16384, 15)]


def dtypes_for(backend, device):
    if device == "cpu" and backend == "triton":
        return [torch.float32, torch.float16]  # the interpreter's bf16 stores truncate (see test_softmax)
    return GPU_DTYPES + ([torch.float64] if backend == "reference" else [])


def torch_loop(x, kernel, hidden):
    """PyTorch's own same-dtype computation: the loop, every step rounded to x's dtype."""
    h, outs = hidden, []
    for t in range(x.shape[1]):
        h = torch.tanh(x[:, t] + F.conv1d(h.unsqueeze(1), kernel, padding=kernel.shape[-1] // 2).squeeze(1))
        outs.append(h)
    return (torch.stack(outs, 1) if outs else x.new_empty(x.shape)), h


def inputs(shape, dtype, device, requires_grad=False):
    B, T, Fe, K = shape
    x = torch.randn(B, T, Fe, dtype=dtype, device=device)
    # taps summing to less than 1 in magnitude: the recurrence contracts, so gradients through
    # hundreds of steps neither explode nor vanish into rounding (with randn / sqrt(K) taps, dx
    # after 300 steps reached ~1e3 and float32's own loop erred by 5: no oracle test is possible)
    kernel = (torch.rand(1, 1, K, dtype=dtype, device=device) * 2 - 1) / K
    hidden = torch.randn(B, Fe, dtype=dtype, device=device)
    return tuple(t.requires_grad_(requires_grad) for t in (x, kernel, hidden))


def supported(backend, device, shape):
    B, T, Fe, K = shape
    if backend == "triton":
        from kernelforge.triton.convrnn import why_not
        return why_not(torch.empty(0, 0, Fe), torch.empty(1, 1, K)) is None
    if backend == "cuda":
        return Fe <= 16384 and K <= 15
    return True


def recurrence_scale(shape, dtype, terms=1):
    """The floor's scale for float32: each output carries the roundings of T steps of K taps
    (and a dkernel entry sums `terms` such products), amplified or damped step by step by the
    recurrence's Jacobian, so two correct float32 computations differ by a random walk of about
    sqrt(T (K + 2) terms) ulps. PyTorch's own loop can land closer to the oracle by chance. Half
    precision needs no such floor: PyTorch's loop rounds its state every step, ours keeps
    float32, and twice its error is the larger bound."""
    B, T, Fe, K = shape
    return (T * (K + 2) * terms) ** 0.5 if dtype == torch.float32 else 0.0


def shapes_for(device):
    return GPU_SHAPES if device == "cuda" else SHAPES


def oracle_cases(backend, device):
    """(shape, dtype) pairs the backend takes on the device, for the oracle tests."""
    return [(shape, dtype) for shape in shapes_for(device) if supported(backend, device, shape)
            for dtype in dtypes_for(backend, device)]


@pytest.mark.parametrize("backend,device", backend_cases())
def test_forward_matches_oracle(backend, device):
    for shape, dtype in oracle_cases(backend, device):
        x, kernel, hidden = inputs(shape, dtype, device)
        with kf.use_backend(backend):
            out, h_last = kf.convrnn(x, kernel, hidden)
        oracle_out, oracle_h = reference_forward(x.double(), kernel.double(), hidden.double())
        same_out, same_h = torch_loop(x, kernel, hidden) if dtype != torch.float64 else (oracle_out, oracle_h)
        what = f"convrnn {shape} {dtype} {backend}"
        scale = recurrence_scale(shape, dtype)
        assert_matches_oracle(out, same_out, oracle_out, what + " out", reduced=shape[3], terms_scale=scale)
        assert_matches_oracle(h_last, same_h, oracle_h, what + " h_T", reduced=shape[3], terms_scale=scale)


@pytest.mark.parametrize("backend,device", backend_cases())
def test_backward_through_time_matches_oracle(backend, device):
    for shape, dtype in oracle_cases(backend, device):
        x, kernel, hidden = inputs(shape, dtype, device, requires_grad=True)
        with kf.use_backend(backend):
            out, h_last = kf.convrnn(x, kernel, hidden)
        grad_out, grad_h = torch.randn_like(out), torch.randn_like(h_last)
        ours = torch.autograd.grad((out, h_last), (x, kernel, hidden), (grad_out, grad_h))
        leaves = [t.detach().double().requires_grad_() for t in (x, kernel, hidden)]
        o64, h64 = reference_forward(*leaves)
        oracle = torch.autograd.grad((o64, h64), leaves, (grad_out.double(), grad_h.double()))
        if dtype == torch.float64:
            same = oracle
        elif dtype in (torch.float16, torch.bfloat16):
            # The backward reads the states as the forward rounded them into `out` (so does PyTorch's
            # own half-precision loop, its states rounded every step): near |h| = 1 the factor 1 - h^2
            # turns that rounding into many ulps of the gradient (dkernel 10 ulps from it alone at
            # seed 611619746, on every backend alike, 3.5x PyTorch's own that time). Judged against
            # the float64 backward of those states, what is left is ours: float32 sums, rounded once.
            oracle = reference_backward(*(t.detach().double() for t in (grad_out, grad_h, kernel, hidden, out)))
            same = [o.to(dtype) for o in oracle]
        else:
            same = torch.autograd.grad(torch_loop(x, kernel, hidden), (x, kernel, hidden), (grad_out, grad_h))
        B, T, Fe, K = shape
        for name, o, s, ref, terms in zip(("dx", "dkernel", "dhidden"), ours, same, oracle, (1, B * Fe, 1)):
            assert_matches_oracle(o, s, ref, f"convrnn {shape} {dtype} {backend} {name}", reduced=K * T * terms,
                                  terms_scale=recurrence_scale(shape, dtype, terms))


def test_gradcheck_in_float64():
    x, kernel, hidden = inputs((2, 4, 6, 3), torch.float64, "cpu", requires_grad=True)
    assert torch.autograd.gradcheck(kf.convrnn, (x, kernel, hidden))


@pytest.mark.parametrize("backend,device", backend_cases())
def test_layouts_and_empty_inputs(backend, device):
    dtype = torch.float32
    with kf.use_backend(backend):
        # a feature-major buffer (non-unit feature stride) and every other time step
        base = torch.randn(3, 12, 10, dtype=dtype, device=device)
        x = base.transpose(1, 2)[:, ::2]  # (3, 5, 12)... features 12, time 5
        _, kernel, hidden = inputs((3, 5, 12, 3), dtype, device)
        hidden = torch.randn(12, 3, dtype=dtype, device=device).t()
        out, h_last = kf.convrnn(x, kernel, hidden)
        ref_out, ref_h = kf.convrnn(x.contiguous(), kernel, hidden.contiguous())
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(h_last, ref_h)
        # no time steps: h_T is the hidden state, out is empty; no batch rows: empty results
        x, kernel, hidden = inputs((2, 0, 7, 3), dtype, device, requires_grad=True)
        out, h_last = kf.convrnn(x, kernel, hidden)
        assert out.shape == (2, 0, 7) and torch.equal(h_last, hidden)
        dx, dk, dh = torch.autograd.grad(h_last.sum(), (x, kernel, hidden))
        assert dx.shape == (2, 0, 7) and torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dh, torch.ones_like(dh))
        x, kernel, hidden = inputs((0, 4, 7, 3), dtype, device)
        out, h_last = kf.convrnn(x, kernel, hidden)
        assert out.shape == (0, 4, 7) and h_last.shape == (0, 7)
        # no features: empty results, a zero kernel gradient
        x, kernel, hidden = inputs((2, 4, 0, 3), dtype, device, requires_grad=True)
        out, h_last = kf.convrnn(x, kernel, hidden)
        assert out.shape == (2, 4, 0) and h_last.shape == (2, 0)
        dx, dk, dh = torch.autograd.grad((out.sum(), h_last.sum()), (x, kernel, hidden))
        assert dx.shape == (2, 4, 0) and dh.shape == (2, 0) and torch.equal(dk, torch.zeros_like(dk))


@pytest.mark.parametrize("device", device_cases())
def test_opcheck(device):
    x, kernel, hidden = inputs((2, 5, 9, 3), torch.float32, device)
    out, h_last = torch.ops.kernelforge.convrnn(x, kernel, hidden)
    backward_args = (torch.randn_like(out), torch.randn_like(h_last), kernel, hidden, out)
    torch.library.opcheck(torch.ops.kernelforge.convrnn.default, (x, kernel, hidden))
    torch.library.opcheck(torch.ops.kernelforge.convrnn.default,
                          tuple(t.clone().requires_grad_() for t in (x, kernel, hidden)))
    torch.library.opcheck(torch.ops.kernelforge.convrnn_backward.default, backward_args)
    if device == "cuda":
        from kernelforge.cuda.convrnn import convrnn_forward

        convrnn_forward(x, kernel, hidden)  # loads the extension: its C++ block registers the CUDA kernels
        for name in ("convrnn_cuda_forward", "convrnn_cuda_backward"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kernelforge::{name}", "CUDA"), name
        torch.library.opcheck(torch.ops.kernelforge.convrnn_cuda_forward.default, (x, kernel, hidden))
        torch.library.opcheck(torch.ops.kernelforge.convrnn_cuda_backward.default, backward_args)


@pytest.mark.parametrize("device", device_cases())
def test_compiled_matches_eager(device):
    x, kernel, hidden = inputs((2, 7, 20, 3), torch.float32, device, requires_grad=True)

    def loss(x, kernel, hidden):
        out, h_last = kf.convrnn(x, kernel, hidden)
        return (out * out).sum() + h_last.sum()

    expected = torch.autograd.grad(loss(x, kernel, hidden), (x, kernel, hidden))
    # the graphs hold the backend's own work (the reference's torch ops, the Triton kernels), forward
    # and backward, not the kernelforge ops
    _, code = compiled_code(loss, x, kernel, hidden, backward=True)
    assert "torch.ops.kernelforge" not in code
    compiled = torch.compile(loss, fullgraph=True)
    got = torch.autograd.grad(compiled(x, kernel, hidden), (x, kernel, hidden))
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e)


def test_eager_fast_path_equals_registered_op():
    # In plain eager mode kf.convrnn skips the dispatcher (with its own autograd glue when a gradient is
    # needed); under a mode, a transform or torch.compile it goes through torch.ops. Both must give the
    # same values and gradients.
    x, kernel, hidden = inputs((2, 6, 9, 3), torch.float32, "cpu")
    op = torch.ops.kernelforge.convrnn
    assert convrnn_op._plain_eager((x, kernel, hidden))
    fast = assert_eager_path_equals_registered_op(lambda t: kf.convrnn(t, kernel, hidden)[0], convrnn_op,
                                                  lambda t: op(t, kernel, hidden)[0], x)
    with torch._subclasses.FakeTensorMode() as mode:
        fake, _ = kf.convrnn(mode.from_tensor(x), mode.from_tensor(kernel), mode.from_tensor(hidden))
        assert fake.shape == fast.shape and fake.stride() == fast.stride()


@pytest.mark.parametrize("registered", [False, True], ids=["eager", "registered"])
def test_double_backward_raises(registered):
    # the backward op has no gradient of its own, on either path
    x, kernel, hidden = inputs((2, 3, 5, 3), torch.float64, "cpu", requires_grad=True)
    out, h_last = (torch.ops.kernelforge.convrnn if registered else kf.convrnn)(x, kernel, hidden)
    (dx,) = torch.autograd.grad(out.sum() + h_last.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="convrnn_backward has no gradient formula"):
        dx.sum().backward()


def test_design_document_name_and_cpu_choice():
    x, kernel, hidden = inputs((2, 3, 8, 3), torch.float32, "cpu")
    assert kf.convrnn_forward is kf.convrnn
    out, h_last = kf.convrnn_forward(x, kernel, hidden)
    assert torch.equal(out[:, -1], h_last)
    assert "runs on reference" in kf.explain("convrnn", x, kernel)


@pytest.mark.parametrize("args,error,message", [
    (((2, 5), (1, 1, 3), (2, 5)), ValueError, "x must be 3-D"),
    (((2, 5, 7), (1, 1, 4), (2, 7)), ValueError, "K odd, got (1, 1, 4)"),
    (((2, 5, 7), (2, 1, 3), (2, 7)), ValueError, "kernel must have shape (1, 1, K)"),
    (((2, 5, 7), (1, 1, 3), (2, 6)), ValueError, "hidden must have shape (batch, features) = (2, 7)"),
])
def test_bad_shapes_are_named(args, error, message):
    tensors = [torch.randn(s) for s in args]
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        kf.convrnn(*tensors)


def test_bad_dtypes_are_named():
    x, kernel, hidden = inputs((2, 5, 7, 3), torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="same dtype, got x: torch.float32, kernel: torch.float64"):
        kf.convrnn(x, kernel.double(), hidden)
    with pytest.raises(TypeError, match="x must have dtype in"):
        kf.convrnn(x.int(), kernel, hidden)


def test_triton_says_which_rows_it_cannot_hold():
    from kernelforge.triton.convrnn import why_not

    assert why_not(torch.empty(1, 1, 8192), torch.empty(1, 1, 3)) is None
    assert "3 taps x 16384 features" in why_not(torch.empty(1, 1, 16384), torch.empty(1, 1, 3))


def test_backend_order_follows_the_h200_measurements():
    from types import SimpleNamespace

    from kernelforge.ops.convrnn import _preference

    def rows(steps, features):  # what the rule reads of x: its device and shape
        return SimpleNamespace(device=torch.device("cuda"), shape=(8, steps, features))

    assert _preference(rows(4096, 64), None)[0][0] == "triton"  # forward of long narrow rows
    assert _preference(rows(4096, 64), None, backward=True)[0][0] == "cuda"
    for steps, features in ((16, 64), (256, 1024), (4096, 1024), (4096, 4096)):
        assert _preference(rows(steps, features), None)[0][0] == "cuda"
        assert _preference(rows(steps, features), None, backward=True)[0][0] == "cuda"


@pytest.mark.gpu
@needs_cuda
def test_inductor_launches_the_triton_kernels():
    # Under torch.compile the op decomposes into its Triton kernels (ranked ahead of the opaque CUDA
    # extension while tracing), which Inductor launches from its own code, forward and backward (lowered
    # with the forward here), with no kernelforge op left; the numbers are eager Triton's.
    x, kernel, hidden = inputs((4, 100, 64, 3), torch.bfloat16, "cuda", requires_grad=True)
    leaves = (x, kernel, hidden)

    def loss(x, kernel, hidden):
        out, h_last = kf.convrnn(x, kernel, hidden)
        return out.float().square().sum() + h_last.float().sum()

    got = assert_inductor_launches(loss, leaves, ["convrnn_forward_kernel", "convrnn_backward_kernel"], backward=True)
    got_grads = torch.autograd.grad(got, leaves)
    with kf.use_backend("triton"):
        expected = loss(*leaves)
        grads = torch.autograd.grad(expected, leaves)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=0)  # float32 sums, in Inductor's order
    for a, e in zip(got_grads, grads):
        torch.testing.assert_close(a, e)
