"""my_op: schemas, input checks, fake implementations, autograd, dispatch (written by
`kernelforge new-op my_op`; the math lives in the backends, not here).

    y = kernelforge.ops.my_op.my_op(x)      elementwise, any shape; float16 / bfloat16 /
                                            float32 on GPU, float64 too on CPU

Registered ops (each defined once by define_op: fake, autograd, the eager call):
    kernelforge::my_op(Tensor x) -> Tensor
    kernelforge::my_op_backward(Tensor grad_y, Tensor x) -> Tensor
    kernelforge::my_op_cuda_forward / my_op_cuda_backward: the same signatures, the CUDA
        backend, whose kernels are registered from C++ (TORCH_LIBRARY_IMPL in
        kernelforge/cuda/csrc/my_op_binding.cpp) when its extension loads.

Backends: reference (kernelforge/reference/my_op.py, the CPU path), triton
(kernelforge/triton/my_op.py), cuda (kernelforge/cuda/my_op.py). On a GPU the preference is
Triton then CUDA; measure both (benchmarks/bench_my_op.py) and put the faster first.
"""
from __future__ import annotations

import torch

from kernelforge import backends
from kernelforge.ops._common import FLOAT_DTYPES, GPU_FLOAT_DTYPES, check_floating
from kernelforge.ops._opdef import define_op

OP = "my_op"


# ----------------------------------------------------------------------------- checks
def _check(x: torch.Tensor) -> None:
    check_floating(OP, "x", x, FLOAT_DTYPES)


def _check_backward(grad_y: torch.Tensor, x: torch.Tensor) -> None:
    _check(x)
    if grad_y.shape != x.shape or grad_y.dtype != x.dtype or grad_y.device != x.device:
        raise ValueError(f"kernelforge.{OP}_backward: grad_y must match x's shape {tuple(x.shape)}, dtype {x.dtype} "
                         f"and device {x.device}; got {tuple(grad_y.shape)}, {grad_y.dtype}, {grad_y.device}")


# ----------------------------------------------------------------------------- dispatch
def _why_not_triton(x: torch.Tensor):
    from kernelforge.triton import why_unavailable
    from kernelforge.triton.my_op import why_not

    if x.dtype not in GPU_FLOAT_DTYPES:
        return f"Triton kernels take float32/float16/bfloat16, got {x.dtype}"
    return why_not(x) or why_unavailable(x.device)


def _why_not_cuda(x: torch.Tensor):
    from kernelforge.cuda import why_unavailable
    from kernelforge.cuda.my_op import why_not

    return why_not(x) or why_unavailable("my_op")


def _why_not_reference(x: torch.Tensor):
    return None


def _preference(x: torch.Tensor):
    if x.device.type != "cuda":
        return ("reference",), "the reference is the CPU implementation"
    return ("triton", "cuda", "reference"), "the default order for a new op (not measured yet)"


def _choice_key(x: torch.Tensor):
    return x.device.type, x.dtype


backends.register(OP, "triton", "kernelforge.triton.my_op", _why_not_triton)
# traceable: its launches are the registered ops below (fakes included), which a graph can hold
backends.register(OP, "cuda", "kernelforge.cuda.my_op", _why_not_cuda, traceable=True)
backends.register(OP, "reference", "kernelforge.reference.my_op", _why_not_reference)
backends.set_preference(OP, _preference, _choice_key)


# ----------------------------------------------------------------------------- definitions
def _choose(x: torch.Tensor) -> backends.Choice:
    return backends.select(OP, x)


def _fake_forward(x):
    _check(x)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_backward(grad_y, x):
    _check_backward(grad_y, x)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# The CUDA backend's operators: schema and fake here, kernels from C++ when the extension loads.
torch.library.define("kernelforge::my_op_cuda_forward", "(Tensor x) -> Tensor")
torch.library.register_fake("kernelforge::my_op_cuda_forward", _fake_forward)
torch.library.define("kernelforge::my_op_cuda_backward", "(Tensor grad_y, Tensor x) -> Tensor")
torch.library.register_fake("kernelforge::my_op_cuda_backward", _fake_backward)


def _backward(grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What kernelforge::my_op_backward computes (the eager call runs it directly)."""
    _check_backward(grad_y, x)
    return _choose(x).implementation.launchers().my_op_backward(grad_y, x).contiguous()


def _forward(x: torch.Tensor) -> torch.Tensor:
    """What kernelforge::my_op computes: checks, the backend choice, the launch."""
    _check(x)
    return _choose(x).implementation.launchers().my_op_forward(x).contiguous()


def _save_input(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _gradient(ctx, grad_y):
    (x,) = ctx.saved_tensors
    return my_op_backward_op(grad_y, x)


# One definition each: the registered op (fake, autograd; torch.compile traces into _forward where the
# chosen backend is Triton or the reference) and the lean eager call (kernelforge/ops/_opdef.py).
my_op_backward_op = define_op("kernelforge::my_op_backward(Tensor grad_y, Tensor x) -> Tensor", _backward,
                              _fake_backward, choose=lambda grad_y, x: _choose(x))
my_op_op = define_op("kernelforge::my_op(Tensor x) -> Tensor", _forward, _fake_forward, choose=_choose,
                     setup_context=_save_input, backward=_gradient)


def my_op(x: torch.Tensor) -> torch.Tensor:
    """y = my_op(x), elementwise (see kernelforge/reference/my_op.py); differentiable; works
    under torch.compile."""
    return my_op_op(x)
