"""The two ways a public kernelforge function runs: in plain eager mode it skips the dispatcher
(calling the implementation directly, through its own autograd.Function when a gradient is needed);
under a mode, a transform or torch.compile it goes through the registered op (torch.ops). Both must
give the same values, layout and gradients."""
import torch


def assert_eager_path_equals_registered_op(public, registered, x: torch.Tensor) -> torch.Tensor:
    """public(x) and registered(x) agree in values, strides and x's gradient, and the eager output
    is no view (in-place ops on it work as on torch's outputs); returns the eager output."""
    fast, via_op = public(x), registered(x)
    assert torch.equal(fast, via_op) and fast.stride() == via_op.stride() and not fast._is_view()
    xa, xb = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    ya, yb = public(xa), registered(xb)
    assert type(ya.grad_fn).__name__ == "_EagerAutogradBackward"
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(xa.grad, xb.grad)
    return fast
