"""One definition per operator: the registered op that torch.compile traces into, and the lean
eager call, from the same schema, checks, implementation, fake and gradient.

    softmax_op = define_op(
        "kernelforge::softmax(Tensor x, int dim) -> Tensor",
        impl=_forward,              # checks, backend choice, launch: what the op computes
        fake=_fake_forward,         # the same checks; empty outputs with the real strides
        choose=_choose,             # the backend choice for these inputs (kernelforge.backends)
        setup_context=_save,        # (ctx, inputs, output), as torch.library.register_autograd takes it
        backward=_gradient,         # (ctx, *grads) -> one gradient (or None) per input
    )
    y = softmax_op(x, -1)

What the definition yields:
- `op(*args)`, the call the public functions make (positional arguments in schema order). In
  plain eager mode (not tracing or compiling; no tensor subclass, dispatch mode or functorch
  transform) it skips the dispatcher and runs `impl` directly, through one autograd.Function
  generated from `setup_context` and `backward` when an input needs a gradient: the dispatcher
  and the custom-op glue cost tens of microseconds a call, more than a small kernel. Anywhere
  else it calls the registered op.
- `op.registered`: the torch.library custom op, kernelforge::<name>, with the fake and with
  autograd from the same `setup_context` and `backward`. opcheck, FakeTensor, vmap, torch.func and
  torch.compile see this one.
- Under torch.compile the registered op is decomposed while AOTAutograd functionalizes the graph
  (as torch.library.triton_op does): `impl` runs on the traced tensors, its Triton kernels enter
  the graph through torch.library.wrap_triton (kernelforge.triton._launch.launch does that for
  traced tensors) and its torch ops as themselves, so Inductor launches the kernels from its
  generated code, with no kernelforge Python at run time, and fuses the pointwise work around
  them. That happens where the backend `choose` picks for the inputs is traceable (Triton JIT
  kernels, the pure-PyTorch reference); a call whose backend is opaque (CUDA C++, Gluon) stays
  one custom op with its fake and runs `impl` at run time. While tracing, `choose` ranks traceable
  backends first (kernelforge.backends.tracing): Inductor launches them as cheaply as the CUDA
  extension launches its own, which is what the eager rules trade for at small sizes.
  The choice is made when the graph is traced and kept in it: the public functions read the
  forced and preferred backend under Dynamo, which guards on them, so a graph compiled under
  another use_backend / prefer_backend setting is recompiled; KERNELFORGE_BACKEND is read at
  trace time only.

A backward op is defined the same way; the forward's `backward` calls it as `op(...)`, so inside
a plain eager backward it runs directly too, and under create_graph=True (or tracing) it carries
its own gradient (its `backward`, the double backward). An op defined without `backward` raises
when a gradient is asked of it, on both paths.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from kernelforge import _eager_plans, backends

# Tensors the eager path takes as they are: nn.Parameter adds no torch_function behavior.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode = torch._C._is_torch_function_mode_enabled
_functorch_active = torch._C._are_functorch_transforms_active
_grad_enabled = torch.is_grad_enabled


def is_traced(t: torch.Tensor) -> bool:
    """Whether `t` is a tracer's (FunctionalTensor, FakeTensor...), not a real tensor. A backward can
    ask this where it would read torch.is_grad_enabled() as "create_graph=True": while AOTAutograd
    traces a joint graph, grad mode is on whether or not anyone will differentiate the backward."""
    return type(t) not in _PLAIN_TENSORS


def no_view(t):
    """`t` as a tensor that is not a view, on the same memory (no copy: the memory is the op's
    own). What an autograd.Function returns must not be a view: autograd refuses in-place ops on
    "a view created inside a custom Function" (y = norm(x); y += r), which torch's own modules'
    outputs allow. Real tensors only: under tracing outputs stay as traced."""
    if not isinstance(t, torch.Tensor) or not t._is_view():
        return t
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def _no_views(outputs):
    if isinstance(outputs, torch.Tensor):
        return no_view(outputs)
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(no_view(t) for t in outputs)
    return outputs


def _decomposition_disabled() -> bool:
    """torch.export keeps triton ops whole (a high-level, serializable program): so do we."""
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:  # an older torch without the switch
        return False
    return custom_triton_ops_decomposition_disabled()


# Every op defined here, by name (kernelforge::<name>): what `kernelforge explain`-style tooling and
# the tests walk.
DEFINITIONS: dict[str, "Op"] = {}


class Op:
    """A kernelforge operator defined once; see the module docstring."""

    def __init__(self, schema: str, impl: Callable, fake: Callable, *, choose: Optional[Callable] = None,
                 setup_context: Optional[Callable] = None, backward: Optional[Callable] = None,
                 state: Optional[Callable[[], object]] = None, helper_outputs: tuple[int, ...] = (),
                 unused_gradients_as_none: bool = False):
        qualname, _, signature = schema.partition("(")
        namespace, _, self.name = qualname.partition("::")
        if namespace != "kernelforge" or not self.name:
            raise ValueError(f"define_op: schema must start with kernelforge::<name>(, got {schema!r}")
        self.schema = "(" + signature
        self.impl, self.fake, self.choose = impl, fake, choose
        self.backward, self.helper_outputs = backward, tuple(helper_outputs)
        self.unused_gradients_as_none = unused_gradients_as_none
        unmaterialized = helper_outputs or unused_gradients_as_none
        self.setup_context = setup_context if setup_context is None or not unmaterialized else self._unmaterialized(
            setup_context)
        self._plans: dict = {}  # signature -> Plan | NoPlan (kernelforge._eager_plans)
        if state is not None:
            _eager_plans.add_state(state)
        self.registered = torch.library.custom_op(f"kernelforge::{self.name}", lambda *a: _no_views(impl(*a)),
                                                  mutates_args=(), schema=self.schema)
        self.registered.register_fake(fake)
        self.registered.register_autograd(self._gradient, setup_context=self.setup_context)
        from torch._subclasses.functional_tensor import FunctionalTensorMode

        self.registered.register_torch_dispatch(FunctionalTensorMode, self._functional)
        parsed = self.registered._opoverload._schema
        self._tensors = tuple(i for i, a in enumerate(parsed.arguments) if isinstance(a.type, torch.TensorType)
                              or a.type.kind() == "OptionalType" and isinstance(a.type.getElementType(), torch.TensorType))
        self._tensor_lists = tuple(i for i, a in enumerate(parsed.arguments) if str(a.type) in ("List[Tensor]", "Tensor[]"))
        returns = parsed.returns
        self._returns_list = len(returns) == 1 and str(returns[0].type) in ("List[Tensor]", "Tensor[]")
        self._overload = self.registered._opoverload
        self._function = self._eager_function()
        DEFINITIONS[self.name] = self

    def __repr__(self) -> str:
        return f"Op(kernelforge::{self.name}{self.schema})"

    # ------------------------------------------------------------------ the call
    def __call__(self, *args):
        if not self._plain_eager(args):
            backends.selection_state()  # read under Dynamo: it guards on the setting it traced with
            return self._overload(*args)
        if _grad_enabled() and self._any_requires_grad(args):
            outputs = self._function.apply(*args)
            return list(outputs) if self._returns_list else outputs
        return self._eager(args)

    def _eager(self, args):
        """impl(*args) with no views among its outputs; from the third call at a signature on, its
        eager plan replayed where it has one (kernelforge._eager_plans)."""
        if not _eager_plans.enabled() or backends.counting():  # inside a recording: recorded into it
            return _no_views(self.impl(*args))
        tensors = []
        key = _plan_signature(args, tensors)
        plans = self._plans
        plan = plans.get(key)
        if plan is None:  # the first call: it may compile, autotune, build; the next is recorded
            if len(plans) >= _eager_plans.MAX_PLANS:
                plans.clear()
            plans[key] = _eager_plans.SEEN_ONCE
            return _no_views(self.impl(*args))
        if plan is _eager_plans.SEEN_ONCE:
            outputs, plans[key] = _eager_plans.record(lambda *a: _no_views(self.impl(*a)), args, tensors)
            return outputs
        if type(plan) is _eager_plans.NoPlan:
            return _no_views(self.impl(*args))
        return plan.run(tensors)

    def plan(self, *args) -> "Optional[_eager_plans.Plan | _eager_plans.NoPlan]":
        """The eager plan calls with these arguments replay (a Plan), why they have none (a NoPlan),
        or None before their first call."""
        return self._plans.get(_plan_signature(args, []))

    def _plain_eager(self, args) -> bool:
        # an eager plan's recording is a dispatch mode: ops inside it run as plain eager calls
        if _is_compiling() or _function_mode() or _functorch_active() or (
                _dispatch_modes() and _eager_plans.recording() is None):
            return False
        for i in self._tensors:
            t = args[i]
            if t is not None and type(t) not in _PLAIN_TENSORS:
                return False
        for i in self._tensor_lists:
            if any(type(t) not in _PLAIN_TENSORS for t in args[i]):
                return False
        return True

    def _any_requires_grad(self, args) -> bool:
        for i in self._tensors:
            t = args[i]
            if t is not None and t.requires_grad:
                return True
        return False

    # ------------------------------------------------------------------ autograd
    def _gradient(self, ctx, *grads):
        if self.backward is None:
            raise RuntimeError(f"kernelforge::{self.name} has no gradient formula (its inputs' gradients, or a "
                               "double backward through it, are not computed)")
        if self.helper_outputs and not self.unused_gradients_as_none:  # zeros for a result, None for helpers
            grads = tuple(g if g is not None or meta is None else torch.zeros(meta[0], dtype=meta[1], device=meta[2])
                          for g, meta in zip(grads, ctx.kernelforge_outputs))
        return self.backward(ctx, *grads)

    def _unmaterialized(self, setup_context: Callable) -> Callable:
        """setup_context that turns autograd's zero-filling of unused outputs' gradients off: the
        helper outputs' gradients (saved for the backward, never differentiated: a gated MLP's
        activations, a loss's lse) would be filled with zeros on every backward (two tensors of
        tokens x intermediate a layer). Results keep zeros, made by _gradient where needed, unless
        the op asked for None there too (unused_gradients_as_none)."""
        helpers = self.helper_outputs

        def setup(ctx, inputs, output):
            ctx.set_materialize_grads(False)
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            ctx.kernelforge_outputs = tuple(None if i in helpers else (t.shape, t.dtype, t.device)
                                            for i, t in enumerate(outputs))
            setup_context(ctx, inputs, output)

        return setup

    def _eager_function(self) -> type:
        """The autograd.Function of the eager path: impl, then the registered op's own
        setup_context and backward (the ctx they see behaves the same)."""
        op, tensor_lists = self, self._tensor_lists

        def forward(ctx, *args):
            outputs = op._eager(args)
            if op._returns_list:
                outputs = tuple(outputs)
            if op.setup_context is not None:
                op.setup_context(ctx, args, list(outputs) if op._returns_list else outputs)
            return outputs

        def backward(ctx, *grads):
            if op._returns_list:  # torch.library hands a Tensor[] output's gradients over as one list
                grads = (list(grads),)
            result = op._gradient(ctx, *grads)
            result = result if isinstance(result, tuple) else (result,)
            # a list input (a block mask's tensors) is no tensor to autograd.Function: None for it
            return tuple(None if i in tensor_lists else g for i, g in enumerate(result))

        return type(f"kernelforge_{self.name}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    def is_eager_node(self, grad_fn) -> bool:
        """Whether `grad_fn` (an output's) is this op's eager-path autograd node."""
        return grad_fn is not None and type(grad_fn).__name__ == f"kernelforge_{self.name}Backward"

    # ------------------------------------------------------------------ tracing
    def _functional(self, mode, op, types, args, kwargs):
        """AOTAutograd's functionalization meets the op: decompose it into impl's traced kernels and
        torch ops where the chosen backend is traceable, else keep it one custom op."""
        if _decomposition_disabled() or any(t not in _traced_types() for t in types):
            return mode.__torch_dispatch__(op, types, args, kwargs)
        with backends.tracing():
            if self.choose is not None and not self.choose(*args, **kwargs).traceable:
                return mode.__torch_dispatch__(op, types, args, kwargs)
            with mode:
                return self.impl(*args, **kwargs)


def _plan_signature(args: tuple, tensors: list) -> tuple:
    """The key of a call's eager plan: its arguments' signature under the backend selection and the
    state ops registered (the call's tensors appended to `tensors`)."""
    return _eager_plans.signature(args, (backends.plan_key(), _eager_plans.state()), tensors)


@functools.lru_cache(maxsize=None)
def _traced_types() -> tuple:
    """The tensor types functionalization hands over (anything else, a subclass such as DTensor,
    keeps the op whole): Tensor, FunctionalTensor, FakeTensor."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return torch.Tensor, FunctionalTensor, FakeTensor


def define_op(schema: str, impl: Callable, fake: Callable, *, choose: Optional[Callable] = None,
              setup_context: Optional[Callable] = None, backward: Optional[Callable] = None,
              state: Optional[Callable[[], object]] = None, helper_outputs: tuple[int, ...] = (),
              unused_gradients_as_none: bool = False) -> Op:
    """Register kernelforge::<name> from one definition and return its lean call (module docstring).

    schema: "kernelforge::name(args) -> returns" (torch's schema language).
    impl(*args): what the op computes on real tensors: checks, backend choice, launch.
    fake(*args): the same checks, and empty outputs with impl's shapes, dtypes and strides.
    choose(*args): the kernelforge.backends.Choice impl will make for these inputs; None when
        every backend of the op is traceable.
    setup_context(ctx, inputs, output) and backward(ctx, *grads): the gradient, as
        torch.library.register_autograd takes them; without backward, asking for a gradient raises.
    state(): global state impl reads besides the backend selection (a precision policy, a torch
        flag): part of every eager plan's signature, so a plan recorded under one value is not
        replayed under another.
    helper_outputs: the indices of outputs that are the backward's helpers, not results (saved
        for it, never differentiated): backward gets None for their gradients where autograd
        would fill zeros (the results' missing gradients still come as zeros).
    unused_gradients_as_none: backward gets None for every output nobody differentiated, results
        too (for a backward that must tell "no gradient" from a zero one: rope gives k no gradient
        when only q's rotation reaches the loss, as torch does, where rotating a zero gradient by an
        infinite angle would give NaN).
    """
    return Op(schema, impl, fake, choose=choose, setup_context=setup_context, backward=backward, state=state,
              helper_outputs=helper_outputs, unused_gradients_as_none=unused_gradients_as_none)


__all__ = ["DEFINITIONS", "Op", "define_op", "is_traced", "no_view"]
