"""Eager plans (kernelforge._eager_plans): from the third call at a signature an op replays its
recorded allocations, fills and Triton launches on the call's own tensors. Replays must equal the
implementation on fresh inputs (new memory every call), and whatever a replay would miss must leave
the signature without a plan."""
import pytest
import torch
import triton
import triton.language as tl

import kernelforge as kf
from kernelforge import _eager_plans, backends
from kernelforge.ops._opdef import define_op
from kernelforge.triton import interpreter_enabled
from kernelforge.triton._launch import cdiv, launch

from tests.conftest import needs_cuda


@pytest.fixture(params=[
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreter_enabled(),
                                                 reason="Triton on CPU needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def device(request):
    return request.param


replays = {"count": 0}


@pytest.fixture(autouse=True)
def count_replays(monkeypatch):
    run = _eager_plans.Plan.run

    def counted(self, inputs):
        replays["count"] += 1
        return run(self, inputs)

    replays["count"] = 0
    monkeypatch.setattr(_eager_plans.Plan, "run", counted)
    backends.forget_choices()  # no plan of an earlier test's signatures


@triton.jit
def _scale_add_kernel(x_ptr, out_ptr, n, scale, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    y = tl.load(x_ptr + offsets, mask=mask).to(tl.float32) * scale
    if ACCUMULATE:
        y += tl.load(out_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, out, scale, accumulate=False):
    launch(_scale_add_kernel, (cdiv(x.numel(), 64),), x, out, x.numel(), scale, ACCUMULATE=accumulate, BLOCK=64)


def _define(name, impl, fake=None):
    return define_op(f"kernelforge::plans_probe_{name}(Tensor x, Tensor y, float scale) -> Tensor", impl,
                     fake or (lambda x, y, scale: torch.empty_like(x)))


def _scaled(x, y, scale):  # x * scale, out allocated here: the plain case
    out = torch.empty_like(x)
    _launch(x, out, scale)
    return out


def _sum_of_two(x, y, scale):  # zeros, then two accumulating launches: the fill must be replayed
    out = torch.zeros_like(x)
    _launch(x, out, scale, accumulate=True)
    _launch(y, out, 1.0, accumulate=True)
    return out


def _offset_output(x, y, scale):  # a flat buffer, the output a view at an offset into it
    buffer = x.new_empty(x.numel() + 8)
    _launch(x, buffer[8:], scale)
    return buffer[8:].view_as(x)


def _copies_input(x, y, scale):  # .contiguous() of a transposed input copies: not replayable
    x = x.contiguous()
    out = torch.empty_like(x)
    _launch(x, out, scale)
    return out


def _reads_a_value(x, y, scale):  # a host read of a value: not replayable
    out = torch.empty_like(x)
    _launch(x, out, scale * float(y[0, 0].item() > 0))
    return out


def _returns_input(x, y, scale):
    return x


def _loads_an_extension(x, y, scale):  # a CUDA extension's module looked up: its launches are unseen
    from kernelforge.cuda.compiler import get_cuda_compiler

    get_cuda_compiler().load("plans_probe")
    return _scaled(x, y, scale)


SCALED = _define("scaled", _scaled)
SUM_OF_TWO = _define("sum_of_two", _sum_of_two)
OFFSET_OUTPUT = _define("offset_output", _offset_output)
COPIES_INPUT = _define("copies_input", _copies_input)
READS_A_VALUE = _define("reads_a_value", _reads_a_value)
LOADS_AN_EXTENSION = _define("loads_an_extension", _loads_an_extension)
RETURNS_INPUT = define_op("kernelforge::plans_probe_returns_input(Tensor x, Tensor y, float scale) -> Tensor",
                          _returns_input, lambda x, y, scale: torch.empty_like(x))


def _fresh(device, shape=(5, 37), dtype=torch.float32):
    return torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype)


@pytest.mark.parametrize("op, expected", [
    (SCALED, lambda x, y, s: x * s),
    (SUM_OF_TWO, lambda x, y, s: x * s + y),
    (OFFSET_OUTPUT, lambda x, y, s: x * s),
])
def test_replays_equal_the_implementation_on_fresh_memory(op, expected, device):
    for call in range(5):
        x, y = _fresh(device)
        out = op(x, y, 1.5)
        torch.testing.assert_close(out, expected(x, y, 1.5))
        assert not out._is_view() and out.shape == x.shape
    assert isinstance(op.plan(x, y, 1.5), _eager_plans.Plan)
    assert replays["count"] == 3  # calls 3, 4 and 5; call 1 ran as it is, call 2 was recorded


def test_signatures_are_separate(device):
    x, y = _fresh(device)
    for _ in range(3):
        SCALED(x, y, 2.0)
    assert replays["count"] == 1
    # another scale, dtype, shape, layout: each its own first call, not the plan of (x, y, 2.0)
    for args in [(x, y, 3.0), (x.double(), y.double(), 2.0), (x[:4], y[:4], 2.0), (x.t(), y.t(), 2.0)]:
        torch.testing.assert_close(SCALED(*args), args[0] * args[2])
    assert replays["count"] == 1


@pytest.mark.parametrize("op, why", [
    (COPIES_INPUT, "aten.clone"), (READS_A_VALUE, "_local_scalar_dense"), (RETURNS_INPUT, "an output is not memory"),
])
def test_what_a_replay_would_miss_leaves_no_plan(op, why, device):
    for _ in range(4):
        x, y = _fresh(device, (37, 5))
        x, y = x.t(), y.t()  # non-contiguous: .contiguous() copies
        out = op(x, y, 1.5)
        expected = x if op is RETURNS_INPUT else x * 1.5 * float(y[0, 0] > 0) if op is READS_A_VALUE else x * 1.5
        torch.testing.assert_close(out, expected)
    plan = op.plan(x, y, 1.5)
    assert isinstance(plan, _eager_plans.NoPlan) and why in plan.why, plan
    assert replays["count"] == 0


_HELD_BY_THE_RECORDING: list = []  # per recorded call: the allocations it holds before and after failing


def _frees_buffers_around_a_copy(x, y, scale):
    transient = torch.empty_like(x)  # a transient buffer, as a chunked loss's logits
    del transient
    recording = _eager_plans.recording()
    held_before = len(recording.allocs) if recording else None
    copied = x.contiguous()  # a copy: the recording fails here
    after = torch.empty_like(x)
    del after
    if recording:
        _HELD_BY_THE_RECORDING.append((held_before, len(recording.allocs)))
    out = torch.empty_like(copied)
    _launch(copied, out, scale)
    return out


FREES_BUFFERS = _define("frees_buffers", _frees_buffers_around_a_copy)


def test_a_failed_recording_lets_the_calls_buffers_go(device):
    # a recording that cannot become a plan holds none of the call's allocations (held to the end
    # of the call, the transient ones raised the peak: 1 GiB in a Llama-3.2-1B step)
    _HELD_BY_THE_RECORDING.clear()
    for _ in range(3):
        x, y = _fresh(device, (37, 5))
        torch.testing.assert_close(FREES_BUFFERS(x.t(), y.t(), 2.0), 2 * x.t())
    assert _HELD_BY_THE_RECORDING == [(1, 0)]  # the second call was recorded: one buffer, then none
    assert "aten.clone" in FREES_BUFFERS.plan(x.t(), y.t(), 2.0).why


def test_a_cuda_extension_call_leaves_no_plan(device, monkeypatch):
    # its launches are invisible to the recording: CUDACompiler.load, which every extension call
    # goes through, tells the recording so (a module already loaded here: nothing is built)
    from types import SimpleNamespace

    from kernelforge.cuda.compiler import get_cuda_compiler

    monkeypatch.setitem(get_cuda_compiler()._by_extension, "plans_probe", SimpleNamespace())
    x, y = _fresh(device)
    for _ in range(3):
        torch.testing.assert_close(LOADS_AN_EXTENSION(x, y, 2.0), 2 * x)
    assert "CUDA extension 'plans_probe'" in LOADS_AN_EXTENSION.plan(x, y, 2.0).why and replays["count"] == 0


def test_inputs_sharing_memory(device):
    # y inside x's memory at the recording: y is mapped to its own input by address range, so a
    # later call with separate tensors of the same signature reads y from y
    for call in range(4):
        both = torch.randn(2, 5, 36, device=device)  # y 720 bytes in: 16-byte aligned as a fresh tensor is
        x, y = (both[0], both[1]) if call < 2 else _fresh(device, (5, 36))
        torch.testing.assert_close(SUM_OF_TWO(x, y, 0.5), x * 0.5 + y)
    assert replays["count"] == 2


def test_the_same_tensor_twice_is_ambiguous(device):
    x, _ = _fresh(device)
    for _ in range(3):
        torch.testing.assert_close(SUM_OF_TWO(x, x, 1.0), 2 * x)
    assert "share memory" in SUM_OF_TWO.plan(x, x, 1.0).why
    assert replays["count"] == 0


def test_alignment_is_part_of_the_signature(device):
    base = torch.randn(2 * 5 * 37 + 1, device=device)
    aligned = base[:185].view(5, 37)
    shifted = base[1:186].view(5, 37)  # 4 bytes off: another specialization of the kernel
    y = torch.randn(5, 37, device=device)
    for x in (aligned, aligned, aligned, shifted, shifted, shifted):
        torch.testing.assert_close(SCALED(x, y, 1.0), x)
    assert replays["count"] == 2


def test_backend_selection_and_registered_state_are_part_of_the_signature(device):
    x, y = _fresh(device)
    for _ in range(3):
        SCALED(x, y, 1.0)
    with kf.prefer_backend("reference"):
        SCALED(x, y, 1.0)
    with kf.use_backend("triton"):
        SCALED(x, y, 1.0)
    assert replays["count"] == 1
    flag = {"on": False}
    reader = lambda: flag["on"]  # noqa: E731
    _eager_plans.add_state(reader)
    try:
        flag["on"] = True
        SCALED(x, y, 1.0)
        assert replays["count"] == 1
    finally:
        _eager_plans.remove_state(reader)


def test_no_replay_while_backends_record_choices(device):
    x = torch.randn(4, 33, device=device)
    with kf.use_backend("triton"):
        for _ in range(3):
            kf.softmax(x)
        with backends.recording() as counts:
            for _ in range(2):
                kf.softmax(x)
    assert counts[("softmax", "triton")] == 2 and replays["count"] == 1


def test_nothing_replays_while_disabled(device):
    x, y = _fresh(device)
    with _eager_plans.disabled():
        for _ in range(4):
            torch.testing.assert_close(SCALED(x, y, 2.0), 2 * x)
    assert replays["count"] == 0 and SCALED.plan(x, y, 2.0) is None  # nothing recorded either
    for _ in range(3):
        SCALED(x, y, 2.0)
    assert replays["count"] == 1


def test_plans_are_dropped_past_the_limit(monkeypatch, device):
    monkeypatch.setattr(_eager_plans, "MAX_PLANS", 2)
    x, y = _fresh(device)
    for scale in (1.0, 1.0, 2.0, 3.0):
        SCALED(x, y, scale)
    assert SCALED.plan(x, y, 1.0) is None  # the third signature dropped the first two


def test_a_forgotten_choice_drops_plans(device):
    x, y = _fresh(device)
    for _ in range(3):
        SCALED(x, y, 1.0)
    backends.forget_choices()
    assert SCALED.plan(x, y, 1.0) is None


@pytest.mark.parametrize("name", ["softmax", "rms_norm", "silu", "swiglu", "cross_entropy", "flash_attention", "gemm"])
def test_every_family_replays_forward_and_backward(name, device):
    """Fresh inputs each call: the third and later calls replay, forward and backward, and equal the
    float64 reference."""
    def inputs():
        t = lambda *shape: torch.randn(*shape, device=device)  # noqa: E731
        return {
            "softmax": (lambda x: kf.softmax(x, dim=0), (t(6, 40),)),
            "rms_norm": (lambda x, w: kf.rms_norm(x, w), (t(3, 40), t(40))),
            "silu": (kf.silu, (t(5, 40).t(),)),  # rows along dim 0: the output keeps the layout
            "swiglu": (kf.swiglu, (t(3, 40), t(3, 40))),
            "cross_entropy": (lambda x: kf.cross_entropy(x, torch.arange(3, device=device)), (t(3, 50),)),
            "flash_attention": (lambda q, k, v: kf.flash_attention(q, k, v, causal=True),
                                (t(1, 2, 16, 16), t(1, 2, 16, 16), t(1, 2, 16, 16))),
            "gemm": (lambda a, b: kf.gemm(a, b), (t(8, 32), t(32, 16))),
        }[name]

    for call in range(4):
        fn, args = inputs()
        leaves = [a.detach().requires_grad_() for a in args]
        with kf.use_backend("triton"):
            out = fn(*leaves)
            grad = torch.randn_like(out)
            out.backward(grad)
        ref_leaves = [a.detach().double().requires_grad_() for a in args]
        with kf.use_backend("reference"):
            ref = fn(*ref_leaves)
            ref.backward(grad.double())
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
        for leaf, ref_leaf in zip(leaves, ref_leaves):
            torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, atol=1e-4, rtol=1e-4)
    assert replays["count"] >= 2  # calls 3 and 4 forward at least (backward too where it is Triton only)


def test_every_triton_launch_goes_through_launch():
    """A kernel launched as kernel[grid](...) anywhere but kernelforge/triton/_launch.py would be
    invisible to an eager plan's recording, and a replay of that call would skip it."""
    import ast
    from pathlib import Path

    offenders = []
    for path in sorted((Path(kf.__file__).parent / "triton").glob("*.py")):
        if path.name == "_launch.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, f"kernels launched around kernelforge.triton._launch.launch: {offenders}"


def test_no_recording_where_no_triton_kernel_can_run(monkeypatch):
    # a CPU without Triton's interpreter: the reference runs torch ops, nothing a plan replays; the
    # second call is not recorded (a recording's dispatch mode imports torch._dynamo: ~1 s once)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, y = _fresh("cpu")
    for _ in range(3):
        torch.testing.assert_close(SCALED(x, y, 1.5), x * 1.5)
    assert SCALED.plan(x, y, 1.5) is _eager_plans.NOTHING_TO_REPLAY
    assert replays["count"] == 0


def test_the_triton_gemms_overrides_are_part_of_every_signature(monkeypatch):
    # a debugging override set after a plan was recorded (kernelforge.triton.gemm.USE_GEMV, ...)
    # reaches the next call: the signature differs, so the call is not a replay of the old plan
    from kernelforge.triton import gemm as triton_gemm

    before = _eager_plans.state()
    for knob, value in (("USE_TMA", False), ("USE_GLUON", False), ("USE_GEMV", True), ("SPLIT_K", 2)):
        monkeypatch.setattr(triton_gemm, knob, value)
        assert _eager_plans.state() != before, knob
        before = _eager_plans.state()
