import os
import secrets

import pytest
import torch

# Without a GPU, Triton kernels run through Triton's interpreter; it must be chosen
# before Triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def backend_cases(backends=("reference", "triton", "cuda")):
    """(backend, device) pairs for parametrize: CPU cases run here (Triton through the
    interpreter), CUDA cases are the GPU suite (-m gpu)."""
    cases = []
    for b in backends:
        if b == "reference":
            cases.append(pytest.param(b, "cpu", id="reference-cpu"))
        elif b == "triton":
            cases.append(pytest.param(b, "cpu", id="triton-cpu", marks=pytest.mark.skipif(
                os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1")))
        cases.append(pytest.param(b, "cuda", id=f"{b}-cuda", marks=[pytest.mark.gpu, needs_cuda]))
    return cases


def capture_cuda_graph(step):
    """(graph, output) of step() captured in a torch.cuda.CUDAGraph after two warm-up calls on a side
    stream (compiles, autotunes, allocator warm-up happen outside the capture); replayed once and
    synchronized, so the output holds the first replay's values."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def device_cases():
    """"cpu" and "cuda" for parametrize: the CUDA case is in the GPU suite (-m gpu) and skipped
    without a GPU (for tests of the registered ops, which pick their backend themselves)."""
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, needs_cuda])]


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """Every test draws fresh random inputs; the seed is printed so a failure can be replayed
    (KERNELFORGE_TEST_SEED=<seed>)."""
    seed = int(os.environ.get("KERNELFORGE_TEST_SEED", secrets.randbits(31)))
    torch.manual_seed(seed)
    print(f"seed={seed}")
    return seed


@pytest.fixture(autouse=True)
def fresh_eager_plans():
    """No test replays an eager plan an earlier test recorded (kernelforge._eager_plans): a test
    that swaps an implementation's Python (a monkeypatched knob or launcher) must see it run."""
    from kernelforge import backends

    backends.forget_choices()


@pytest.fixture(autouse=True)
def no_measured_choices(request, monkeypatch):
    """Backends are chosen by the rules in every test but tests/test_tuning.py: a measurement would
    make a test's backend depend on timings, and write the cache file of the user running the tests."""
    if request.path.name != "test_tuning.py":
        monkeypatch.setenv("KERNELFORGE_TUNING", "0")


@pytest.fixture(autouse=True)
def return_cached_gpu_memory():
    """The GPU suite's workers share one GPU: after each test a worker hands its allocator's cached
    blocks back, so a large test in another worker finds the memory (else one worker's cache of
    earlier tests makes the others' allocations fail as out of memory)."""
    yield
    if HAS_CUDA and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture
def no_eager_plans():
    """Every op call in the test runs its implementation's Python: for tests that count or spy on
    launcher calls, which a replayed call does not make."""
    from kernelforge import _eager_plans

    with _eager_plans.disabled():
        yield


def pytest_runtest_logreport(report):
    """KERNELFORGE_FAILURE_LOG=<file>: each failure's report appended as it happens (by the
    controlling process under xdist), so a GPU run cut by its time limit still says why."""
    path = os.environ.get("KERNELFORGE_FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as log:
            log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-3000:]}\n")
