"""LanguageModel(activation_checkpointing=True): each layer keeps only its input for the backward and
runs again there, with the kernel set of its forward. The loss and every gradient equal the model's
without it (float64; the reference level, whose kernelforge ops the recomputation must use again,
native, and compile), far fewer tensors are saved, and no-grad calls and generation are untouched."""
import copy

import pytest
import torch

from kernelforge.models import LanguageModel, levels


def _models(level):
    torch.manual_seed(0)
    plain = LanguageModel(vocab_size=64, dim=32, n_layers=3, n_heads=4, max_seq_len=32, level=level).double()
    checkpointed = copy.deepcopy(plain)
    checkpointed.activation_checkpointing = True
    return plain, checkpointed


def _step(model, ids):
    """The loss and every parameter's gradient, and how many tensors autograd saved in the forward."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with model.kernel_scope():
            loss = model.loss(ids)
    with model.kernel_scope():
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(saved)


@pytest.mark.parametrize("level", ["reference", "native", pytest.param("compile", marks=pytest.mark.slow)])
def test_the_same_loss_and_gradients_with_far_less_saved(level):
    plain, checkpointed = _models(level)
    ids = torch.randint(0, 64, (3, 17))
    loss, grads, saved = _step(plain, ids)
    loss_ac, grads_ac, saved_ac = _step(checkpointed, ids)
    torch.testing.assert_close(loss_ac, loss, rtol=1e-12, atol=0)
    assert grads_ac.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_ac[name], grads[name], rtol=1e-10, atol=1e-12, msg=name)
    if level != "compile":  # compiled, the graph's own saved tensors are not autograd's hooks' to see
        assert saved_ac < saved / 2, (saved_ac, saved)


def test_the_recomputation_runs_the_forwards_kernel_set(monkeypatch):
    # the backward runs after LevelledModel.run put torch's kernel set back: the recomputed layers
    # must run kernelforge's ops again (at the reference level: its registered ops), not torch's
    _, model = _models("reference")
    calls = {"kernelforge": 0, "torch": 0}
    for name, kernels in (("kernelforge", levels.KernelforgeKernels), ("torch", levels.TorchKernels)):
        original = kernels.attention

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(kernels, "attention", counted)
    ids = torch.randint(0, 64, (2, 9))
    with model.kernel_scope():
        loss = model.loss(ids)
    assert calls == {"kernelforge": 3, "torch": 0}
    with model.kernel_scope():
        loss.backward()
    assert calls == {"kernelforge": 6, "torch": 0}  # the three layers again
    assert model.kernels.ops is levels.TORCH_KERNELS  # and the kernel set is put back after


def test_no_grad_calls_and_generation_are_untouched():
    plain, checkpointed = _models("native")
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(checkpointed(ids), plain(ids), rtol=0, atol=0)
    out = checkpointed.generate(ids, max_new_tokens=4, temperature=0)
    assert torch.equal(out, plain.generate(ids, max_new_tokens=4, temperature=0))
