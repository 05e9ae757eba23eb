"""Backend selection: forcing, environment variable, clear refusals, explain()."""
import pytest
import torch

import kernelforge as kf
from kernelforge import backends


def test_cpu_default_is_reference_and_explained():
    x = torch.randn(4, 8)
    assert backends.select("softmax", x).backend == "reference"
    text = kf.explain("softmax", x)
    assert text.startswith("softmax: runs on reference because the reference is the CPU implementation")
    assert "cuda: cannot: the CUDA extension runs on CUDA tensors, got a cpu tensor" in text


def test_forced_backend_that_cannot_run_raises():
    x = torch.randn(4, 8)
    with kf.use_backend("cuda"):
        with pytest.raises(kf.BackendUnsupportedError, match=r"backend 'cuda' is forced but cannot run these inputs: "
                                                              r"the CUDA extension runs on CUDA tensors, got a cpu tensor"):
            kf.softmax(x)
    with kf.use_backend("triton"):
        with pytest.raises(kf.BackendUnsupportedError, match=r"Triton kernels take float32/float16/bfloat16, got torch.float64"):
            kf.softmax(x.double())


def test_use_backend_nests_and_restores():
    assert backends.forced_backend() is None
    with kf.use_backend("reference"):
        assert backends.forced_backend() == "reference"
        with kf.use_backend(None):
            assert backends.forced_backend() is None
        assert backends.forced_backend() == "reference"
    assert backends.forced_backend() is None


def test_environment_variable_forces(monkeypatch):
    monkeypatch.setenv("KERNELFORGE_BACKEND", "cuda")
    assert backends.forced_backend() == "cuda"
    with pytest.raises(kf.BackendUnsupportedError, match="'cuda' is forced"):
        kf.softmax(torch.randn(2, 3))
    with kf.use_backend("reference"):  # the context manager wins over the environment
        kf.softmax(torch.randn(2, 3))
    monkeypatch.setenv("KERNELFORGE_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"KERNELFORGE_BACKEND: unknown backend 'fast'; expected one of"):
        kf.softmax(torch.randn(2, 3))


def test_unknown_names_are_rejected():
    with pytest.raises(ValueError, match=r"use_backend: unknown backend 'cudnn'"):
        with kf.use_backend("cudnn"):
            pass
    with pytest.raises(KeyError, match=r"no op named 'softmaxx' is registered"):
        kf.explain("softmaxx", torch.randn(2))


def test_choices_are_cached_per_input_class_and_forgotten_on_demand():
    x = torch.randn(4, 8)
    first = backends.select("softmax", x)
    assert backends.select("softmax", torch.randn(2, 3)) is first  # same device, dtype, size class
    assert backends.select("softmax", x.double()) is not first
    with kf.use_backend("reference"):
        assert backends.select("softmax", x).reason == "reference was forced"
    assert backends.select("softmax", x) is first
    backends.forget_choices()  # e.g. after an extension failed to build
    again = backends.select("softmax", x)
    assert again is not first and again.backend == first.backend


def test_preferred_backend_runs_where_it_can_and_the_usual_choice_elsewhere(monkeypatch):
    x = torch.randn(4, 8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # Triton must not take CPU tensors here
    with kf.prefer_backend("cuda"):
        choice = backends.select("softmax", x)
        assert choice.backend == "reference"
        assert choice.reason.endswith("(cuda was preferred but: the CUDA extension runs on CUDA tensors, "
                                      "got a cpu tensor)")
        torch.testing.assert_close(kf.softmax(x), torch.softmax(x, -1))
    with kf.prefer_backend("reference"):
        assert backends.select("softmax", x).reason == "reference was preferred"
        with kf.use_backend("cuda"):  # forcing still wins, and still raises
            with pytest.raises(kf.BackendUnsupportedError, match="'cuda' is forced"):
                kf.softmax(x)
    assert backends.select("softmax", x).reason.startswith("the reference is the CPU implementation")
    with pytest.raises(ValueError, match=r"prefer_backend: unknown backend 'cudnn'"):
        with kf.prefer_backend("cudnn"):
            pass


def test_recording_counts_each_call_with_its_backend():
    x = torch.randn(4, 8, requires_grad=True)
    with backends.recording() as outer:
        kf.softmax(x)
        with backends.recording() as inner:
            kf.log_softmax(x).sum().backward()
    assert outer[("softmax", "reference")] >= 2  # softmax, log_softmax (and its backward when it selects)
    assert sum(inner.values()) >= 1 and sum(outer.values()) > sum(inner.values())
    with backends.recording() as empty_outer:  # an inner counter equal to the outer one (both empty) at exit
        with backends.recording():
            pass
        kf.softmax(x)
    assert empty_outer[("softmax", "reference")] == 1
    closed = dict(outer)
    kf.softmax(x)
    assert dict(outer) == closed  # a closed counter no longer changes


def test_explain_takes_the_public_function_names():
    # kf.explain("rms_norm", x) explains the registry family the function runs through, with the
    # options the function passes (silu's kind), as the family's own name does
    x, w = torch.randn(4, 8), torch.randn(8)
    for name, family, options in (("rms_norm", "norms", {}), ("layer_norm", "norms", {}),
                                  ("silu", "activation", {"kind": "silu"}), ("relu", "activation", {"kind": "relu"}),
                                  ("log_softmax", "softmax", {})):
        text = kf.explain(name, x, w) if family == "norms" else kf.explain(name, x)
        direct = kf.explain(family, x, w, **options) if family == "norms" else kf.explain(family, x, **options)
        first, rest = text.split("\n", 1)
        assert first == f"({name} runs through the {family!r} family of the registry)"
        assert rest == direct
    assert kf.explain("flash_attention", *(torch.randn(1, 2, 3, 8),) * 3).splitlines()[1].startswith("attention: runs on")
    with pytest.raises(KeyError, match="known ops"):
        kf.explain("rms_normm", x)
