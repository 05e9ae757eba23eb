"""softmax / log_softmax: every backend against the float64 oracle, gradients, layouts,
edge cases, the registered ops (opcheck), torch.compile, and bad input."""
import pytest
import torch

import kernelforge as kf
from kernelforge import reference
from tests.conftest import HAS_CUDA, backend_cases
from tests.numerics import assert_matches_oracle, same_layout
from tests.op_paths import assert_eager_path_equals_registered_op

FUNCS = {"softmax": (kf.softmax, torch.softmax), "log_softmax": (kf.log_softmax, torch.log_softmax)}
GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def dtypes_for(backend, device):
    if device == "cpu" and backend == "triton":
        # Triton's interpreter truncates float32 -> bfloat16 stores instead of rounding to
        # nearest (-117.38 stores as -117.0, not -117.5): up to 1 ulp against torch's half
        # ulp, which failed the 2x rule on some seeds at 65537 columns. bf16 Triton runs
        # in the GPU suite, compiled.
        return [torch.float32, torch.float16]
    return GPU_DTYPES + ([torch.float64] if backend == "reference" else [])


def row_length(x, dim):
    return x.shape[dim] if x.dim() else 1


def check_forward(name, x, dim, backend):
    ours_fn, torch_fn = FUNCS[name]
    with kf.use_backend(backend):
        y = ours_fn(x, dim)
    oracle = torch_fn(x.double(), dim)
    assert_matches_oracle(y, torch_fn(x, dim), oracle, f"{name} {tuple(x.shape)} dim={dim} {x.dtype} {backend}",
                          reduced=row_length(x, dim))
    return y


def check_backward(name, x, dim, backend):
    ours_fn, torch_fn = FUNCS[name]
    g = torch.randn_like(x)
    xs = {k: same_layout(x).requires_grad_() for k in ("ours", "torch")}
    x64 = x.detach().double().requires_grad_()
    with kf.use_backend(backend):
        ours_fn(xs["ours"], dim).backward(g)
    torch_fn(xs["torch"], dim).backward(g)
    torch_fn(x64, dim).backward(g.double())
    assert_matches_oracle(xs["ours"].grad, xs["torch"].grad, x64.grad,
                          f"{name} grad {tuple(x.shape)} dim={dim} {x.dtype} {backend}",
                          reduced=row_length(x, dim), terms_scale=cancelling_terms(name, x64, g.double(), dim))


def cancelling_terms(name, x64, g64, dim):
    """The scale of the gradient's rounding, which can exceed the gradient's own: each output is
    g - p * S (log_softmax, S = sum(g)) or p * (g - S) (softmax, S = sum(p * g)), and S is a float32
    sum of n terms whose error walks like sqrt(n) ulps of its largest term whichever order the
    kernel sums in; p times that enters every output of the row. Seed 1047742045, a (2, 4097)
    float32 log_softmax row: 21 ulps of an output of 2.2, from the row's sum of g."""
    if x64.dim() == 0:
        return 0.0
    with torch.no_grad():
        p = torch.softmax(x64, dim)
        terms = g64 if name == "log_softmax" else p * g64
        n = x64.shape[dim]
        summed = p.max().item() * n ** 0.5 * terms.abs().max().item()
        return max(terms.abs().max().item(), summed)


SHAPES = [  # (shape, dim): rows of 1..65537 columns, any rank, any dim
    ((3, 1), -1), ((4, 7), -1), ((5, 1000), -1), ((2, 4097), -1), ((2, 65537), -1),
    ((2, 3, 33), 0), ((2, 3, 33), 1), ((6, 5, 4, 3), 2), ((17,), 0), ((), -1),
]


@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("backend,device", backend_cases())
@pytest.mark.parametrize("shape,dim", SHAPES, ids=[f"{s}-d{d}" for s, d in SHAPES])
def test_forward_and_backward_match_oracle(name, backend, device, shape, dim):
    for dtype in dtypes_for(backend, device):
        x = torch.randn(shape, device=device, dtype=dtype) * 3
        y = check_forward(name, x, dim, backend)
        assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
        check_backward(name, x, dim, backend)


@pytest.mark.slow
@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("backend,device", backend_cases())
@pytest.mark.parametrize("n", [32768, 32769, 262144, 262147])
def test_long_rows(name, backend, device, n):
    for dtype in (d for d in (torch.float32, torch.bfloat16) if d in dtypes_for(backend, device)):
        x = torch.randn(3, n, device=device, dtype=dtype) * 4
        check_forward(name, x, -1, backend)
        check_backward(name, x, -1, backend)


@pytest.mark.parametrize("backend,device", backend_cases())
def test_many_short_rows(backend, device):
    # More rows than one persistent wave of programs covers: every row tile gets visited.
    x = torch.randn(3000, 33, device=device)
    check_forward("softmax", x, -1, backend)
    check_backward("log_softmax", x, -1, backend)


def strided_views(device):
    base = torch.randn(12, 80, device=device)
    return {
        "every-other-column": base[:, ::2],
        "transposed": base.t(),
        "column-slice": base[:, 3:70],
        "row-slice": base[::3],
        "broadcast": torch.randn(6, 1, device=device).expand(6, 50),
        "channels-last": torch.randn(2, 5, 6, 7, device=device).to(memory_format=torch.channels_last),
    }


@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("backend,device", backend_cases())
def test_strided_inputs(name, backend, device):
    for label, x in strided_views(device).items():
        for dim in range(x.dim()):
            check_forward(name, x, dim, backend)
            check_backward(name, x, dim, backend)


@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("backend,device", backend_cases())
def test_infinities_match_torch(name, backend, device):
    # -inf entries (masking) in short and long rows, including a masked run longer than
    # one chunk of the online kernel at the start of a row, and a fully masked row (NaN,
    # as in torch).
    for n in (50, 40000):
        x = torch.randn(4, n, device=device)
        x[0, : n // 2] = float("-inf")
        x[1, n // 3] = float("-inf")
        x[2, :] = float("-inf")
        check_forward(name, x, -1, backend)


@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("backend,device", backend_cases())
@pytest.mark.parametrize("shape,dim", [((0, 5), -1), ((5, 0), -1), ((5, 0), 0), ((2, 0, 3), 2)])
def test_empty(name, backend, device, shape, dim):
    x = torch.randn(shape, device=device, requires_grad=True)
    with kf.use_backend(backend):
        y = FUNCS[name][0](x, dim)
        y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape


@pytest.mark.parametrize("name", FUNCS)
def test_output_layout_matches_fake(name):
    # The fake implementation must predict the real output's strides (torch.compile relies on it).
    op = getattr(torch.ops.kernelforge, name)
    for x, dim in [(torch.randn(4, 5, 6), 1), (torch.randn(4, 5, 6).transpose(0, 2), 0), (torch.randn(3, 4), -1)]:
        real = op(x, dim)
        with torch._subclasses.FakeTensorMode() as mode:
            fake = op(mode.from_tensor(x), dim)
        assert real.shape == fake.shape and real.stride() == fake.stride()


@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gradcheck_float64(name, dim):
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    fn = lambda t: FUNCS[name][0](t, dim)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


def op_samples(device):
    x = torch.randn(4, 9, device=device)
    yield (x, -1)
    yield (torch.randn(3, 5, 7, device=device, requires_grad=True), 1)
    yield (torch.randn(2, 70, device=device)[:, ::2], 0)


@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("backend,device", backend_cases())
def test_opcheck(name, backend, device):
    fwd = getattr(torch.ops.kernelforge, name).default
    bwd = getattr(torch.ops.kernelforge, f"{name}_backward").default
    with kf.use_backend(backend):
        for args in op_samples(device):
            torch.library.opcheck(fwd, args)
            y = fwd(args[0].detach(), args[1])
            g = torch.randn_like(y)
            torch.library.opcheck(bwd, (g, y, args[1]))
            torch.library.opcheck(bwd, (g.requires_grad_(), y.requires_grad_(), args[1]))


def _compile_device_cases():
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])]


@pytest.mark.slow
@pytest.mark.parametrize("device", _compile_device_cases())
def test_torch_compile_fullgraph(device):
    def block(x, w):
        h = kf.softmax(x @ w, dim=-1)
        return kf.log_softmax(h * 2.0, dim=0).sum()

    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    x = torch.randn(8, 16, device=device, requires_grad=True)
    w = torch.randn(16, 33, device=device, requires_grad=True)
    expected = block(x, w)
    gx, gw = torch.autograd.grad(expected, (x, w))
    got = compiled(x, w)
    cgx, cgw = torch.autograd.grad(got, (x, w))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(cgx, gx)
    torch.testing.assert_close(cgw, gw)


def test_reference_is_the_definition():
    # The reference spells the math out; it must agree with torch in float64 to rounding.
    x = torch.randn(7, 300, dtype=torch.float64) * 5
    torch.testing.assert_close(reference.softmax(x, -1), torch.softmax(x, -1), rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(reference.log_softmax(x, 0), torch.log_softmax(x, 0), rtol=1e-14, atol=1e-14)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("name", FUNCS)
def test_integer_input_is_rejected(name):
    with pytest.raises(TypeError, match=r"kernelforge\.%s: x must have dtype in .* got torch\.int64" % name):
        FUNCS[name][0](torch.arange(6).reshape(2, 3), -1)


@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("shape,dim", [((2, 3), 2), ((2, 3), -3), ((), 1)])
def test_dim_out_of_range_is_rejected(name, shape, dim):
    with pytest.raises(IndexError, match=r"dim out of range: expected in \[-?\d+, \d+\] for a tensor of rank \d, got %d" % dim):
        FUNCS[name][0](torch.randn(shape), dim)


@pytest.mark.parametrize("name", FUNCS)
def test_backward_rejects_mixed_devices_dtypes_shapes(name):
    bwd = getattr(torch.ops.kernelforge, f"{name}_backward")
    y = torch.softmax(torch.randn(3, 4), -1)
    with pytest.raises(RuntimeError, match=r"same device, got grad_output: meta, output: cpu"):
        bwd(torch.randn(3, 4, device="meta"), y, -1)
    with pytest.raises(RuntimeError, match=r"same dtype, got grad_output: torch.float16, output: torch.float32"):
        bwd(torch.randn(3, 4, dtype=torch.float16), y, -1)
    with pytest.raises(RuntimeError, match=r"same shape, got grad_output: \(4, 3\), output: \(3, 4\)"):
        bwd(torch.randn(4, 3), y, -1)


@pytest.mark.parametrize("backend,device", backend_cases())
def test_nn_modules(backend, device):
    x = torch.randn(5, 6, 7, device=device)
    with kf.use_backend(backend):
        torch.testing.assert_close(kf.nn.Softmax(dim=1)(x), torch.nn.Softmax(dim=1)(x))
        torch.testing.assert_close(kf.nn.LogSoftmax(dim=-1)(x), torch.nn.LogSoftmax(dim=-1)(x))
    assert repr(kf.nn.Softmax(2)) == "Softmax(dim=2)"


@pytest.mark.parametrize("name", FUNCS)
def test_eager_fast_path_equals_registered_op(name):
    # In plain eager mode kf.softmax skips the dispatcher (with its own autograd glue when a
    # gradient is needed); under a mode, a transform or torch.compile it goes through
    # torch.ops. Both must give the same values, layout and gradients.
    from kernelforge.ops import softmax as softmax_ops

    op = getattr(torch.ops.kernelforge, name)
    definition = getattr(softmax_ops, f"{name}_op")
    x = torch.randn(6, 5, 7).transpose(0, 2)
    assert definition._plain_eager((x, 1)) and definition._plain_eager((x.detach().requires_grad_(), 1))
    fast = assert_eager_path_equals_registered_op(lambda t: FUNCS[name][0](t, 1), definition, lambda t: op(t, 1), x)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert not definition._plain_eager((fake, 1))
        assert FUNCS[name][0](fake, 1).stride() == fast.stride()
    # vmap runs through the op too (functorch transforms are active inside)
    torch.testing.assert_close(torch.vmap(lambda t: FUNCS[name][0](t, -1))(x), FUNCS[name][1](x, -1))
