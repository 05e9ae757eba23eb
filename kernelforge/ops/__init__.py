"""Op families: schema, input checks, fake implementation, autograd, backend dispatch.

Importing this package registers every op under the `kernelforge` torch.library namespace.
No kernel code lives here.
"""
# importing registers the torch.library operators (kernelforge::softmax, ...)
from kernelforge.ops import (activations, attention, convrnn, cross_entropy, gated_activations,  # noqa: F401
                             gated_mlp, gather_scatter, gemm, linear_cross_entropy, norms, rope, softmax)
