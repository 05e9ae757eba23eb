"""nn.Module wrappers around kernelforge ops, drop-in for their torch.nn counterparts."""
from kernelforge.nn.norms import LayerNorm, RMSNorm, TritonLayerNorm
from kernelforge.nn.softmax import LogSoftmax, Softmax

__all__ = ["LayerNorm", "LogSoftmax", "RMSNorm", "Softmax", "TritonLayerNorm"]
