"""The convergence check: the language model trained at two levels from the same weights on the
same batches of the shipped corpus follows the same loss curve (fp32 on a CPU: kernelforge's ops on
their reference implementations, hand-written backward formulas included; bf16 on a GPU: Triton
and CUDA kernels)."""
import pytest
import torch

from kernelforge.models.training import CORPUS, TrainConfig, load_corpus, train_language_model
from tests.conftest import needs_cuda


def test_corpus_ships_with_the_package():
    data = load_corpus()
    assert CORPUS.stat().st_size == len(data) > 3000
    assert data.min() >= 0 and data.max() < 256


def test_kernelforge_ops_train_like_pytorch_on_cpu():
    config = TrainConfig(steps=300)
    native = torch.tensor(train_language_model("native", config))
    kernelforge = torch.tensor(train_language_model("reference", config))
    assert native[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.1)  # starts at chance
    assert native[-20:].mean() < 0.5 * native[0]  # and learns
    # fp32: the two implementations differ in rounding only, and Adam does not amplify it here
    assert (native - kernelforge).abs().max() < 1e-3


@pytest.mark.gpu
@needs_cuda
def test_kernelforge_levels_train_like_pytorch_in_bf16_on_gpu():
    config = TrainConfig(steps=300, batch=16, seq_len=64, dim=128, n_layers=2, n_heads=4)
    curves = {level: torch.tensor(train_language_model(level, config, "cuda", torch.bfloat16))
              for level in ("native", "triton", "cuda")}
    native = curves["native"]
    assert native[-20:].mean() < 0.5 * native[0]
    for level in ("triton", "cuda"):
        curve = curves[level]
        # bf16 rounding differs from the first step. Early, the curves stay together (a wrong gradient
        # parts them within a few steps: measured gaps there are under 1e-3). Late, bf16 runs drift
        # apart chaotically at this learning rate: over seeds 0-3 the mean of the last 50 steps moved by
        # up to 0.145 between native with torch's loss and native with kernelforge's (whose gradients
        # agree with torch's within bf16 rounding at every step; docs/notes/training.md, results in
        # benchmarks/results/nvidia-h200/0.1.0/models/).
        assert (curve[:20] - native[:20]).abs().max() < 0.05, level
        assert curve[-20:].mean() < 0.5 * curve[0], level  # and it learns as native does
        assert abs(curve[-50:].mean() - native[-50:].mean()) < 0.25, level
