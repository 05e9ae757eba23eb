"""kernelforge.fused_linear_cross_entropy against F.cross_entropy over the whole logits (float64
as the oracle, PyTorch's float32-loss recipe at the inputs' dtype as the yardstick): every
option (reductions, ignore_index, label smoothing, softcapping, z-loss, bias), chunks that do
and do not divide the rows, gradients of x, weight and bias, accumulation over micro-batches,
NaN for a bad target, the registered ops (opcheck), torch.compile, bad input. A "mean" or "sum"
loss with a gradient to come computes its gradients in the forward (kernelforge::
linear_cross_entropy_reduced); "none", or no gradient, takes the recomputing backward: both run
through every check."""
import pytest
import torch
import torch.nn.functional as F

import kernelforge as kf
from kernelforge.ops import linear_cross_entropy as lce
from kernelforge.ops.linear_cross_entropy import backward_blocks, default_chunk_rows
from tests.conftest import backend_cases, needs_cuda
from tests.numerics import assert_matches_oracle


def torch_loss(x, weight, target, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
               softcap=None, z_loss=0.0):
    """The unfused head and loss: logits at the inputs' dtype, the loss in float32 (float64 for
    float64), softcap and z-loss written out."""
    logits = x @ weight.t() if bias is None else x @ weight.t() + bias
    return loss_of_logits(logits, target, ignore_index, reduction, label_smoothing, softcap, z_loss)


def loss_of_logits(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None,
                   z_loss=0.0):
    """torch_loss after the head: float32 (float64 for float64) from the logits in their dtype."""
    logits = logits.double() if logits.dtype == torch.float64 else logits.float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    flat, t = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    rows = F.cross_entropy(flat, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    rows = rows + torch.where(t == ignore_index, 0.0, z_loss * torch.logsumexp(flat, -1) ** 2)
    if reduction == "none":
        return rows.view(target.shape)
    return rows.sum() if reduction == "sum" else rows.sum() / (t != ignore_index).sum()


def oracle_logits(exact, x):
    """The largest logit magnitude, in float64."""
    weight, bias = exact[1].detach(), exact[2]
    logits = x.double() @ weight.t() + (0 if bias is None else bias.detach())
    return logits.abs().max().item()


def dtypes_for(backend, device):
    if backend == "reference":
        return [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    # the interpreter's bf16 tl.dot is wrong: bf16 Triton GEMMs are GPU-only
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


OPTIONS = [dict(), dict(reduction="sum", label_smoothing=0.1), dict(reduction="none", softcap=5.0),
           dict(z_loss=1e-3, ignore_index=3), dict(softcap=3.0, z_loss=1e-4, label_smoothing=0.2)]


def check(backend, x, weight, target, bias, chunk_rows, what="", **options):
    inputs = [x, weight, bias]
    mine = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    same = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    exact = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    with kf.use_backend(backend):
        loss = kf.fused_linear_cross_entropy(mine[0], mine[1], target, mine[2], chunk_rows=chunk_rows, **options)
    yard = torch_loss(same[0], same[1], target, same[2], **options)
    oracle = torch_loss(exact[0], exact[1], target, exact[2], **options)
    label = f"{backend} {x.dtype} {what} x{tuple(x.shape)} V{weight.shape[0]} chunk={chunk_rows} {options}"
    assert loss.dtype == yard.dtype and loss.shape == yard.shape, label
    # The loss's error model: a row is lse - z_t of logits rounded to x's dtype by the GEMM (ours
    # and PyTorch's round each logit independently), within about an ulp of the largest logit
    # each; a sum adds the rows'. So the floor is counted in x's dtype at that scale.
    logit_scale = 2 * (oracle_logits(exact, x) if x.dtype != torch.float64 else 1.0)
    rows = target.numel() if options.get("reduction") == "sum" else 1
    assert_matches_oracle(loss, yard.detach(), oracle.detach(), f"{label} loss", reduced=x.shape[-1],
                          terms_scale=logit_scale * rows, floor_dtype=x.dtype if x.dtype != torch.float64 else None)
    grad = torch.randn_like(loss)
    names = [n for n, t in zip(("x", "weight", "bias"), inputs) if t is not None]
    with kf.use_backend(backend):
        got = torch.autograd.grad(loss, [t for t in mine if t is not None], grad)
    want = torch.autograd.grad(oracle, [t for t in exact if t is not None], grad.double())
    base = torch.autograd.grad(yard, [t for t in same if t is not None], grad)
    for name, g, w, b in zip(names, got, want, base):
        assert g.dtype == b.dtype and g.shape == b.shape, f"{label} grad {name}"
        # the logits' gradient (|.| <= 1 a row, times the loss's gradient) enters a GEMM over the
        # vocabulary (x's) or the rows (weight's)
        scale = grad.abs().max().item() * (x.abs().max().item() + weight.abs().max().item()) * 2
        assert_matches_oracle(g, b, w, f"{label} grad {name}", reduced=weight.shape[0], terms_scale=scale)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
@pytest.mark.parametrize("options", OPTIONS, ids=["mean", "sum-smoothing", "none-softcap", "zloss-ignore3",
                                                  "softcap-zloss-smoothing"])
def test_matches_the_unfused_loss(backend, device, options, monkeypatch):
    # 11 rows in chunks of 4 (a remainder of 3) and in one chunk, 37 classes, hidden 24; some
    # targets ignored. The backward's blocks: rows in blocks of 4 (chunk 4), one block (chunk
    # 16); with slices of the vocabulary down to 8 classes, slices of 8 over all rows (chunk 4)
    # and blocks of 4 rows x 8 classes (chunk 1), each with a narrower last slice
    monkeypatch.setattr(lce, "MIN_SLICE_CLASSES", 8)
    assert backward_blocks(11, 37, 4) == (11, 8) and backward_blocks(11, 37, 1) == (4, 8)
    for dtype in dtypes_for(backend, device):
        x = torch.randn(11, 24, device=device, dtype=dtype)
        weight = torch.randn(37, 24, device=device, dtype=dtype) / 24 ** 0.5
        bias = torch.randn(37, device=device, dtype=dtype)
        target = torch.randint(0, 37, (11,), device=device)
        target[::4] = options.get("ignore_index", -100)
        check(backend, x, weight, target, bias, 4, "bias", **options)
        check(backend, x, weight, target, None, 16, "no bias", **options)
        check(backend, x, weight, target, bias, 1, "bias", **options)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_batched_rows_and_accumulated_gradients(backend, device):
    # x (batch, tokens, hidden) with target (batch, tokens); two micro-batches' backward passes add
    # into .grad as the unfused head's do
    x = torch.randn(2, 5, 16, device=device)
    weight = torch.randn(29, 16, device=device, requires_grad=True)
    target = torch.randint(0, 29, (2, 5), device=device)
    check(backend, x, weight.detach(), target, None, 3, "batched")
    with kf.use_backend(backend):
        for half in (slice(0, 1), slice(1, 2)):
            kf.fused_linear_cross_entropy(x[half], weight, target[half], chunk_rows=3).backward()
    want = torch.zeros_like(weight)
    for half in (slice(0, 1), slice(1, 2)):
        w = weight.detach().clone().requires_grad_()
        torch_loss(x[half], w, target[half]).backward()
        want += w.grad
    torch.testing.assert_close(weight.grad, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_bad_target_gives_nan_and_all_ignored_mean_is_nan(backend, device):
    x, weight = torch.randn(4, 8, device=device), torch.randn(10, 8, device=device)
    with kf.use_backend(backend):
        rows = kf.fused_linear_cross_entropy(x, weight, torch.tensor([1, 10, -3, 2], device=device), reduction="none")
        assert rows[1:3].isnan().all() and not rows[[0, 3]].isnan().any()
        ignored = torch.full((4,), -100, device=device)
        assert kf.fused_linear_cross_entropy(x, weight, ignored).isnan()
        assert kf.fused_linear_cross_entropy(x, weight, ignored, reduction="sum") == 0


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_gradients_computed_in_the_forward(backend, device):
    # The reduced loss's path: the same loss as without a gradient; only the gradients asked for
    # (a frozen head: x's alone; frozen activations: the weight's and bias's); a bias's gradient
    # summed over chunks; a second backward or a double backward refused with the way out named
    x = torch.randn(9, 16, device=device)
    weight, bias = torch.randn(23, 16, device=device) / 4, torch.randn(23, device=device)
    target = torch.randint(0, 23, (9,), device=device)
    target[2] = -100
    with kf.use_backend(backend):
        with torch.no_grad():
            plain = kf.fused_linear_cross_entropy(x, weight, target, bias, chunk_rows=4)
        for needs in [(True, False, False), (False, True, True), (True, True, False)]:
            mine = [t.clone().requires_grad_(need) for t, need in zip((x, weight, bias), needs)]
            exact = [t.double().requires_grad_(need) for t, need in zip((x, weight, bias), needs)]
            loss = kf.fused_linear_cross_entropy(*mine[:2], target, mine[2], chunk_rows=4)
            assert lce.linear_cross_entropy_reduced_op.is_eager_node(loss.grad_fn)
            torch.testing.assert_close(loss, plain, rtol=1e-6, atol=1e-6)
            (loss * 3).backward()
            (torch_loss(*exact[:2], target, exact[2]) * 3).backward()
            for name, got, want in zip("x weight bias".split(), mine, exact):
                assert (got.grad is None) == (want.grad is None), f"{needs} {name}"
                if got.grad is not None:
                    torch.testing.assert_close(got.grad, want.grad.float(), rtol=1e-4, atol=1e-5)
        # every target ignored: a NaN mean (0 / 0, as torch's) and zero gradients (torch's too)
        ignored = torch.full_like(target, -100)
        for reduction in ("mean", "sum"):
            mine = [t.clone().requires_grad_() for t in (x, weight)]
            exact = [t.double().requires_grad_() for t in (x, weight)]
            loss = kf.fused_linear_cross_entropy(*mine, ignored, reduction=reduction, chunk_rows=4)
            want = torch_loss(*exact, ignored, reduction=reduction)
            assert loss.isnan().item() == want.isnan().item() == (reduction == "mean")
            loss.backward()
            want.backward()
            for got, expected in zip(mine, exact):
                assert torch.equal(got.grad, expected.grad.float()) and not got.grad.any(), reduction
        w = weight.clone().requires_grad_()
        loss = kf.fused_linear_cross_entropy(x, w, target, reduction="sum", chunk_rows=4)
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="second backward .* reduction='none'"):
            loss.backward()
        loss = kf.fused_linear_cross_entropy(x, w, target, chunk_rows=4)
        with pytest.raises(RuntimeError, match="create_graph=True .* reduction='none'"):
            torch.autograd.grad(loss, w, create_graph=True)


def test_default_chunk_rows_and_backward_blocks():
    # logits of about x's own size (2^26 at least), a power of two, at least 1, at most the rows
    assert default_chunk_rows(8192, 128256, 2048) == 512
    assert default_chunk_rows(65536, 128256, 4096) == 2048
    assert default_chunk_rows(8192, 1000, 2048) == 8192
    assert default_chunk_rows(3, 128256, 16) == 3
    assert default_chunk_rows(100, 10 ** 9, 16) == 1
    assert default_chunk_rows(0, 10, 10) == 1
    # with the gradients computed in the forward, the weight's size at least (2048 rows at Llama-3's
    # head; 1024 at Gemma 3's 262144 x 1152)
    assert default_chunk_rows(8192, 128256, 2048, gradients_in_forward=True) == 2048
    assert default_chunk_rows(8192, 262144, 1152, gradients_in_forward=True) == 1024
    assert default_chunk_rows(65536, 128256, 4096, gradients_in_forward=True) == 4096
    assert default_chunk_rows(3, 128256, 16, gradients_in_forward=True) == 3
    # the backward: chunk_rows x vocab logits at most, all rows in one block while slices of
    # 4096 classes fit, slices a multiple of 128
    assert backward_blocks(8192, 128256, 512) == (8192, 7936)
    assert backward_blocks(65536, 128256, 2048) == (32768, 7936)  # two even blocks, not 64128 + 1408
    assert backward_blocks(65536, 128256, 512) == (13108, 4992)
    assert backward_blocks(100, 1000, 100) == (100, 1000)
    assert backward_blocks(100, 1000, 7) == (7, 1000)
    for rows, vocab, chunk in [(8192, 128256, 512), (65536, 128256, 512), (5, 7, 1), (100, 50000, 3)]:
        row_block, classes = backward_blocks(rows, vocab, chunk)
        assert row_block * classes <= max(chunk * vocab, min(vocab, lce.MIN_SLICE_CLASSES))


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_opcheck(backend, device):
    x, weight = torch.randn(5, 8, device=device), torch.randn(13, 8, device=device)
    bias, target = torch.randn(13, device=device), torch.tensor([0, 12, -100, 4, 4], device=device)
    with kf.use_backend(backend):
        for args in [(x, weight, target, bias, -100, 0.1, 0.0, 0.0, 2),
                     (x, weight, target, None, -100, 0.0, 4.0, 1e-3, 8)]:
            torch.library.opcheck(torch.ops.kernelforge.linear_cross_entropy.default, args)
            loss, lse = torch.ops.kernelforge.linear_cross_entropy(*args)
            torch.library.opcheck(torch.ops.kernelforge.linear_cross_entropy_backward.default,
                                  (torch.randn_like(loss), *args[:4], lse, *args[4:]))
        xg, wg, bg = (t.clone().requires_grad_() for t in (x, weight, bias))
        for args in [(xg, wg, target, bg, -100, 0.1, 0.0, 0.0, 2, True, True, True, True),
                     (xg, wg, target, None, -100, 0.0, 4.0, 1e-3, 8, False, True, False, False)]:
            torch.library.opcheck(torch.ops.kernelforge.linear_cross_entropy_reduced.default, args)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("options", [dict(), dict(softcap=30.0, z_loss=1e-4, label_smoothing=0.1)],
                         ids=["plain", "softcap-zloss-smoothing"])
def test_a_language_models_head_on_the_gpu(options):
    # Llama-3's head at 2 x 2048 tokens: hidden 2048, 128256 classes, bf16, default chunks (8 row
    # chunks forward; slices of the vocabulary over all rows backward, the last one narrower)
    x = torch.randn(2, 2048, 2048, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(128256, 2048, device="cuda") / 2048 ** 0.5).to(torch.bfloat16)
    target = torch.randint(0, 128256, (2, 2048), device="cuda")
    target[:, -7:] = -100
    assert backward_blocks(4096, 128256, default_chunk_rows(4096, 128256, 2048)) == (4096, 16000)
    check("triton", x, weight, target, None, None, "llama-head", **options)
    compiled = torch.compile(lambda x, w: kf.fused_linear_cross_entropy(x, w, target, **options), fullgraph=True)
    xg, wg = x.clone().requires_grad_(), weight.clone().requires_grad_()
    got = compiled(xg, wg)
    got.backward()
    xe, we = x.clone().requires_grad_(), weight.clone().requires_grad_()
    want = kf.fused_linear_cross_entropy(xe, we, target, **options)
    want.backward()
    # the compiled graph runs the same op (kept whole: its GEMMs are opaque)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xg.grad, xe.grad)
    torch.testing.assert_close(wg.grad, we.grad)


def test_compiles_without_graph_breaks():
    x = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    target = torch.randint(0, 11, (6,))

    def f(x, weight):
        return kf.fused_linear_cross_entropy(x, weight, target, softcap=4.0, chunk_rows=4)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got, want = compiled(x, weight), f(x, weight)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (x, weight)), torch.autograd.grad(want, (x, weight))):
        torch.testing.assert_close(a, b)


def test_bad_input_is_rejected():
    x, weight, target = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    cases = [
        ((x, weight, target), {"reduction": "avg"}, ValueError, "reduction must be one of"),
        ((x, weight, target[:3]), {}, ValueError, r"target must have x's shape without its last dim"),
        ((x, weight.half(), target), {}, RuntimeError, "same dtype"),
        ((x.int(), weight, target), {}, TypeError, "x must have dtype"),
        ((x, weight[:, :5], target), {}, RuntimeError, r"weight must be \(vocab, 8\)"),
        ((x, weight, target.float()), {}, TypeError, "target must be class indices"),
        ((x, weight, target, torch.randn(9)), {}, RuntimeError, r"bias must be \(10,\)"),
        ((x, weight, target), {"label_smoothing": 1.5}, ValueError, "label_smoothing must be in"),
        ((x, weight, target), {"softcap": -1.0}, ValueError, "softcap must be positive"),
        ((x, weight, target), {"z_loss": -1.0}, ValueError, "z_loss must be >= 0"),
        ((x, weight, target), {"softcap": "30"}, TypeError, "softcap must be a real number, got str '30'"),
        ((x, weight, target), {"z_loss": None}, TypeError, "z_loss must be a real number, got NoneType None"),
        ((x, weight, target), {"chunk_rows": 0}, ValueError, "chunk_rows must be >= 1"),
        ((x, [1.0], target), {}, TypeError, "weight must be a tensor"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            kf.fused_linear_cross_entropy(*args, **kwargs)


def test_module():
    # kf.nn.FusedLinearCrossEntropyLoss: the function with its options kept; a bad option is
    # rejected when the module is built
    x, weight, target = torch.randn(5, 8), torch.randn(12, 8), torch.tensor([1, 2, -100, 11, 0])
    module = kf.nn.FusedLinearCrossEntropyLoss(reduction="sum", label_smoothing=0.1, softcap=6.0, z_loss=1e-3)
    want = kf.fused_linear_cross_entropy(x, weight, target, reduction="sum", label_smoothing=0.1, softcap=6.0,
                                         z_loss=1e-3)
    torch.testing.assert_close(module(x, weight, target), want)
    assert "softcap=6.0" in repr(module)
    with pytest.raises(ValueError, match="reduction must be one of"):
        kf.nn.FusedLinearCrossEntropyLoss(reduction="avg")
