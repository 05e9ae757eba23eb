"""nn.Module wrappers around kernelforge ops, drop-in for their torch.nn counterparts."""
from kernelforge.nn.activations import GELU, SiLU, SwiGLU
from kernelforge.nn.attention import Attention
from kernelforge.nn.linear import Linear
from kernelforge.nn.losses import CrossEntropyLoss, FusedLinearCrossEntropyLoss
from kernelforge.nn.norms import LayerNorm, RMSNorm, TritonLayerNorm
from kernelforge.nn.softmax import LogSoftmax, Softmax

__all__ = ["Attention", "CrossEntropyLoss", "FusedLinearCrossEntropyLoss", "GELU", "LayerNorm", "Linear", "LogSoftmax",
           "RMSNorm", "SiLU", "Softmax", "SwiGLU", "TritonLayerNorm"]
