"""CUDA C++ kernels: JIT-built extensions and the Python objects around them.

    from kernelforge.cuda import get_cuda_compiler, get_cuda_softmax
    module = get_cuda_compiler().compile_from_file("softmax_cuda.cu", "my_softmax")
    softmax = get_cuda_softmax()          # a SoftMaxOp over the last dimension
    y = softmax.forward(x); dx = softmax.backward(dy, y)
    out = flash_attention(q, k, v, scale=0.125)   # (B, H, S, D) float16 / bfloat16
    c = gemm(a, b, block_size=256, shared_mem=True)  # a @ b, float16 / bfloat16, tensor cores

Importing this package builds nothing; extensions are built on first use (or ahead of
time with `kernelforge build`).
"""
from __future__ import annotations

from typing import Optional

from kernelforge.cuda.compiler import EXTENSIONS, CUDABuildError, CUDACompiler, get_cuda_compiler


def why_unavailable(extension: Optional[str] = None) -> Optional[str]:
    """None when CUDA kernels can run here, else why not (no CUDA torch, no GPU, no nvcc,
    or `extension` already failed to build in this process)."""
    from kernelforge.cuda.compiler import why_toolchain_unavailable

    reason = why_toolchain_unavailable()
    if reason is None and extension is not None:
        failure = get_cuda_compiler().failures.get(extension)
        if failure is not None:
            reason = f"the {extension} extension failed to build: {failure}"
    return reason


def get_cuda_softmax(log: bool = False):
    """A SoftMaxOp (log-softmax with log=True) backed by the JIT-built CUDA extension."""
    from kernelforge.cuda.softmax import get_cuda_softmax as _get

    return _get(log)


def flash_attention(q, k, v, scale: float = 0.125, causal: bool = False):
    """softmax(scale * q k^T) v on the CUDA flash-attention kernel (FlashAttention-2 scheme on
    tensor cores): q (B, H, Sq, D), k and v (B, Hkv, Sk, D), float16 / bfloat16, D in 32, 64,
    96, 128, 256. The raw kernel, no autograd (kernelforge's attention op has that)."""
    from kernelforge.cuda.attention import flash_attention as _flash_attention

    return _flash_attention(q, k, v, scale, causal)


def gemm(a, b, block_size: int = 256, shared_mem: bool = True):
    """a @ b on the CUDA tensor-core GEMM (mma.sync, 128 x 128 tiles through a cp.async
    shared-memory pipeline): a (..., M, K), b (..., K, N), float16 / bfloat16, batch dims
    broadcast; the result in a's dtype. block_size: threads per block, 256 or 128;
    shared_mem=False is refused (the kernel always tiles through shared memory). The raw
    kernel, no autograd and no epilogue (kernelforge.gemm has both)."""
    from kernelforge.cuda.matmul import matmul

    return matmul(a, b, block_size, shared_mem)


def __getattr__(name):  # SoftMaxOp without importing torch's extension machinery eagerly
    if name == "SoftMaxOp":
        from kernelforge.cuda.softmax import SoftMaxOp

        return SoftMaxOp
    raise AttributeError(name)


__all__ = ["CUDABuildError", "CUDACompiler", "EXTENSIONS", "SoftMaxOp", "flash_attention", "gemm", "get_cuda_compiler",
           "get_cuda_softmax", "why_unavailable"]
