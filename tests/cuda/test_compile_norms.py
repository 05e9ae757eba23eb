"""The norms and bias + GELU CUDA extensions.

CPU: the launchers refuse what they do not implement before building anything
(test_compiler.py compiles every .cu for sm_90 with -Werror and checks that no kernel spills).
GPU: the launchers against the reference on shapes that take every launch path (the row
lengths where the paths switch, unaligned rows, broadcast and strided rows, every
optional input), so a wrong index shows up as a failure here, not as a subtle error in
the op tests. Tolerances are loose sanity bounds; tests/ops/ hold the accuracy rule.
"""

import pytest
import torch

from tests.conftest import needs_cuda


def test_launchers_refuse_what_they_do_not_implement():
    from kernelforge.cuda import activations, norms

    x = torch.randn(3, 8)
    for kind in ("silu", "relu"):
        with pytest.raises(NotImplementedError, match="'gelu' and 'gelu_tanh'"):
            activations.act_forward_rows(x, None, kind)
        with pytest.raises(NotImplementedError, match="'gelu' and 'gelu_tanh'"):
            activations.act_backward_rows(x, x, None, kind, False)
    with pytest.raises(NotImplementedError, match="GLU"):
        activations.glu_forward_rows(x, x, "silu")
    assert "CUDA tensors" in norms.why_not(x)
    meta = torch.empty(3, 8, device="meta")
    assert "CUDA tensors" in norms.why_not(meta)


# ----------------------------------------------------------------------------- GPU
# Row lengths around every switch: forward warp (<= 512) / block (<= 8192) / shared memory
# (<= 116K 16-bit, 58K fp32) / streamed; backward warp (<= 512) / block (<= 8192) / tiles.
NORM_COLS = [1, 7, 64, 100, 512, 513, 1000, 2048, 4096, 4104, 8192, 8200, 16384, 65536, 70000]
TOL = {torch.float32: (2e-4, 2e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (8e-2, 8e-2)}


def _rows(rows, cols, dtype, layout):
    if layout == "dense":
        return torch.randn(rows, cols, device="cuda", dtype=dtype)
    if layout == "strided":  # row stride cols + 8: still 16-byte aligned rows
        return torch.randn(rows, cols + 8, device="cuda", dtype=dtype)[:, :cols]
    if layout == "unaligned":  # rows start one element off a 16-byte boundary
        return torch.randn(rows * cols + 1, device="cuda", dtype=dtype)[1:].view(rows, cols)
    assert layout == "broadcast"
    return torch.randn(1, cols, device="cuda", dtype=dtype).expand(rows, cols)


def _close(actual, expected, dtype, what):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cols", NORM_COLS)
@pytest.mark.parametrize("rms", [False, True])
def test_norm_rows_match_reference(cols, dtype, rms):
    from kernelforge.cuda import norms
    from kernelforge.reference import norms as ref

    rows = 37 if cols <= 16384 else 5
    for layout, residual, weight_dtype, bias in [
        ("dense", False, dtype, True),
        ("strided", True, torch.float32, False),
        ("unaligned", True, None, True),
        ("broadcast", False, dtype, False),
    ]:
        x = _rows(rows, cols, dtype, layout)
        res = _rows(rows, cols, dtype, "dense") if residual else None
        w = None if weight_dtype is None else torch.randn(cols, device="cuda", dtype=weight_dtype)
        b = torch.randn(cols, device="cuda", dtype=w.dtype if w is not None else dtype) if bias else None
        offset = 1.0 if rms and w is not None else 0.0
        got = norms.norm_forward_rows(x, res, w, b, 1e-5, rms, offset)
        want = ref.norm_forward_rows(x, res, w, b, 1e-5, rms, offset)
        what = f"{layout} residual={residual} w={weight_dtype} bias={bias}"
        _close(got[0], want[0], dtype, "y " + what)
        if residual:
            assert torch.equal(got[1], want[1]), "residual_out must be exactly x + residual rounded"
        if not rms:
            _close(got[2], want[2], torch.float32, "mean " + what)
        _close(got[3], want[3], torch.float32, "rstd " + what)
        h = got[1] if residual else x
        gy = _rows(rows, cols, dtype, layout)
        gres = _rows(rows, cols, dtype, "dense") if residual else None
        g = norms.norm_backward_rows(gy, gres, h, w, torch.float32 if bias else None, got[2], got[3], rms, offset, True)
        e = ref.norm_backward_rows(gy, gres, h, w, torch.float32 if bias else None, got[2], got[3], rms, offset, True)
        _close(g[0], e[0], dtype, "grad_h " + what)
        if w is not None:
            assert g[1].dtype == w.dtype
            torch.testing.assert_close(g[1].float(), e[1].float(), rtol=1e-2, atol=1e-2 * rows ** 0.5)
        if bias:
            torch.testing.assert_close(g[2].float(), e[2].float(), rtol=1e-3, atol=1e-3 * rows ** 0.5)
        again = norms.norm_backward_rows(gy, gres, h, w, torch.float32 if bias else None, got[2], got[3], rms, offset, True)
        for a, c in zip(g, again):
            assert a is None or torch.equal(a, c), "the backward must be bitwise deterministic"


@pytest.mark.gpu
@needs_cuda
def test_norm_rows_long_and_many():
    # The streamed forward (rows longer than shared memory) and the tile backward over
    # many row ranges; and a many-row short case for the partial-sum stage.
    from kernelforge.cuda import norms
    from kernelforge.reference import norms as ref

    for rows, cols, dtype in [(3, 262144, torch.float32), (2, 262144, torch.bfloat16), (20000, 256, torch.bfloat16)]:
        x = torch.randn(rows, cols, device="cuda", dtype=dtype)
        w = torch.randn(cols, device="cuda", dtype=torch.float32)
        b = torch.randn(cols, device="cuda", dtype=torch.float32)
        got = norms.norm_forward_rows(x, None, w, b, 1e-5, False, 0.0)
        want = ref.norm_forward_rows(x, None, w, b, 1e-5, False, 0.0)
        _close(got[0], want[0], dtype, f"y {rows}x{cols}")
        gy = torch.randn_like(x)
        g = norms.norm_backward_rows(gy, None, x, w, torch.float32, got[2], got[3], False, 0.0, True)
        e = ref.norm_backward_rows(gy, None, x, w, torch.float32, got[2], got[3], False, 0.0, True)
        _close(g[0], e[0], dtype, f"grad_h {rows}x{cols}")
        torch.testing.assert_close(g[1], e[1], rtol=1e-2, atol=1e-2 * rows ** 0.5)
        torch.testing.assert_close(g[2], e[2], rtol=1e-3, atol=1e-3 * rows ** 0.5)


@pytest.mark.gpu
@needs_cuda
def test_norm_rows_empty():
    from kernelforge.cuda import norms

    x = torch.empty(0, 16, device="cuda")
    w = torch.randn(16, device="cuda")
    y, _, mean, rstd = norms.norm_forward_rows(x, None, w, None, 1e-5, False, 0.0)
    assert y.shape == (0, 16) and mean.shape == (0,) and rstd.shape == (0,)
    gh, gw, gb = norms.norm_backward_rows(x, None, x, w, torch.float32, mean, rstd, False, 0.0, True)
    assert gh.shape == (0, 16) and torch.equal(gw, torch.zeros_like(w)) and torch.equal(gb, torch.zeros(16, device="cuda"))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cols", [1, 7, 64, 1000, 4096, 8200])
@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh"])
def test_bias_gelu_rows_match_reference(cols, dtype, kind):
    from kernelforge.cuda import activations
    from kernelforge.reference import activations as ref

    rows = 300
    for layout, bias_dtype in [("dense", dtype), ("strided", torch.float32), ("unaligned", None),
                               ("broadcast", dtype)]:
        x = _rows(rows, cols, dtype, layout)
        b = None if bias_dtype is None else torch.randn(cols, device="cuda", dtype=bias_dtype)
        _close(activations.act_forward_rows(x, b, kind), ref.act_forward_rows(x, b, kind), dtype, f"y {layout}")
        gy = _rows(rows, cols, dtype, "dense")
        gx, gb = activations.act_backward_rows(gy, x, b, kind, True)
        ex, eb = ref.act_backward_rows(gy, x, b, kind, True)
        _close(gx, ex, dtype, f"grad_x {layout}")
        if b is None:
            assert gb is None
        else:
            assert gb.dtype == b.dtype
            torch.testing.assert_close(gb.float(), eb.float(), rtol=2e-2, atol=1e-2 * rows ** 0.5)
            assert torch.equal(activations.act_backward_rows(gy, x, b, kind, True)[1], gb), "deterministic"
