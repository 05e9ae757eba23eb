"""The kernel sets of the example models' levels: the few functions that differ between levels
(linear, norms, attention, the KV-cache attention, SwiGLU, cross-entropy, gather-scatter), as
torch's (TorchKernels: the native, torchscript and compile levels), kernelforge's
(KernelforgeKernels: the triton, cuda and reference levels, each op on its backend) and the
fastest level's mix of the two (FastestKernels). kernelforge.models.levels picks one a call.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from kernelforge.reference.gather_scatter import gather_scatter as reference_gather_scatter


def _causal_mask(sq: int, sk: int, device: torch.device) -> Optional[torch.Tensor]:
    """(sq, sk) bool, True = visible, aligned to the bottom right as kernelforge.flash_attention
    aligns it (SDPA's is_causal aligns to the top left, which differs when sq != sk)."""
    if sq == sk:
        return None
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq)


_TORCH_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


class _Stateless:
    """A kernel set holds no state: a copied model shares the module's one (LevelledModel.run puts
    back the set it found, which a deepcopy would otherwise have duplicated)."""

    def __deepcopy__(self, memo):
        return self


class TorchKernels(_Stateless):
    """PyTorch's own functions: what the native, torchscript and compile levels run."""

    name = "torch"

    def linear(self, x, weight, bias=None, activation: Optional[str] = None):
        y = F.linear(x, weight, bias)
        return y if activation is None else _TORCH_ACTIVATIONS[activation](y)

    def norm(self, x, weight, bias, eps: float, kind: str):
        if kind == "rms":
            y = F.rms_norm(x, (x.shape[-1],), weight, eps)
            return y if bias is None else y + bias
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    def add_norm(self, x, residual, weight, bias, eps: float, kind: str):
        """(norm(x + residual), x + residual): the pre-norm block's residual stream."""
        h = x + residual
        return self.norm(h, weight, bias, eps, kind), h

    def attention(self, q, k, v, causal: bool):
        """q (B, H, Sq, D), k / v (B, H, Sk, D)."""
        mask = _causal_mask(q.shape[-2], k.shape[-2], q.device) if causal else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)

    def cache_seqlens(self, positions, batch: int):
        """What cached_attention needs besides the positions, computed once a step for every layer:
        nothing here (the mask comes from the positions)."""
        return None

    def cached_attention(self, q, cache_k, cache_v, positions, seqlens):
        """q (B, H, T, D) of the tokens at `positions` (T,) against a static KV cache (B, H, S, D)
        whose rows up to each query's position are filled. The whole cache under a mask computed on
        the device from the positions: one shape for every step (one trace, one compiled graph, one
        CUDA graph), no host read; rows past the position are hidden (they hold zeros, a padded
        prompt's or an earlier call's keys). `seqlens` is unused."""
        visible = torch.arange(cache_k.shape[-2], device=q.device)[None, :] <= positions[:, None]
        return F.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=visible)

    def swiglu(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def cross_entropy(self, logits, target):
        """Mean loss of (N, C) logits against (N,) classes, at least float32: torch's recipe for
        half-precision logits, a float32 copy of them first (and log-softmax's float32 output kept for
        the backward); float32 and float64 logits as they are."""
        half = logits.dtype in (torch.float16, torch.bfloat16)
        return F.cross_entropy(logits.float() if half else logits, target)

    def gather_scatter(self, x, src, dst, num_nodes: int, reduce: str):
        """Message passing's aggregation: out[i] = the sum (or mean) of x[src[e]] over the edges e
        with dst[e] == i; (num_nodes, ...), zero where no edge arrives. index_select + index_add_,
        half types accumulated in float32: kernelforge's reference of the op (plain torch ops, which
        torch.jit.trace and torch.compile see through; no kernelforge op runs at these levels).
        Unfused, index_select writes the (E, ...) messages and index_add_ reads them back: the
        round trip kernelforge's fused kernel saves. Out-of-range indices raise from these ops."""
        return reference_gather_scatter(x, src, dst, num_nodes, reduce)


class KernelforgeKernels(_Stateless):
    """kernelforge's fused ops: what the triton and cuda levels run (the backend comes from the
    level's preference, set around the call)."""

    name = "kernelforge"

    def linear(self, x, weight, bias=None, activation: Optional[str] = None):
        import kernelforge as kf

        return kf.gemm(x, weight.t(), bias=bias, activation=activation)  # W read transposed in place

    def norm(self, x, weight, bias, eps: float, kind: str):
        import kernelforge as kf

        if kind == "rms":
            return kf.rms_norm(x, weight, eps, bias=bias)
        return kf.layer_norm(x, weight, bias, eps)

    def add_norm(self, x, residual, weight, bias, eps: float, kind: str):
        import kernelforge as kf

        if kind == "rms":
            return kf.add_rms_norm(x, residual, weight, eps, bias=bias)
        return kf.add_layer_norm(x, residual, weight, bias, eps)

    def attention(self, q, k, v, causal: bool):
        import kernelforge as kf

        return kf.flash_attention(q, k, v, causal=causal)

    def cache_seqlens(self, positions, batch: int):
        """The cache's filled length, int32 (B,) on the device: one past the last position (the
        positions are consecutive). Computed on the device, so no step reads a value on the host."""
        return (positions[-1:] + 1).to(torch.int32).expand(batch).contiguous()

    def cached_attention(self, q, cache_k, cache_v, positions, seqlens):
        """Attends over the cache's first `seqlens` rows only (flash-decoding runs no tile past them),
        causal offsets aligned to that length; the cache keeps one shape for every step."""
        import kernelforge as kf

        return kf.flash_attention(q, cache_k, cache_v, causal=True, cache_seqlens=seqlens)

    def swiglu(self, gate_up):
        import kernelforge as kf

        return kf.swiglu(gate_up)

    def cross_entropy(self, logits, target):
        """The same float32 loss from the logits in their own dtype (no float32 copy)."""
        import kernelforge as kf

        return kf.cross_entropy(logits, target)

    def gather_scatter(self, x, src, dst, num_nodes: int, reduce: str):
        """kernelforge.gather_scatter: on a GPU one Triton kernel gathers each message straight into
        a float32 accumulator (no (E, ...) messages written and read back). Its atomics make the
        sums' rounding vary from run to run; under torch.use_deterministic_algorithms(True) the
        reference runs instead. The cuda level has no CUDA C++ kernel for it: Triton runs there too."""
        import kernelforge as kf

        return kf.gather_scatter(x, src, dst, num_nodes, reduce)


class FastestKernels(TorchKernels):
    """What the fastest level runs inside torch.compile: each function from whichever of kernelforge
    and torch made the compiled, CUDA-graphed model faster, measured one function group at a time
    against the all-torch set (benchmarks/tuning/fastest_choices.py, H200, bf16, realistic sizes; its
    results sit with the models' under benchmarks/results/):

        kernelforge's    LM forward   LM train step   ViT forward   GNN forward
        norms            0.99x        0.99x           0.99x         0.93x
        swiglu           1.01x        0.96x
        cross_entropy                 1.01x
        gather_scatter                                              0.94x
        linear (GEMM)    0.97x
        attention        0.85x

    Inside a compiled graph Inductor fuses torch's pointwise and reduction work into its own kernels,
    as fast as kernelforge's fused ones and fused with their neighbors too, and cuBLAS / cuDNN beat
    kernelforge's GEMM and head-dim-64 attention; only the loss, which Inductor runs in more passes
    over the logits, wins. So the fastest level is torch.compile with CUDA graphs and kernelforge's
    cross-entropy, and, in a decoding step, kernelforge's flash-decoding and (at batch 1: one row)
    its one-row GEMM: at one row cuBLAS streams a weight at 33-90% of the copy bandwidth, the few-row
    kernel at 0.97-1.25x its pace (H200, the decode step's five shapes), and flash-decoding reads
    only the cache's filled rows, 1.4-1.9x SDPA over the masked whole cache (16 layers in a CUDA
    graph each, benchmarks/tuning/decode_step_sweep.py). The prompt's prefill keeps SDPA."""

    name = "fastest"

    cross_entropy = KernelforgeKernels.cross_entropy
    cache_seqlens = KernelforgeKernels.cache_seqlens  # a (B,) int32 a step: both attentions below take it

    def linear(self, x, weight, bias=None, activation: Optional[str] = None):
        if x.is_cuda and x.dim() >= 2 and x.numel() == x.shape[-1]:  # one row: decided when traced
            return KERNELFORGE_KERNELS.linear(x, weight, bias, activation)
        return super().linear(x, weight, bias, activation)

    def cached_attention(self, q, cache_k, cache_v, positions, seqlens):
        if q.is_cuda and q.shape[-2] == 1:  # a decoding step's token
            return KERNELFORGE_KERNELS.cached_attention(q, cache_k, cache_v, positions, seqlens)
        return super().cached_attention(q, cache_k, cache_v, positions, seqlens)


TORCH_KERNELS = TorchKernels()
KERNELFORGE_KERNELS = KernelforgeKernels()
FASTEST_KERNELS = FastestKernels()


__all__ = ["FASTEST_KERNELS", "KERNELFORGE_KERNELS", "TORCH_KERNELS", "FastestKernels", "KernelforgeKernels",
           "TorchKernels"]
