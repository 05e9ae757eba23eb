"""The two ways a kernelforge op runs (kernelforge.ops._opdef): in plain eager mode its call skips
the dispatcher (the implementation directly, through the op's generated autograd.Function when a
gradient is needed); under a mode, a transform or torch.compile it goes through the registered op
(torch.ops). Both must give the same values, layout and gradients."""
import torch


def assert_eager_path_equals_registered_op(public, op, registered, x: torch.Tensor) -> torch.Tensor:
    """public(x) and registered(x) agree in values, strides and x's gradient, the eager output is no
    view (in-place ops on it work as on torch's outputs), and public's gradient came from `op`'s
    eager node (`op`: the kernelforge.ops._opdef.Op public calls); returns the eager output."""
    fast, via_op = public(x), registered(x)
    assert torch.equal(fast, via_op) and fast.stride() == via_op.stride() and not fast._is_view()
    xa, xb = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    ya, yb = public(xa), registered(xb)
    assert op.is_eager_node(ya.grad_fn), type(ya.grad_fn).__name__
    assert not op.is_eager_node(yb.grad_fn)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(xa.grad, xb.grad)
    return fast


def compiled_code(fn, *args, backward: bool = False, **compile_kwargs):
    """(fn compiled by Inductor with fullgraph=True applied to args, the Python code Inductor
    generated for it, joined). backward=True also runs the backward of the output's sum inside, so
    its code (generated when the backward first runs) is in the text too; the output returned is then
    a second call's, whose graph the caller may differentiate (a compiled backward frees its buffers)."""
    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(fn, fullgraph=True, **compile_kwargs)

    def run(*inputs):
        out = compiled(*inputs)
        if backward:
            leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
            torch.autograd.grad(out.float().sum(), leaves)
        return out

    out, codes = run_and_get_code(run, *args)
    if backward:
        out = compiled(*args)
    return out, "\n".join(codes)


def assert_inductor_launches(fn, args, kernels, backward: bool = False, **compile_kwargs):
    """Inductor's code for fn(*args) (and its backward, with backward=True) launches each named Triton
    kernel itself (the op was traced into) and calls no kernelforge op; returns fn's compiled output."""
    out, code = compiled_code(fn, *args, backward=backward, **compile_kwargs)
    for name in kernels:
        assert name in code, f"{name} is not launched by Inductor's code"
    assert "torch.ops.kernelforge" not in code, "a kernelforge op stayed opaque in the compiled graph"
    return out


def aot_graphs(fn, inputs, grad_outputs=None, **compile_kwargs):
    """fn(*inputs) compiled with fullgraph=True through AOTAutograd only (no Inductor: the graphs run
    as traced; CPU Inductor compiles slowly), forward and backward, Dynamo reset first. Returns
    (output, gradients of the inputs that require grad, the call targets of the forward and
    backward graphs as strings)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True, **compile_kwargs)(*inputs)
    grads = torch.autograd.grad(out, [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad],
                                grad_outputs)
    assert len(graphs) == 2, "expected a forward and a backward graph"
    return out, grads, [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
