"""kernelforge.triton._launch.launch: Triton's launch without its per-call binding.

The direct path reuses a compiled kernel for later calls whose arguments specialize the same
way, so the tests change each thing Triton specializes on (an int's == 1 and % 16, a pointer's
dtype and 16-byte alignment, a constexpr) between calls and check every result."""
import itertools
import os

import pytest
import torch

from tests.conftest import HAS_CUDA, needs_cuda

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from kernelforge.triton import _launch  # noqa: E402
from kernelforge.triton._launch import _spec, launch  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
on_this_device = pytest.mark.skipif(not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                    reason="Triton on CPU needs TRITON_INTERPRET=1")


@triton.jit
def _affine_kernel(X, Y, n, stride, scale, shift, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    keep = offs < n
    x = tl.load(X + offs * stride, mask=keep, other=0.0).to(tl.float32)
    tl.store(Y + offs, (x * scale + shift + n + OFFSET).to(Y.dtype.element_ty), mask=keep)


def _expected(x, n, stride, scale, shift, offset):
    return (x[: n * stride: stride].float() * scale + shift + n + offset)


def _run(x, n, stride, scale, shift, offset, dtype):
    y = torch.full((64,), -7.0, dtype=dtype, device=x.device)
    launch(_affine_kernel, (1,), x, y, n, stride, scale, shift, OFFSET=offset, BLOCK=64, num_warps=1)
    return y


def _sample_args():
    """Values on each side of everything Triton specializes on."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    base = torch.zeros(64, device="cpu")
    matrix = torch.zeros(64, 64, dtype=torch.bfloat16)
    descriptors = [TensorDescriptor(m, list(m.shape), [64, 1], block) for m, block in (
        (matrix, [16, 32]), (matrix[1:], [16, 32]), (matrix, [32, 16]), (matrix.half(), [16, 32]))]
    return [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**32, 2**63 - 1, 2**63,
            0.0, 1.0, 2.5, True, False, None, base, base[1:], base[4:], base.half(), base.half()[1:],
            base.to(torch.bfloat16)[8:], base.double(), *descriptors]


def test_spec_separates_whatever_triton_separates():
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    args = _sample_args()
    native = [native_specialize_impl(BaseBackend, a, False, True, True) for a in args]
    ours = [_spec(a) for a in args]
    for (i, a), (j, b) in itertools.combinations(enumerate(args), 2):
        if ours[i] == ours[j]:
            assert native[i] == native[j], f"{a!r} and {b!r} share a key but Triton specializes them apart"
    # different Python types never share a key (an int 1 and a float 1.0 compile apart)
    assert _spec(1) != _spec(1.0) and _spec(0) != _spec(False)


def test_value_keys_are_finer_than_the_specialization():
    """Two launches that share a _key share every argument's _spec (so the entry found by value is the
    entry of their specialization); bools and ints of equal value, and None, keep apart."""
    args = _sample_args()
    keys = [_launch._key(None, 0, (a,), {}) for a in args]
    for (i, a), (j, b) in itertools.combinations(enumerate(args), 2):
        if keys[i] == keys[j]:
            assert _spec(a) == _spec(b), f"{a!r} and {b!r} share a value key but not a specialization"
    assert _launch._key(None, 0, (1,), {}) != _launch._key(None, 0, (True,), {})
    assert _launch._key(None, 0, (0,), {}) != _launch._key(None, 0, (None,), {})


def test_spec_refuses_what_it_does_not_know():
    with pytest.raises(_launch._NotDirect):
        _spec(object())
    with pytest.raises(_launch._NotDirect):
        _spec((1, 2))


@on_this_device
@pytest.mark.parametrize("device", [pytest.param(DEVICE, marks=[pytest.mark.gpu] if HAS_CUDA else [])])
def test_every_specialization_change_gives_the_right_result(device):
    """Calls in an order that switches each specialized property back and forth, twice (the
    second round runs on cached entries): every result equals the formula."""
    x32 = torch.randn(64 * 17 + 8, device=device)
    x16 = x32.half()
    calls = []
    for x in (x32, x32[1:], x16, x16[3:], x32[4:]):
        for n, stride in ((1, 1), (16, 1), (17, 2), (5, 16), (33, 1), (1, 17)):
            for offset in (0, 3):
                calls.append((x, n, stride, 0.5 + n, float(stride), offset))
    for _ in range(2):
        for x, n, stride, scale, shift, offset in calls:
            for dtype in (torch.float32, torch.float16):
                y = _run(x, n, stride, scale, shift, offset, dtype)
                want = _expected(x, n, stride, scale, shift, offset)
                torch.testing.assert_close(y[:n].float(), want, rtol=2e-3, atol=1e-3,
                                           msg=lambda m: f"n={n} stride={stride} offset={offset} {dtype}: {m}")
                assert (y[n:] == -7).all(), "wrote past n"


@needs_cuda
@pytest.mark.gpu
def test_repeated_calls_reuse_one_entry_and_skip_triton(monkeypatch):
    monkeypatch.setattr(_launch, "_COMPILED", {})  # whatever other tests compiled: not here
    monkeypatch.setattr(_launch, "_BY_VALUE", {})
    calls = []
    original = type(_affine_kernel).run
    monkeypatch.setattr(type(_affine_kernel), "run", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    x = torch.randn(64, device="cuda")
    for n in (8, 9, 10):  # one specialization (not 1, not % 16): Triton once, then the entry
        y = _run(x, n, 1, 1.0, 0.0, 0, torch.float32)
        torch.testing.assert_close(y[:n], _expected(x, n, 1, 1.0, 0.0, 0))
    assert len(_launch._COMPILED) == 1 and len(calls) == 1
    assert len(_launch._BY_VALUE) == 2  # 9 and 10 found 8's entry by specialization, then keep it by value
    _run(x, 16, 1, 1.0, 0.0, 0, torch.float32)  # % 16: a new specialization, through Triton once
    assert len(_launch._COMPILED) == 2 and len(calls) == 2


@needs_cuda
@pytest.mark.gpu
def test_launch_hooks_see_every_launch():
    """With a launch hook installed (a profiler's), launches go through Triton, which calls it."""
    from triton import knobs

    x = torch.randn(64, device="cuda")
    _run(x, 8, 1, 1.0, 0.0, 0, torch.float32)  # an entry exists
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        _run(x, 8, 1, 1.0, 0.0, 0, torch.float32)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1


@needs_cuda
@pytest.mark.gpu
def test_runs_on_the_current_stream_and_in_cuda_graphs():
    x = torch.randn(64, device="cuda")
    y = torch.zeros(64, device="cuda")
    launch(_affine_kernel, (1,), x, y, 20, 1, 2.0, 1.0, OFFSET=0, BLOCK=64, num_warps=1)  # an entry exists
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    y.zero_()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        launch(_affine_kernel, (1,), x, y, 20, 1, 2.0, 1.0, OFFSET=0, BLOCK=64, num_warps=1)
    assert (y == 0).all()  # captured, not run
    x.add_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y[:20], x[:20] * 2.0 + 1.0 + 20)


@needs_cuda
@pytest.mark.gpu
def test_positional_constexpr_is_refused():
    x = torch.randn(64, device="cuda")
    y = torch.zeros(64, device="cuda")
    with pytest.raises(TypeError, match="constexpr parameters by keyword"):
        launch(_affine_kernel, (1,), x, y, 20, 1, 2.0, 1.0, 0, BLOCK=64)


def test_host_cdiv_and_next_power_of_2_agree_with_tritons():
    """The launchers' plain-Python cdiv / next_power_of_2 (Triton's are ConstexprFunctions, ~2 us
    a host call) give what Triton's give, over small, odd and 32-bit-edge values."""
    values = list(range(-70, 5000)) + [2 ** 31 - 1, 2 ** 31, 2 ** 31 + 1, 3 * 2 ** 40 + 7]
    for n in values:
        assert _launch.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 127, 128, 1000):
            assert _launch.cdiv(n, d) == triton.cdiv(n, d), (n, d)
