"""kernelforge.nn.Linear: a drop-in for torch.nn.Linear (state_dict, init, outputs and
gradients), with an optional fused activation; bad input named."""
import pytest
import torch
import torch.nn.functional as F

import kernelforge as kf
from tests.conftest import backend_cases


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_matches_torch_linear_and_shares_its_state_dict(backend, device):
    theirs = torch.nn.Linear(24, 10, device=device)
    mine = kf.nn.Linear(24, 10, device=device)
    assert mine.state_dict().keys() == theirs.state_dict().keys()
    mine.load_state_dict(theirs.state_dict())
    for shape in [(24,), (7, 24), (2, 3, 24)]:
        x = torch.randn(shape, device=device, requires_grad=True)
        with kf.use_backend(backend):
            y = mine(x)
            (gx,) = torch.autograd.grad(y.square().sum(), x)
            gw = torch.autograd.grad(mine(x).sum(), mine.weight)[0]
        ref = theirs(x)
        assert y.shape == ref.shape
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gx, torch.autograd.grad(ref.square().sum(), x)[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gw, torch.autograd.grad(theirs(x).sum(), theirs.weight)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend,device", backend_cases(("reference", "triton")))
def test_fused_activation_and_from_torch(backend, device):
    theirs = torch.nn.Linear(16, 12, bias=False, device=device)
    mine = kf.nn.Linear.from_torch(theirs, activation="silu")
    assert mine.weight is theirs.weight and mine.bias is None
    x = torch.randn(5, 16, device=device)
    with kf.use_backend(backend):
        torch.testing.assert_close(mine(x), F.silu(theirs(x)), rtol=1e-5, atol=1e-5)
    assert "activation='silu'" in repr(mine)


def test_bad_input_is_named():
    layer = kf.nn.Linear(4, 3)
    with pytest.raises(ValueError, match="in_features=4"):
        layer(torch.randn(2, 5))
    with pytest.raises(ValueError, match="0-dim"):
        layer(torch.tensor(1.0))
    with pytest.raises(ValueError, match="activation must be one of"):
        kf.nn.Linear(4, 3, activation="tanh")
    with pytest.raises(ValueError, match="precision must be one of"):
        kf.nn.Linear(4, 3, precision="int8")


@pytest.mark.parametrize("shape", [(24,), (7, 24), (2, 3, 24)], ids=str)
def test_output_can_be_modified_in_place(shape):
    # As torch.nn.Linear's: y = fc(x); y.relu_() or y += r must work and differentiate (a view
    # returned from the op's autograd.Function would be refused by autograd).
    theirs = torch.nn.Linear(24, 10)
    mine = kf.nn.Linear.from_torch(theirs)
    x = torch.randn(shape, requires_grad=True)
    y, ref = mine(x), theirs(x)
    y.mul_(2.0).relu_()
    ref = ref.mul_(2.0).relu_()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, [x, mine.weight, mine.bias], g),
                    torch.autograd.grad(ref, [x, theirs.weight, theirs.bias], g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
