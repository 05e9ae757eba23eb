"""kernelforge.gemm's input checks: shapes (batch dims broadcast as torch.matmul does), dtypes,
devices, the epilogue's bias and residual, the fp8 scales; each failure names the argument, what
was expected and what came (kernelforge/ops/gemm.py calls them from the op's implementation and
its fake alike). They read metadata only: this runs on every call."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from kernelforge.ops._common import FLOAT_DTYPES, check_floating, check_same, require
from kernelforge.reference import gemm as reference
from kernelforge.reference.activations import KINDS

ACTIVATIONS = (None,) + KINDS
TRITON_MODES = ("fp32", "tf32", "fp16", "bf16", "fp8")
COMPUTE_MODES = TRITON_MODES + ("fp64",)
FP8_OPERAND_DTYPES = FLOAT_DTYPES + (reference.FP8,)
FP8_MIN_CAPABILITY = (8, 9)  # e4m3 tensor cores: Ada (sm_89), Hopper (sm_90) and later


def broadcast_shapes(x: Sequence[int], y: Sequence[int]) -> Optional[tuple[int, ...]]:
    """torch.broadcast_shapes of two shapes, None where they do not broadcast. In Python:
    torch.broadcast_shapes costs ~15 us a call on the host, more than a small GEMM."""
    if len(x) < len(y):
        x, y = y, x
    out = list(x)
    for i in range(1, len(y) + 1):
        if y[-i] != 1 and out[-i] != y[-i]:
            if out[-i] != 1:
                return None
            out[-i] = y[-i]
    return tuple(out)


def why_no_fp8(device: torch.device, capability: Optional[tuple[int, int]] = None) -> Optional[str]:
    """None where precision="fp8" runs (the CPU reference emulates it; GPUs need e4m3 tensor
    cores), else why not. `capability` defaults to the device's."""
    if device.type != "cuda":
        return None
    capability = capability or torch.cuda.get_device_capability(device)
    if tuple(capability) < FP8_MIN_CAPABILITY:
        need = ".".join(map(str, FP8_MIN_CAPABILITY))
        return (f"kernelforge.gemm: precision='fp8' needs a GPU with float8 tensor cores (compute capability "
                f"{need}+: Ada, Hopper), got {capability[0]}.{capability[1]} on {device}")
    return None


def _fp8_scales(a, b, scale_a, scale_b, fp8_scaling: str, N: int) -> None:
    if fp8_scaling not in reference.FP8_SCALINGS:
        raise ValueError(f"kernelforge.gemm: fp8_scaling must be one of {reference.FP8_SCALINGS}, got {fp8_scaling!r}")
    reason = why_no_fp8(a.device)
    if reason is not None:
        raise RuntimeError(reason)
    for name, t, want in (("scale_a", scale_a, (*a.shape[:-1], 1)), ("scale_b", scale_b, (*b.shape[:-2], 1, N))):
        if t is None:
            continue
        check_floating("gemm", name, t, FLOAT_DTYPES)
        check_same("gemm", "device", ("a", name), (a.device, t.device))
        if broadcast_shapes(t.shape, want) != want:
            raise ValueError(f"kernelforge.gemm: {name} must broadcast to {want} (one scale per tensor, or per "
                             f"{'row of a' if name == 'scale_a' else 'column of b'}), got shape {tuple(t.shape)}")


def check_gemm(a, b, bias, residual, activation: str, compute: str, scale_a=None, scale_b=None, fp8_scaling: str = "row"
           ) -> tuple[tuple[int, ...], int, int, int]:
    """(batch shape, M, N, K) of valid inputs, else a message naming the argument. The common
    cases (two matrices, a batch against one matrix, a residual of the output's shape) skip the
    general broadcasting: this runs on every call."""
    operand_dtypes = FP8_OPERAND_DTYPES if compute == "fp8" else FLOAT_DTYPES
    check_floating("gemm", "a", a, operand_dtypes)
    check_floating("gemm", "b", b, operand_dtypes)
    a_dims, b_dims = a.dim(), b.dim()
    for name, t, dims in (("a", a, a_dims), ("b", b, b_dims)):
        if dims < 2:
            raise ValueError(f"kernelforge.gemm: {name} must have at least 2 dims (..., rows, cols), "
                             f"got shape {tuple(t.shape)}")
    device = a.device
    check_same("gemm", "device", ("a", "b"), (device, b.device))
    if activation != "none" and activation not in KINDS:
        raise ValueError(f"kernelforge.gemm: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if compute not in COMPUTE_MODES:
        raise ValueError(f"kernelforge.gemm: unknown compute mode {compute!r}")
    if compute == "fp64" and (a.dtype != torch.float64 or b.dtype != torch.float64):
        raise TypeError(f"kernelforge.gemm: fp64 compute takes float64 a and b, got {a.dtype} and {b.dtype}")
    a_shape, b_shape = a.shape, b.shape
    M, K = a_shape[-2], a_shape[-1]
    N = b_shape[-1]
    require(b_shape[-2] == K, lambda: f"kernelforge.gemm: a's last dim ({K}) must equal b's second-to-last "
                                      f"(got a {tuple(a.shape)}, b {tuple(b.shape)})")
    if b_dims == 2:
        batch = tuple(a_shape[:-2])
    elif a_dims == 2:
        batch = tuple(b_shape[:-2])
    else:
        batch = broadcast_shapes(a_shape[:-2], b_shape[:-2])
        if batch is None:
            raise ValueError(f"kernelforge.gemm: the batch dims of a {tuple(a.shape[:-2])} and b "
                             f"{tuple(b.shape[:-2])} do not broadcast")
    if bias is not None:
        check_floating("gemm", "bias", bias, FLOAT_DTYPES)
        check_same("gemm", "device", ("a", "bias"), (device, bias.device))
        require(bias.dim() == 1 and bias.shape[0] == N,
                lambda: f"kernelforge.gemm: bias must have shape ({N},) (b's last dim), got {tuple(bias.shape)}")
    if residual is not None:
        check_floating("gemm", "residual", residual, FLOAT_DTYPES)
        check_same("gemm", "device", ("a", "residual"), (device, residual.device))
        shape = (*batch, M, N)
        if residual.shape != shape and broadcast_shapes(residual.shape, shape) != shape:
            raise ValueError(f"kernelforge.gemm: residual of shape {tuple(residual.shape)} does not broadcast to the "
                             f"output's {shape}")
    if compute == "fp8":
        _fp8_scales(a, b, scale_a, scale_b, fp8_scaling, N)
    elif scale_a is not None or scale_b is not None:
        raise ValueError(f"kernelforge.gemm: scale_a and scale_b go with precision='fp8', got compute mode {compute!r}")
    return batch, M, N, K
