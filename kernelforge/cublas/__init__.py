"""Launchers that hand an op to NVIDIA's libraries through torch (cuBLAS / cuBLASLt for the
GEMM): a backend beside kernelforge's own kernels, so that where a vendor kernel is faster at a
shape, it can run there (kernelforge.backends)."""
