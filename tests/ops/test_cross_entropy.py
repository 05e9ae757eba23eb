"""cross_entropy: every backend against the float64 oracle (losses and gradients, ignore_index,
label smoothing, reductions), torch's layouts, out-of-range targets, the registered ops (opcheck,
double backward), torch.compile, peak memory on the GPU, and bad input."""
import pytest
import torch
import torch.nn.functional as F

import kernelforge as kf
from kernelforge.ops.cross_entropy import cross_entropy_op
from tests.conftest import HAS_CUDA, backend_cases, device_cases
from tests.numerics import assert_matches_oracle
from tests.op_paths import assert_eager_path_equals_registered_op, assert_inductor_launches, compiled_code

GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BACKENDS = ("reference", "triton")


def dtypes_for(backend, device):
    if device == "cpu" and backend == "triton":
        return [torch.float32, torch.float16]  # the interpreter's bf16 stores truncate (see test_softmax.py)
    return GPU_DTYPES + ([torch.float64] if backend == "reference" else [])


def random_case(rows, classes, dtype, device, ignored_every=5):
    """Logits of a realistic spread (a trained LM's are a few units wide), targets with some rows ignored."""
    logits = (torch.randn(rows, classes, device=device) * 4).to(dtype)
    target = torch.randint(0, classes, (rows,), device=device)
    target[::ignored_every] = -100
    return logits, target


def torch_losses(logits, target, smoothing):
    """(float32 recipe's per-row loss and logits' gradient for grad_out g, float64 oracle's) with
    torch: F.cross_entropy on logits.float() is the accuracy yardstick for every dtype."""
    out = {}
    for key, dtype in (("same", torch.float32 if logits.dtype != torch.float64 else torch.float64),
                       ("oracle", torch.float64)):
        x = logits.detach().clone().requires_grad_()
        out[key] = (F.cross_entropy(x.to(dtype), target, reduction="none", label_smoothing=smoothing), x)
    return out


SHAPES = [(1, 1), (3, 1), (4, 7), (199, 1000), (3, 4097), (2, 32000)]  # row 0 is ignored: (3, 1) has two that are not


@pytest.mark.parametrize("backend,device", backend_cases(BACKENDS))
@pytest.mark.parametrize("rows,classes", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_losses_and_gradients_match_oracle(backend, device, rows, classes, smoothing):
    for dtype in dtypes_for(backend, device):
        logits, target = random_case(rows, classes, dtype, device)
        g = torch.randn(rows, device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        ours_x = logits.clone().requires_grad_()
        with kf.use_backend(backend):
            loss = kf.cross_entropy(ours_x, target, reduction="none", label_smoothing=smoothing)
            loss.backward(g)
        ref = torch_losses(logits, target, smoothing)
        for key in ref:
            ref[key][0].backward(g.to(ref[key][0].dtype))
        what = f"{rows}x{classes} {dtype} {backend} smoothing={smoothing}"
        assert loss.dtype == ref["same"][0].dtype and loss.shape == (rows,)
        assert (loss[target == -100] == 0).all()
        assert_matches_oracle(loss, ref["same"][0].detach(), ref["oracle"][0].detach(), f"loss {what}",
                              reduced=classes)
        assert ours_x.grad.dtype == dtype
        assert (ours_x.grad[target == -100] == 0).all()
        # The gradient's error model: g * (exp(x - lse) - ...) from the lse saved in float32, which
        # rounds it by half an ulp of |lse| (~15 here): every p of the row moves by that relative
        # amount, besides exp's own few ulps. So the floor's scale is |g| (1 + |lse| / 8) a row (4
        # ulps of it: |g| (4 + |lse| / 2) ulps); PyTorch subtracts max and log-sum separately and
        # rounds less (9.5e-7 against the plain bound of 9.3e-7 on an H200: 3x4097, float32).
        lse = torch.logsumexp(logits.double(), dim=-1).abs()
        grad_scale = (g.double().abs() * (1 + lse / 8)).max().item()
        assert_matches_oracle(ours_x.grad, ref["same"][1].grad, ref["oracle"][1].grad, f"grad {what}",
                              reduced=classes, terms_scale=grad_scale)


@pytest.mark.parametrize("backend,device", backend_cases(BACKENDS))
def test_reductions_and_ignored_rows(backend, device):
    logits, target = random_case(33, 50, torch.float32, device, ignored_every=3)
    for reduction in ("mean", "sum", "none"):
        for ignore_index in (-100, 7):
            t = torch.where(target == -100, ignore_index, target)
            t[1] = 7
            x, x64 = logits.clone().requires_grad_(), logits.double().requires_grad_()
            with kf.use_backend(backend):
                ours = kf.cross_entropy(x, t, reduction=reduction, ignore_index=ignore_index)
            expected = F.cross_entropy(x64, t, reduction=reduction, ignore_index=ignore_index)
            g = torch.randn_like(expected)
            with kf.use_backend(backend):
                ours.backward(g.float())
            expected.backward(g)
            # the loss lse - x_t of a row the model gets right cancels to ~1e-3 around the float32
            # lse's rounding (half an ulp of |lse|): the floor is a few ulps of |lse| a row (rows
            # added up under the sum)
            lse = torch.logsumexp(logits.double(), dim=-1).abs().max().item()
            rows = t.numel() if reduction == "sum" else 1
            loss_floor = 4 * torch.finfo(torch.float32).eps * (1 + lse) * rows
            torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=max(1e-6, loss_floor))
            # a row the model gets right has p_t - 1 ~ -1e-4 at its target: there the float32 p_t's
            # error (exp's few ulps, and the saved lse's rounding, half an ulp of |lse|, ~15 here)
            # stays whole while the value cancels; so the absolute floor is the test above's error
            # model, 4 ulps of s (1 + |lse| / 8) for the row's gradient scale s (|g|; |g| / the
            # targets counted, for the mean). A fixed 1e-7 failed at (8, 3) of 33 x 50, seed
            # 64438820: 1.06e-8 off under the mean, 1.85e-7 under 'none'.
            row_scale = g.abs().max().item() / ((t != ignore_index).sum().item() if reduction == "mean" else 1)
            floor = 4 * torch.finfo(torch.float32).eps * row_scale * (1 + lse / 8)
            torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=floor)


@pytest.mark.parametrize("backend,device", backend_cases(BACKENDS))
def test_every_target_ignored_and_no_rows(backend, device):
    with kf.use_backend(backend):
        all_ignored = kf.cross_entropy(torch.randn(4, 9, device=device), torch.full((4,), -100, device=device))
        empty = kf.cross_entropy(torch.randn(0, 9, device=device), torch.zeros(0, dtype=torch.long, device=device))
        empty_sum = kf.cross_entropy(torch.randn(0, 9, device=device), torch.zeros(0, dtype=torch.long, device=device),
                                     reduction="sum")
    assert all_ignored.isnan() and empty.isnan() and empty_sum.item() == 0  # torch's values for these


@pytest.mark.parametrize("backend,device", backend_cases(BACKENDS))
def test_torch_layouts_and_strides(backend, device):
    """(C,) with a 0-d target, (N, C, d1, d2) with classes along dim 1, a strided (sliced) row
    layout, and int32 targets: all as torch computes them."""
    cases = []
    x = torch.randn(11, device=device)
    cases.append((x, torch.tensor(3, device=device)))
    x = torch.randn(2, 6, 3, 4, device=device)
    cases.append((x, torch.randint(0, 6, (2, 3, 4), device=device)))
    x = torch.randn(9, 40, device=device)[:, ::2]  # column stride 2: copied to unit stride
    cases.append((x, torch.randint(0, 20, (9,), device=device)))
    x = torch.randn(12, 64, device=device)[::3, 8:]  # row stride 192, unit columns: read in place
    cases.append((x, torch.randint(0, 56, (4,), device=device, dtype=torch.int32)))
    for logits, target in cases:
        for reduction in ("none", "mean"):
            # detach() keeps the strides (clone() of a strided tensor is dense)
            ours_x, x64 = logits.detach().requires_grad_(), logits.double().requires_grad_()
            assert ours_x.stride() == logits.stride()
            with kf.use_backend(backend):
                ours = kf.cross_entropy(ours_x, target, reduction=reduction)
                ours.sum().backward()
            expected = F.cross_entropy(x64, target.long(), reduction=reduction)
            expected.sum().backward()
            assert ours.shape == expected.shape
            torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ours_x.grad.double(), x64.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend,device", backend_cases(BACKENDS))
def test_target_out_of_range_is_nan(backend, device):
    """A class index outside [0, C) that is not ignore_index: that row's loss and gradient are NaN
    (a GPU kernel cannot raise without a host sync), the other rows are right."""
    logits, target = random_case(6, 10, torch.float32, device)
    target[2], target[4] = 10, -1
    x = logits.clone().requires_grad_()
    with kf.use_backend(backend):
        loss = kf.cross_entropy(x, target, reduction="none")
        loss.backward(torch.ones_like(loss))
    bad = torch.zeros(6, dtype=torch.bool, device=device)
    bad[[2, 4]] = True
    assert loss[bad].isnan().all() and not loss[~bad].isnan().any()
    assert x.grad[bad].isnan().all() and not x.grad[~bad].isnan().any()
    good = F.cross_entropy(logits[~bad].double(), target[~bad], reduction="none")
    torch.testing.assert_close(loss[~bad].double(), good, rtol=1e-5, atol=1e-6)  # float32 losses


def op_samples(device):
    for dtype in (torch.float32, torch.float64):
        for smoothing in (0.0, 0.2):
            logits, target = random_case(5, 13, dtype, device, ignored_every=2)
            yield logits.requires_grad_(), target, -100, smoothing


@pytest.mark.parametrize("device", device_cases())
def test_opcheck(device):
    fwd, bwd = torch.ops.kernelforge.cross_entropy.default, torch.ops.kernelforge.cross_entropy_backward.default
    for logits, target, ignore_index, smoothing in op_samples(device):
        if device == "cuda" and logits.dtype == torch.float64:
            continue  # no GPU kernel takes float64 (the reference does, on the CPU)
        torch.library.opcheck(fwd, (logits, target, ignore_index, smoothing))
        loss, lse = fwd(logits.detach(), target, ignore_index, smoothing)
        g = torch.randn_like(loss)
        torch.library.opcheck(bwd, (g, logits.detach(), target, lse, ignore_index, smoothing))
        torch.library.opcheck(bwd, (g.requires_grad_(), logits, target, lse, ignore_index, smoothing))


def test_double_backward_gradgradcheck():
    """create_graph=True through the registered backward op: Hessian-vector products in float64."""
    logits, target = random_case(4, 6, torch.float64, "cpu", ignored_every=3)
    for smoothing in (0.0, 0.3):
        def f(x):
            return kf.cross_entropy(x, target, reduction="none", label_smoothing=smoothing)
        assert torch.autograd.gradgradcheck(f, (logits.clone().requires_grad_(),))


def test_fake_matches_real():
    op = torch.ops.kernelforge.cross_entropy
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        logits, target = random_case(3, 8, dtype, "cpu")
        real = op(logits, target, -100, 0.0)
        with torch._subclasses.FakeTensorMode() as mode:
            fake = op(mode.from_tensor(logits), mode.from_tensor(target), -100, 0.0)
        assert [(t.shape, t.dtype, t.stride()) for t in real] == [(t.shape, t.dtype, t.stride()) for t in fake]


@pytest.mark.slow
@pytest.mark.parametrize("device", device_cases())
def test_torch_compile_fullgraph(device):
    """A projection and the loss under torch.compile(fullgraph=True): values and gradients as eager."""
    from tests.numerics import assert_compiled_matches_eager

    def lm_head_loss(h, w):
        logits = h @ w
        return kf.cross_entropy(logits, target, label_smoothing=0.05) + kf.cross_entropy(logits, target,
                                                                                          reduction="sum") * 1e-3

    h = torch.randn(16, 32, device=device, requires_grad=True)
    w = torch.randn(32, 300, device=device, requires_grad=True)
    target = torch.randint(0, 300, (16,), device=device)
    target[3] = -100
    # the graphs hold the backend's own work (the reference's torch ops, the Triton kernels), forward
    # and backward, not the kernelforge ops
    _, code = compiled_code(lm_head_loss, h, w, backward=True)
    assert "torch.ops.kernelforge" not in code
    torch._dynamo.reset()
    assert_compiled_matches_eager(lm_head_loss, torch.compile(lm_head_loss, fullgraph=True), (h, w))


def test_eager_fast_path_equals_registered_op():
    # In plain eager mode the op skips the dispatcher (with its own autograd glue when a gradient is
    # needed); under a mode, a transform or torch.compile it goes through torch.ops. Both must give the
    # same values and gradients, and the public function takes the fast path.
    logits, target = random_case(6, 11, torch.float32, "cpu", ignored_every=4)
    op = torch.ops.kernelforge.cross_entropy
    assert cross_entropy_op._plain_eager((logits, target, -100, 0.1))
    assert_eager_path_equals_registered_op(lambda t: cross_entropy_op(t, target, -100, 0.1)[0], cross_entropy_op,
                                           lambda t: op(t, target, -100, 0.1)[0], logits)
    x = logits.clone().requires_grad_()
    loss = kf.cross_entropy(x, target, reduction="sum")
    assert cross_entropy_op.is_eager_node(loss.grad_fn.next_functions[0][0])
    with torch._subclasses.FakeTensorMode() as mode:
        fake = kf.cross_entropy(mode.from_tensor(logits), mode.from_tensor(target), reduction="none")
        assert fake.shape == (6,) and fake.dtype == torch.float32


@pytest.mark.parametrize("backend,device", backend_cases(BACKENDS))
def test_int32_targets_with_an_ignore_index_beyond_int32(backend, device):
    """ignore_index 2**32 matches no int32 target (compared as int64, not wrapped to 0)."""
    logits = torch.randn(3, 4, device=device)
    target = torch.tensor([0, 1, 2], device=device, dtype=torch.int32)
    with kf.use_backend(backend):
        ours = kf.cross_entropy(logits, target, ignore_index=2**32, reduction="none")
    torch.testing.assert_close(ours.double(), F.cross_entropy(logits.double(), target.long(), reduction="none"),
                               rtol=1e-5, atol=1e-6)


def test_module_matches_function():
    logits, target = random_case(7, 20, torch.float32, "cpu")
    module = kf.nn.CrossEntropyLoss(ignore_index=-100, reduction="sum", label_smoothing=0.1)
    torch.testing.assert_close(module(logits, target),
                               kf.cross_entropy(logits, target, reduction="sum", label_smoothing=0.1))
    assert "label_smoothing=0.1" in repr(module)
    with pytest.raises(ValueError, match="reduction must be one of"):
        kf.nn.CrossEntropyLoss(reduction="avg")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_peak_memory_is_logits_and_gradient():
    """bf16 logits forward + backward on the GPU allocate the gradient and O(rows) beside the
    logits: no float32 copy of the logits (F.cross_entropy(logits.float()) makes two)."""
    rows, classes = 2048, 32000
    logits = (torch.randn(rows, classes, device="cuda") * 4).bfloat16().requires_grad_()
    target = torch.randint(0, classes, (rows,), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with kf.use_backend("triton"):
        kf.cross_entropy(logits, target).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    logits_bytes = logits.numel() * logits.element_size()
    assert extra <= logits_bytes + 64 * rows + (1 << 20), f"{extra} bytes beyond the logits ({logits_bytes})"


def test_bad_input_errors():
    x, t = torch.randn(4, 5), torch.randint(0, 5, (4,))
    with pytest.raises(ValueError, match="reduction must be one of"):
        kf.cross_entropy(x, t, reduction="avg")
    with pytest.raises(TypeError, match="label_smoothing must be a real number, got str '0.1'"):
        kf.cross_entropy(x, t, label_smoothing="0.1")
    with pytest.raises(TypeError, match="probability targets are not supported"):
        kf.cross_entropy(x, torch.rand(4, 5))
    with pytest.raises(TypeError, match="target must be class indices of dtype int64 or int32, got torch.int16"):
        kf.cross_entropy(x, t.short())
    with pytest.raises(TypeError, match="logits must have dtype"):
        kf.cross_entropy(x.int(), t)
    with pytest.raises(ValueError, match=r"target must have shape \(4,\) for logits of shape \(4, 5\)"):
        kf.cross_entropy(x, t[:3])
    with pytest.raises(ValueError, match="unbatched logits"):
        kf.cross_entropy(x[0], t)
    with pytest.raises(ValueError, match="got a 0-d tensor"):
        kf.cross_entropy(x[0, 0], t[0])
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\], got 1.5"):
        kf.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(RuntimeError, match="at least one class"):
        kf.cross_entropy(torch.randn(4, 0), t)
    with pytest.raises(RuntimeError, match="at least one class"):
        kf.cross_entropy(torch.randn(4, 0, 3), torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"logits must be \(rows, classes\)"):
        torch.ops.kernelforge.cross_entropy(torch.randn(2, 3, 4), t, -100, 0.0)
    with pytest.raises(RuntimeError, match="grad_loss must be"):
        torch.ops.kernelforge.cross_entropy_backward(torch.ones(3), x, t, torch.zeros(4), -100, 0.0)
    if HAS_CUDA:
        with pytest.raises(RuntimeError, match="same device"):
            kf.cross_entropy(x.cuda(), t)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_inductor_launches_the_triton_kernels():
    """Under torch.compile the op decomposes into its Triton kernels, which Inductor launches from its
    own code, forward and backward (lowered with the forward here), with no kernelforge op left: bf16
    logits of 4096 classes, as eager computes them."""
    logits = (torch.randn(512, 4096, device="cuda") * 4).bfloat16().requires_grad_()
    target = torch.randint(0, 4096, (512,), device="cuda")
    target[::7] = -100

    def loss(x):
        return kf.cross_entropy(x, target, label_smoothing=0.1)

    got = assert_inductor_launches(loss, (logits,), ["cross_entropy_forward_kernel", "cross_entropy_backward_kernel"],
                                   backward=True)
    (got_grad,) = torch.autograd.grad(got, logits)
    expected = loss(logits)
    (grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)  # the mean's float32 sum, in Inductor's order
    torch.testing.assert_close(got_grad, grad)
