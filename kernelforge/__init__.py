"""kernelforge: fused GPU kernels for PyTorch as registered, differentiable operators.

    import kernelforge as kf
    y = kf.softmax(x, dim=-1)
    loss = kf.cross_entropy(logits, target)
    h = kf.rms_norm(x, weight, eps=1e-6)
    with kf.use_backend("triton"):
        y = kf.log_softmax(x)
    print(kf.explain("softmax", x))
"""
import torch as _torch

from kernelforge._versions import torch_problem as _torch_problem

if _torch_problem(_torch.__version__):  # before anything registers an op against an older torch
    raise ImportError(_torch_problem(_torch.__version__))

from kernelforge import nn, ops  # noqa: E402, F401  (ops registers the torch.library operators)
from kernelforge.backends import BackendUnsupportedError, explain, prefer_backend, use_backend
from kernelforge.block_mask import BlockMask, dilated_block_mask, local_global_block_mask, sliding_window_block_mask
from kernelforge.ops.activations import bias_gelu, bias_silu, gelu, relu, silu
from kernelforge.ops.attention import flash_attention
from kernelforge.ops.attention_varlen import flash_attention_varlen
from kernelforge.ops.convrnn import convrnn, convrnn_forward
from kernelforge.ops.cross_entropy import cross_entropy
from kernelforge.ops.gated_activations import geglu, swiglu
from kernelforge.ops.gated_mlp import gated_mlp
from kernelforge.ops.gather_scatter import gather_scatter
from kernelforge.ops.gemm import gemm, precision
from kernelforge.ops.linear_cross_entropy import fused_linear_cross_entropy
from kernelforge.ops.norms import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from kernelforge.ops.rope import rope
from kernelforge.ops.softmax import log_softmax, softmax
from kernelforge.patching import patch
from kernelforge.policy import gpu_kernel
from kernelforge.reference.attention import cpu_fused_attention, optimized_cpu_attention

__version__ = "0.1.0"

__all__ = ["BackendUnsupportedError", "BlockMask", "add_layer_norm", "add_rms_norm", "bias_gelu", "bias_silu",
           "convrnn", "convrnn_forward", "cpu_fused_attention", "cross_entropy", "dilated_block_mask", "explain",
           "flash_attention", "flash_attention_varlen", "fused_linear_cross_entropy", "gated_mlp", "gather_scatter",
           "geglu", "gelu", "gemm", "gpu_kernel", "layer_norm", "local_global_block_mask", "log_softmax", "nn",
           "optimized_cpu_attention", "patch", "precision", "prefer_backend", "relu", "rms_norm", "rope", "silu",
           "sliding_window_block_mask", "softmax", "swiglu", "use_backend"]
