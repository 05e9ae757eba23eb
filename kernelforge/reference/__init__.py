"""Pure-PyTorch implementations: the spec of each op, its CPU path, and the test oracle."""
from kernelforge.reference.softmax import log_softmax, softmax, softmax_backward

__all__ = ["softmax", "log_softmax", "softmax_backward"]
