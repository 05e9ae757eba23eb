"""Op families: schema, input checks, fake implementation, autograd, backend dispatch.

Importing this package registers every op under the `kernelforge` torch.library namespace.
No kernel code lives here.
"""
from kernelforge.ops import activations, attention, gated_activations, gemm, norms, softmax  # noqa: F401  (registers kernelforge::softmax, ...)
