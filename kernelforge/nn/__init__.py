"""nn.Module wrappers around kernelforge ops, drop-in for their torch.nn counterparts."""
from kernelforge.nn.softmax import LogSoftmax, Softmax

__all__ = ["Softmax", "LogSoftmax"]
