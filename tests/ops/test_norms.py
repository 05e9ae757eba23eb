"""layer_norm / rms_norm / add_layer_norm / add_rms_norm: every backend against the float64
oracle (outputs and the gradients of x, residual, weight and bias), shapes, layouts, weight
and bias absent, Gemma's offset, long rows, the registered ops (opcheck), torch.compile,
modules that load torch.nn checkpoints, and bad input."""
import math

import pytest
import torch
import torch.nn.functional as F

import kernelforge as kf
from kernelforge.ops import norms as norm_ops
from tests.conftest import HAS_CUDA, backend_cases
from tests.numerics import assert_matches_oracle, same_layout
from tests.op_paths import assert_eager_path_equals_registered_op

NAMES = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def dtypes_for(backend, device):
    if device == "cpu" and backend == "triton":
        return [torch.float32, torch.float16]  # the interpreter's bfloat16 is unreliable: GPU suite
    return GPU_DTYPES + ([torch.float64] if backend == "reference" else [])


def ours(name, x, residual, weight, bias, eps, offset, normalized_shape):
    args = (x,) if residual is None else (x, residual)
    return getattr(kf, name)(*args, weight=weight, bias=bias, eps=eps, offset=offset,
                             normalized_shape=normalized_shape)


def torch_norm(name, h, weight, bias, eps, offset, normalized_shape):
    """torch's own ops on the normalized input h."""
    w = None if weight is None else weight + offset
    if "rms" in name:
        y = F.rms_norm(h, normalized_shape, w, eps)
        return y if bias is None else y + bias
    return F.layer_norm(h, normalized_shape, w, bias, eps)


def decomposed_norm(name, h, weight, bias, eps, offset, normalized_shape):
    """The same norm spelled in elementary ops: for float64 inputs, where torch's float64 is
    also the oracle, the gap between the two PyTorch formulations is PyTorch's error."""
    dims = tuple(range(-len(normalized_shape), 0))
    centered = h if "rms" in name else h - h.mean(dims, keepdim=True)
    y = centered * torch.rsqrt(centered.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight + offset)
    return y if bias is None else y + bias


def check(name, backend, x, weight=None, bias=None, *, eps=1e-5, offset=0.0, normalized_shape=None):
    """Forward and backward of `name` on `backend` against the float64 oracle, with torch's
    same-dtype error as the yardstick (tests/numerics.py)."""
    normalized_shape = tuple(normalized_shape or (x.shape[-1],))
    n = math.prod(normalized_shape)
    rows = x.numel() // max(n, 1)
    residual = torch.randn_like(x) if name.startswith("add_") else None
    given = {k: t for k, t in dict(x=x, residual=residual, weight=weight, bias=bias).items() if t is not None}
    mine = {k: same_layout(t).requires_grad_() for k, t in given.items()}
    theirs = {k: same_layout(t).requires_grad_() for k, t in given.items()}
    exact = {k: t.detach().double().requires_grad_() for k, t in given.items() if k not in ("x", "residual")}
    grad_y = torch.randn_like(x)
    grad_residual = torch.randn_like(x) if residual is not None else None
    what = f"{name} {tuple(x.shape)} {x.dtype} {backend} w={weight is not None} b={bias is not None}"

    with kf.use_backend(backend):
        out = ours(name, mine["x"], mine.get("residual"), mine.get("weight"), mine.get("bias"),
                   eps, offset, normalized_shape)
    y, residual_out = out if residual is not None else (out, None)
    h_theirs = theirs["x"] if residual is None else theirs["x"] + theirs["residual"]
    theirs_fn = decomposed_norm if x.dtype == torch.float64 else torch_norm
    y_theirs = theirs_fn(name, h_theirs, theirs.get("weight"), theirs.get("bias"), eps, offset, normalized_shape)
    # The oracle normalizes the stored (rounded) sum, as the op promises.
    h_exact = (x if residual is None else x + residual).detach().double().requires_grad_()
    y_exact = torch_norm(name, h_exact, exact.get("weight"), exact.get("bias"), eps, offset, normalized_shape)

    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    assert_matches_oracle(y, y_theirs, y_exact, f"{what} y", reduced=n)
    if residual is not None:
        assert torch.equal(residual_out, h_theirs), f"{what}: residual_out != x + residual"

    def backward(outputs, leaves, grads):
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None]
        return torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs])

    order = [k for k in ("x", "residual", "weight", "bias") if k in given]
    g_mine = backward((y, residual_out), [mine[k] for k in order], (grad_y, grad_residual))
    g_theirs = backward((y_theirs, h_theirs), [theirs[k] for k in order], (grad_y, grad_residual))
    exact_leaves = [h_exact] + [exact[k] for k in order if k in exact]
    g_exact = list(backward((y_exact,), exact_leaves, (grad_y.double(),)))
    if grad_residual is not None:
        g_exact[0] = g_exact[0] + grad_residual.double()
    g_exact = g_exact[:1] * (1 + (residual is not None)) + g_exact[1:]  # x and residual share dh
    # The input gradient is rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w: it can
    # cancel to far below rstd * |g| (a single-element row cancels to ~0), so its rounding
    # floor sits at that scale.
    dims = tuple(range(-len(normalized_shape), 0))
    h64 = h_exact.detach()
    centered = h64 if "rms" in name else h64 - h64.mean(dims, keepdim=True)
    rstd = torch.rsqrt(centered.square().mean(dims, keepdim=True) + eps)
    g = grad_y.double() * (1 if weight is None else weight.double() + offset)
    terms = (rstd * g.abs()).max().item() if g.numel() else 0.0
    for k, a, b, c in zip(order, g_mine, g_theirs, g_exact):
        assert_matches_oracle(a, b, c, f"{what} grad {k}", reduced=n if k in ("x", "residual") else rows,
                              terms_scale=terms if k in ("x", "residual") else 0.0)


SHAPES = [(3, 1), (4, 7), (5, 1000), (2, 4097), (2, 3, 33), (199, 64)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend,device", backend_cases())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_oracle(name, backend, device, shape):
    for dtype in dtypes_for(backend, device):
        x = torch.randn(shape, device=device, dtype=dtype) * 2 + 0.5
        w = torch.randn(shape[-1], device=device, dtype=dtype)
        b = torch.randn(shape[-1], device=device, dtype=dtype)
        check(name, backend, x, w, b)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend,device", backend_cases())
def test_weight_and_bias_optional(name, backend, device):
    x = torch.randn(6, 50, device=device)
    w, b = torch.randn(50, device=device), torch.randn(50, device=device)
    for weight, bias in ((None, None), (w, None), (None, b)):
        check(name, backend, x, weight, bias)


@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm", "layer_norm"])
@pytest.mark.parametrize("backend,device", backend_cases())
def test_offset_gives_one_plus_weight(name, backend, device):
    # Gemma stores w and multiplies by (1 + w); small w makes the offset matter.
    x = torch.randn(5, 96, device=device)
    check(name, backend, x, torch.randn(96, device=device) * 0.1, eps=1e-6, offset=1.0)


@pytest.mark.parametrize("name", ["layer_norm", "add_rms_norm"])
@pytest.mark.parametrize("backend,device", backend_cases())
def test_several_normalized_dims(name, backend, device):
    x = torch.randn(3, 4, 5, 6, device=device)
    check(name, backend, x, torch.randn(5, 6, device=device), torch.randn(5, 6, device=device),
          normalized_shape=(5, 6))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend,device", backend_cases())
def test_many_rows_reduce_weight_grads(name, backend, device):
    # More row tiles than programs: each program sums several tiles, then the partials are summed.
    x = torch.randn(3000, 24, device=device)
    check(name, backend, x, torch.randn(24, device=device), torch.randn(24, device=device))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend,device", backend_cases())
@pytest.mark.parametrize("n", [16385, 65536, 262147])
def test_long_rows(name, backend, device, n):
    # Past the fused limits (16384 backward, 32768 forward): the chunked kernels.
    for dtype in (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,):
        x = torch.randn(3, n, device=device, dtype=dtype) + 3  # a mean far from 0 tests the variance merge
        check(name, backend, x, torch.randn(n, device=device, dtype=dtype), torch.randn(n, device=device, dtype=dtype))


@pytest.mark.parametrize("backend,device", backend_cases())
def test_strided_inputs(backend, device):
    base = torch.randn(12, 80, device=device)
    for x in (base[:, ::2], base.t(), base[:, 3:70], base[::3],
              torch.randn(2, 5, 6, 7, device=device).to(memory_format=torch.channels_last)):
        check("layer_norm", backend, x, torch.randn(x.shape[-1], device=device))
        check("add_rms_norm", backend, x, torch.randn(x.shape[-1], device=device))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend,device", backend_cases())
@pytest.mark.parametrize("shape", [(0, 5), (2, 0, 5), (3, 0)], ids=str)
def test_empty(name, backend, device, shape):
    x = torch.randn(shape, device=device, requires_grad=True)
    w = torch.randn(shape[-1], device=device, requires_grad=True)
    args = (x,) if not name.startswith("add_") else (x, torch.randn(shape, device=device))
    with kf.use_backend(backend):
        out = getattr(kf, name)(*args, weight=w)
        y = out[0] if isinstance(out, tuple) else out
        y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_mixed_precision_weight(backend, device):
    # float32 parameters with half-precision activations (kept in float32 by some trainers).
    x = torch.randn(7, 300, device=device, dtype=torch.float16)
    w, b = torch.randn(300, device=device), torch.randn(300, device=device)
    with kf.use_backend(backend):
        y = kf.layer_norm(x, w, b)
    assert y.dtype == torch.float16
    expected = F.layer_norm(x.double(), (300,), w.double(), b.double())
    baseline = F.layer_norm(x.float(), (300,), w, b).half()  # torch's float32 math, rounded once
    assert_matches_oracle(y, baseline, expected, "layer_norm fp16 x, fp32 weight", reduced=300)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_weight_gradients_are_deterministic(backend, device):
    x = torch.randn(2000, 40, device=device, requires_grad=True)
    w = torch.randn(40, device=device, requires_grad=True)
    grads = []
    for _ in range(2):
        with kf.use_backend(backend):
            (gw,) = torch.autograd.grad(kf.rms_norm(x, w, 1e-6).square().sum(), (w,))
        grads.append(gw)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("backend,device", backend_cases(("triton",)))
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_weight_and_bias_gradients_over_many_partials(backend, device, name, monkeypatch):
    # More per-program partial rows than the partial-sum kernel loads at once (32), a count
    # that is no multiple of it, and on a GPU bf16 parameters (the sum is stored in their dtype).
    import kernelforge.triton.norms as triton_norms

    monkeypatch.setattr(triton_norms, "PROGRAMS_PER_SM", 16 if device == "cpu" else 1)
    # 47 row tiles of 64 rows: 47 programs on the CPU (4 "SMs" x 16); 133 tiles on a GPU over
    # 1 program per SM: 67 programs of 2 tiles on an H100's 132 SMs
    rows = 64 * 47 if device == "cpu" else 64 * 133
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(rows, 64, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(64, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(64, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn_like(x)
    with kf.use_backend(backend):
        got = torch.autograd.grad(getattr(kf, name)(x, w, eps=1e-5, bias=b), (w, b), g)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    expected = torch.autograd.grad(torch_norm(name, x64, w64, b64, 1e-5, 0.0, (64,)), (w64, b64), g.double())
    w32, b32 = (t.detach().float().requires_grad_() for t in (w, b))
    baseline = torch.autograd.grad(torch_norm(name, x.detach().float(), w32, b32, 1e-5, 0.0, (64,)), (w32, b32),
                                   g.float())
    for label, ours_grad, base, exp in zip(("weight", "bias"), got, baseline, expected):
        assert ours_grad.dtype == dtype
        assert_matches_oracle(ours_grad, base.to(dtype), exp, f"{name} {label} grad", reduced=rows)


def test_backend_rules():
    # measured: Triton's kernels are faster at every size on an H200, but for large backward passes
    # over rows of <= 8192 columns, where CUDA's were (H100)
    from types import SimpleNamespace

    from kernelforge.ops import norms as ops

    def cuda_like(elements):
        return SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16, numel=lambda: elements)

    huge, small = cuda_like(ops.CUDA_BACKWARD_MIN_ELEMENTS), cuda_like(4096)
    for x in (huge, small):
        order, reason = ops._preference(x, n=4096)
        assert order == ("triton", "cuda", "reference") and "less device time" in reason
    assert ops._preference(torch.randn(2, 3))[0] == ("reference",)
    assert ops._preference(huge, n=8192, backward=True)[0] == ("cuda", "triton", "reference")
    assert ops._preference(huge, n=8193, backward=True)[0] == ("triton", "cuda", "reference")
    assert ops._preference(small, n=4096, backward=True)[0] == ("triton", "cuda", "reference")
    assert ops._choice_key(huge, n=8192, backward=True) != ops._choice_key(huge, n=8193, backward=True)
    assert ops._choice_key(huge, n=4096, backward=True) != ops._choice_key(huge, n=4096)


def test_gradcheck_and_gradgradcheck_float64():
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    cases = {
        "layer_norm": (lambda x, w, b: kf.layer_norm(x, w, b), (x, w, b)),
        "rms_norm": (lambda x, w: kf.rms_norm(x, w, 1e-6, offset=1.0), (x, w)),
        "add_layer_norm": (lambda x, r, w: kf.add_layer_norm(x, r, w), (x, r, w)),
        "add_rms_norm": (lambda x, r, b: kf.add_rms_norm(x, r, None, 1e-6, bias=b), (x, r, b)),
    }
    for name, (fn, inputs) in cases.items():
        assert torch.autograd.gradcheck(fn, inputs), name
        assert torch.autograd.gradgradcheck(fn, inputs), name


def op_samples(device):
    x = torch.randn(4, 9, device=device, requires_grad=True)
    w = torch.randn(9, device=device, requires_grad=True)
    b = torch.randn(9, device=device, requires_grad=True)
    r = torch.randn(4, 9, device=device, requires_grad=True)
    return {
        "layer_norm": [(x, [9], w, b, 1e-5, 0.0), (torch.randn(2, 3, 4, device=device), [3, 4], None, None, 1e-5, 0.0)],
        "rms_norm": [(x, [9], w, None, 1e-6, 1.0), (x[:, ::2], [5], None, None, 1e-6, 0.0)],
        "add_layer_norm": [(x, r, [9], w, b, 1e-5, 0.0)],
        "add_rms_norm": [(x, r, [9], w, None, 1e-6, 0.0)],
    }


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend,device", backend_cases())
def test_opcheck(name, backend, device):
    op = getattr(torch.ops.kernelforge, name).default
    backward = getattr(torch.ops.kernelforge, "rms_norm_backward" if "rms" in name else "layer_norm_backward").default
    with kf.use_backend(backend):
        for args in op_samples(device)[name]:
            torch.library.opcheck(op, args)
            outputs = op(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
            residual = name.startswith("add_")
            x, ns, w, b, eps, offset = (args[0],) + tuple(args[1 + residual:])
            h = outputs[1] if residual else x.detach()
            stats = outputs[-1:] if "rms" in name else outputs[-2:]
            grad_res = torch.randn_like(h) if residual else None
            for weight_grads in (True, False):
                torch.library.opcheck(backward, (torch.randn_like(h), grad_res, h, ns, w, b, *stats, eps, offset,
                                                 weight_grads))


def _compile_device_cases():
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])]


@pytest.mark.slow
@pytest.mark.parametrize("device", _compile_device_cases())
def test_torch_compile_fullgraph(device):
    def block(x, r, w, b):
        h, r2 = kf.add_rms_norm(x, r, w, 1e-6)
        return (kf.layer_norm(h @ w.diag(), w, b) + r2).square().sum()

    x, r = (torch.randn(8, 32, device=device, requires_grad=True) for _ in range(2))
    w, b = torch.randn(32, device=device, requires_grad=True), torch.randn(32, device=device, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    expected = block(x, r, w, b)
    got = compiled(x, r, w, b)
    torch.testing.assert_close(got, expected)
    # The compiled graph runs the norms' traced kernels (the reference's float32 ops as Inductor
    # fuses them, or Triton's kernels where eager ran CUDA's): sums in another order, so rounding
    # differences at the scale of each gradient's largest element (2e-6 of it over 60 seeds, CPU).
    for a, c in zip(torch.autograd.grad(got, (x, r, w, b)), torch.autograd.grad(expected, (x, r, w, b))):
        torch.testing.assert_close(a, c, rtol=1.3e-6, atol=1e-5 * max(1.0, c.abs().max().item()))


def test_eager_fast_path_equals_registered_op():
    x = torch.randn(6, 5, 7)
    w, b = torch.randn(7), torch.randn(7)
    y_fast = kf.layer_norm(x, w, b)
    y_op, _, _ = torch.ops.kernelforge.layer_norm(x, [7], w, b, 1e-5, 0.0)
    assert torch.equal(y_fast, y_op)
    leaves_a = [t.clone().requires_grad_() for t in (x, w, b)]
    leaves_b = [t.clone().requires_grad_() for t in (x, w, b)]
    ya = kf.layer_norm(*leaves_a)
    yb = torch.ops.kernelforge.layer_norm(leaves_b[0], [7], leaves_b[1], leaves_b[2], 1e-5, 0.0)[0]
    assert norm_ops.layer_norm_op.is_eager_node(ya.grad_fn)
    g = torch.randn_like(ya)
    for a, c in zip(torch.autograd.grad(ya, leaves_a, g), torch.autograd.grad(yb, leaves_b, g)):
        assert torch.equal(a, c)


def _variant_call(name, residual, w, b):
    """(public, registered): y of variant `name` as a function of x, through kf.<name> and through
    torch.ops.kernelforge.<name>, the other inputs fixed."""
    eps = 1e-6 if "rms" in name else 1e-5
    op = getattr(torch.ops.kernelforge, name)
    others = (residual,) if name.startswith("add_") else ()

    def public(x):
        out = getattr(kf, name)(x, *others, w, bias=b, eps=eps)
        return out[0] if isinstance(out, tuple) else out

    def registered(x):
        return op(x, *others, [w.shape[-1]], w, b, eps, 0.0)[0]

    return public, registered


@pytest.mark.parametrize("name", NAMES)
def test_eager_path_equals_registered_op_for_every_variant(name):
    x = torch.randn(6, 5, 7)
    public, registered = _variant_call(name, torch.randn(6, 5, 7), torch.randn(7), torch.randn(7))
    assert_eager_path_equals_registered_op(public, getattr(norm_ops, f"{name}_op"), registered, x)
    # mean and rstd are statistics for the backward, not differentiable outputs, on either path
    xg = x.detach().requires_grad_()
    args = (xg, torch.randn(6, 5, 7)) if name.startswith("add_") else (xg,)
    op_args = (*args, [7], None, None, 1e-5, 0.0)
    for outputs in (getattr(norm_ops, f"{name}_op")(*op_args), getattr(torch.ops.kernelforge, name)(*op_args)):
        stats = outputs[-1:] if "rms" in name else outputs[-2:]
        assert outputs[0].requires_grad and not any(s.requires_grad for s in stats)


# ----------------------------------------------------------------------------- modules
@pytest.mark.parametrize("backend,device", backend_cases())
def test_modules_load_torch_checkpoints(backend, device):
    theirs = torch.nn.LayerNorm((4, 6), eps=1e-6, device=device)
    theirs_rms = torch.nn.RMSNorm(6, eps=1e-6, device=device)
    for module in (theirs, theirs_rms):
        for p in module.parameters():
            torch.nn.init.normal_(p)
    mine = kf.nn.LayerNorm((4, 6), eps=1e-6, device=device)
    mine_rms = kf.nn.RMSNorm(6, eps=1e-6, device=device)
    mine.load_state_dict(theirs.state_dict())
    mine_rms.load_state_dict(theirs_rms.state_dict())
    assert mine.state_dict().keys() == theirs.state_dict().keys()
    x = torch.randn(3, 4, 6, device=device)
    with kf.use_backend(backend):
        torch.testing.assert_close(mine(x), theirs(x))
        torch.testing.assert_close(mine_rms(x), theirs_rms(x))
    assert repr(mine) == repr(theirs) and repr(mine_rms) == repr(theirs_rms)


def test_module_variants():
    assert kf.nn.LayerNorm(8, elementwise_affine=False).weight is None
    assert kf.nn.LayerNorm(8, bias=False).bias is None
    gemma = kf.nn.RMSNorm(8, eps=1e-6, offset=1.0)
    x = torch.randn(2, 8)
    torch.testing.assert_close(gemma(x), F.rms_norm(x, (8,), eps=1e-6))  # initialized to the identity
    assert kf.nn.TritonLayerNorm(dim=16).normalized_shape == (16,)


def test_triton_layer_norm_is_pinned_to_triton():
    # float64 is a dtype only the reference takes: the default LayerNorm runs it, the
    # Triton-pinned one refuses it rather than fall back.
    x = torch.randn(3, 16, dtype=torch.float64)
    pinned = kf.nn.TritonLayerNorm(dim=16, dtype=torch.float64)
    torch.testing.assert_close(kf.nn.LayerNorm(16, dtype=torch.float64)(x), F.layer_norm(x, (16,)))
    with pytest.raises(kf.BackendUnsupportedError, match=r"backend 'triton' is forced but cannot run these "
                       r"inputs: Triton kernels take float32/float16/bfloat16, got x of torch.float64"):
        pinned(x)


# ----------------------------------------------------------------------------- bad input
def test_bad_input_is_rejected_clearly():
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match=r"kernelforge\.layer_norm: x must have dtype in .* got torch\.int64"):
        kf.layer_norm(torch.arange(8).reshape(2, 4))
    with pytest.raises(ValueError, match=r"normalized_shape=\(5,\) must match the trailing dims of x, got x of shape \(4, 8\)"):
        kf.layer_norm(x, torch.randn(5))
    with pytest.raises(RuntimeError, match=r"bias must have shape normalized_shape=\(8,\), got \(4, 2\)"):
        kf.layer_norm(x, torch.randn(8), torch.randn(4, 2))
    with pytest.raises(RuntimeError, match=r"same dtype, got x: torch.float32, residual: torch.float16"):
        kf.add_rms_norm(x, x.half())
    with pytest.raises(RuntimeError, match=r"same shape, got x: \(4, 8\), residual: \(8, 4\)"):
        kf.add_layer_norm(x, x.t())
    with pytest.raises(TypeError, match=r"add_layer_norm: residual must be a tensor, got NoneType"):
        kf.add_layer_norm(x, None)
    with pytest.raises(TypeError, match=r"kernelforge\.rms_norm: eps must be a real number, got str 'x'"):
        kf.rms_norm(x, torch.ones(8), "x")
    with pytest.raises(TypeError, match=r"kernelforge\.layer_norm: offset must be a real number, got NoneType None"):
        kf.layer_norm(x, offset=None)
    stats = torch.ops.kernelforge.layer_norm(x, [8], None, None, 1e-5, 0.0)[1:]
    with pytest.raises(RuntimeError, match=r"mean must have dtype torch.float32 for h of torch.float32, got torch.float64"):
        torch.ops.kernelforge.layer_norm_backward(x, None, x, [8], None, None, stats[0].double(), stats[1], 1e-5, 0.0, True)
    with pytest.raises(RuntimeError, match=r"same device, got h: cpu, rstd: meta"):
        torch.ops.kernelforge.layer_norm_backward(x, None, x, [8], None, None, stats[0], stats[1].to("meta"), 1e-5, 0.0, True)
    with pytest.raises(ValueError, match=r"x must have at least one dim, got a 0-dim tensor"):
        kf.rms_norm(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"eps must be >= 0, got -1.0"):
        kf.rms_norm(x, eps=-1.0)
    with pytest.raises(TypeError, match=r"weight must have dtype in .* got torch\.int64"):
        kf.rms_norm(x, torch.ones(8, dtype=torch.int64))
