"""kernelforge: fused GPU kernels for PyTorch as registered, differentiable operators.

    import kernelforge as kf
    y = kf.softmax(x, dim=-1)
    with kf.use_backend("triton"):
        y = kf.log_softmax(x)
    print(kf.explain("softmax", x))
"""
from kernelforge import nn, ops  # noqa: F401  (ops registers the torch.library operators)
from kernelforge.backends import BackendUnsupportedError, explain, use_backend
from kernelforge.ops.softmax import log_softmax, softmax

__version__ = "0.1.0"

__all__ = ["BackendUnsupportedError", "explain", "log_softmax", "nn", "softmax", "use_backend"]
