"""The CUDA tensor-core GEMM (csrc/gemm_kernel.cuh, gemm_cuda.cu, gemm_binding.cpp;
kernelforge/cuda/matmul.py): the gemm op's backend interface and the raw API
kernelforge.cuda.gemm(a, b, block_size=256, shared_mem=True).

CPU: why_not, the launcher and the raw API refuse what the kernel does not take, with the
reason. The kernel itself runs on the CPU through the emulation of the warp-level
instructions it is built from (tests/cuda/attention_emu/attention_mma.cuh, driven by
tests/cuda/gemm_emu/emulate.cpp: every CUDA thread a fiber; mma, ldmatrix and cp.async with
their PTX semantics; reports shared-memory reads racing cp.async, cp.async reads outside the
operands, writes past the outputs, divergent collectives and deadlocks), against the float64
oracle: fragment layouts of all four operand layouts, edges in M, N and K, partial 16-byte
chunks, the pipeline, the epilogue and the split into launches are exercised here; only the
real instructions' timing and the tensor cores' own accumulation order are not.
GPU: the extension against the float64 oracle under the accuracy rule (tests/numerics.py: 2x
the error of PyTorch's own computation at the output's dtype plus a floor at the scale of
the products) over shapes, dtypes, layouts, batches, every epilogue; the raw API; messages;
streams. test_compiler.py compiles gemm_cuda.cu for sm_90 with -Werror and zero spills.
"""
from __future__ import annotations

import math
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from kernelforge.cuda import gemm as _package_gemm
from kernelforge.cuda.compiler import EXTENSIONS
from kernelforge.reference.activations import KINDS, activation_value
from tests.conftest import needs_cuda
from tests.cuda.emulation import build_emulator
from tests.numerics import assert_matches_oracle
from tests.ops.test_gemm import term_scale, torch_gemm  # the op tests' yardstick

import kernelforge.cuda.matmul as cuda_gemm  # noqa: E402  (the package's gemm function stays: test below)

DTYPES = (torch.float16, torch.bfloat16)
ACTIVATIONS = (None,) + KINDS
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


# ----------------------------------------------------------------------------- oracle
def check(out, a, b, bias=None, activation=None, residual=None, preact=None, what=""):
    """out (and preact) of a (batch, M, K) @ b (batch, K, N) with the epilogue, against the
    float64 oracle; the yardstick is PyTorch at the operands' dtype, or in float32 for a
    float32 output."""
    batch, M, K = a.shape
    N = b.shape[2]
    assert out.shape == (batch, M, N) and out.is_contiguous(), what
    exact = torch.matmul(a.double(), b.double())
    z = exact if bias is None else exact + bias.double()
    oracle = z if activation is None else activation_value(z, activation)
    oracle = oracle if residual is None else oracle + residual.double()
    work = torch.float32 if out.dtype == torch.float32 else a.dtype
    same = torch_gemm(a.to(work), b.to(work), bias, activation, residual)
    scale = term_scale(a, b)
    assert_matches_oracle(out, same.to(out.dtype), oracle.to(out.device), f"{what} out", reduced=K, terms_scale=scale)
    if preact is not None:
        assert preact.shape == out.shape and preact.dtype == out.dtype and preact.is_contiguous(), what
        same_acc = torch.matmul(a.to(work), b.to(work)).to(out.dtype)
        assert_matches_oracle(preact, same_acc, exact.to(out.device), f"{what} preact", reduced=K, terms_scale=scale)


def round8(n: int) -> int:
    return (n + 7) // 8 * 8


def operand(batch, rows, cols, dtype, device, layout="rows", scale=1.0):
    """(batch, rows, cols) random values in one of the layouts callers pass:
    rows:        contiguous (unit stride along cols: k-major a, n-major b)
    cols:        unit stride along rows (the transpose of a contiguous (batch, cols, rows))
    rows-padded: unit stride along cols, rows of round8(cols) + 8 elements whose padding is
                 NaN: read in place, partial 16-byte chunks at the end of every row
    cols-padded: the same along rows
    strided:     every other element along cols: no unit stride (the binding copies)
    offset:      contiguous, one element past a 16-byte boundary (the binding copies)
    shared:      one matrix expanded over the batch (stride 0)"""
    def randn(*shape):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    if layout == "rows":
        return randn(batch, rows, cols)
    if layout == "cols":
        return randn(batch, cols, rows).transpose(1, 2)
    if layout in ("rows-padded", "cols-padded"):
        inner, outer = (cols, rows) if layout == "rows-padded" else (rows, cols)
        buf = torch.full((batch, outer, round8(inner) + 8), math.nan, dtype=dtype, device=device)
        view = buf[:, :, :inner]
        view.copy_(randn(batch, outer, inner))
        return view if layout == "rows-padded" else view.transpose(1, 2)
    if layout == "strided":
        return randn(batch, rows, 2 * cols)[:, :, ::2]
    if layout == "offset":
        return randn(batch * rows * cols + 1)[1:].view(batch, rows, cols)
    assert layout == "shared"
    return randn(1, rows, cols).expand(batch, rows, cols)


# ----------------------------------------------------------------------------- CPU: checks
def test_extension_is_registered():
    assert EXTENSIONS["gemm"].sources == ("gemm_cuda.cu", "gemm_binding.cpp")
    import kernelforge.cuda as kcuda

    assert "gemm" in kcuda.__all__ and kcuda.gemm is _package_gemm  # importing .matmul did not replace it


def test_why_not_refuses_what_the_kernel_does_not_take():
    why = cuda_gemm.why_not
    a = torch.randn(4, 8, dtype=torch.float16)
    b = torch.randn(8, 3, dtype=torch.float16)
    for mode in ("fp32", "tf32", "fp64", "fp8"):
        reason = why(a.float(), b.float(), mode)
        assert "computes in fp16 or bf16" in reason and f"not {mode}" in reason
    assert "fp32" in why(a, b)  # the default mode is fp32
    reason = why(a, b.bfloat16(), "fp16")
    assert "takes torch.float16 operands" in reason and "b of torch.bfloat16" in reason
    reason = why(a, b, "bf16")
    assert "takes torch.bfloat16 operands" in reason and "a of torch.float16" in reason
    reason = why(a.double(), b.double(), "fp16")
    assert "a of torch.float64" in reason
    assert "CUDA tensors" in why(a, b, "fp16") and "cpu" in why(a, b, "fp16")
    assert "CUDA tensors" in why(a.to("meta"), b.to("meta"), "fp16")
    assert "CUDA tensors" in why(a.bfloat16(), b.bfloat16(), "bf16")


def test_launcher_refuses_modes_it_does_not_run():
    a = torch.randn(1, 4, 8, dtype=torch.float16)
    b = torch.randn(1, 8, 3, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"kernelforge.cuda.gemm: cannot run compute='fp32' on a of torch.float16.*"
                                         r"computes in fp16 or bf16"):
        cuda_gemm.gemm(a, b, None, None, None, "fp32", torch.float16, False)
    with pytest.raises(ValueError, match=r"activation='tanh'"):
        cuda_gemm.gemm(a, b, None, None, "tanh", "fp16", torch.float16, False)
    with pytest.raises(ValueError, match=r"out_dtype=torch.int32"):
        cuda_gemm.gemm(a, b, None, None, None, "fp16", torch.int32, False)


def test_raw_api_raises_with_the_reason():
    import kernelforge.cuda as kcuda

    a = torch.randn(4, 8, dtype=torch.float16)
    b = torch.randn(8, 3, dtype=torch.float16)
    for raw in (kcuda.gemm, cuda_gemm.matmul):
        with pytest.raises(ValueError, match=r"kernelforge.cuda.gemm: the CUDA extension runs on CUDA tensors, "
                                             r"got a on cpu"):
            raw(a, b)
    with pytest.raises(ValueError, match=r"block_size must be 256 or 128 \(threads per block: 8 or 4 warps\), got 512"):
        kcuda.gemm(a, b, block_size=512)
    with pytest.raises(ValueError, match=r"block_size must be 256 or 128.*got True"):
        kcuda.gemm(a, b, block_size=True)
    with pytest.raises(ValueError, match=r"shared_mem=False is not supported.*pass shared_mem=True"):
        kcuda.gemm(a, b, shared_mem=False)
    with pytest.raises(TypeError, match=r"b must be a torch.Tensor, got list"):
        kcuda.gemm(a, [[1.0]])
    with pytest.raises(ValueError, match=r"a must have at least 2 dims \(..., rows, cols\), got shape \(8,\)"):
        kcuda.gemm(a[0], b)
    with pytest.raises(ValueError, match=r"a must be float16 or bfloat16, got torch.float32"):
        kcuda.gemm(a.float(), b)
    with pytest.raises(ValueError, match=r"a and b must have one dtype, got a of torch.float16 and b of torch.bf"):
        kcuda.gemm(a, b.bfloat16())


# ----------------------------------------------------------------------------- CPU: emulation
EMU_DIR = Path(__file__).resolve().parent / "gemm_emu"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory) -> Path:
    return build_emulator(tmp_path_factory, EMU_DIR)


# The binding's layout rules (gemm_binding.cpp), for CPU tensors whose storage the emulator
# places on a 16-byte boundary.
def _kernel_stride(t, d):
    return 0 if t.shape[d] == 1 else t.stride(d)


def _readable_in_place(t, unit):
    if t.shape[unit] > 1 and t.stride(unit) != 1:
        return False
    return t.storage_offset() * t.element_size() % 16 == 0 and all(
        _kernel_stride(t, d) >= 0 and _kernel_stride(t, d) % 8 == 0 for d in (0, 3 - unit))


def _aligned_copy(t, unit):
    shared = t.shape[0] > 1 and t.stride(0) == 0
    src = t[:1] if shared else t
    batch, rows, cols = src.shape
    if unit == 2:
        view = torch.full((batch, rows, round8(cols)), math.nan, dtype=t.dtype)[:, :, :cols]
    else:
        view = torch.full((batch, cols, round8(rows)), math.nan, dtype=t.dtype)[:, :, :rows].transpose(1, 2)
    view.copy_(src)
    return view.expand(t.shape[0], rows, cols) if shared else view


def _operand_layout(t, first):
    if _readable_in_place(t, first):
        return t, first
    if _readable_in_place(t, 3 - first):
        return t, 3 - first
    return _aligned_copy(t, first), first


def _buffer(t):
    """(the bytes of t's whole storage, its element offset, its length in elements)."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=t.dtype).set_(storage, 0, (storage.nbytes() // t.element_size(),))
    return flat.view(torch.uint8).numpy().tobytes(), t.storage_offset(), flat.numel()


def _epilogue_input(t):
    return t if t.dtype in DTYPE_CODES else t.float()


def run_emulated(exe, tmp_path, a, b, bias=None, residual=None, activation=None, out_dtype=None, save_preact=False,
                 warps=8, copies="eager", order="rr", max_rows=0, max_ctas=0):
    """(out, preact or None) as the binding + kernel compute them, run by the emulator (a
    (batch, M, K), b (batch, K, N) CPU tensors)."""
    out_dtype = out_dtype or a.dtype
    batch, M, K = a.shape
    N = b.shape[2]
    header = [batch, M, N, K, DTYPE_CODES[a.dtype]]
    blobs = []
    if K > 0:
        a, a_unit = _operand_layout(a, 2)
        b, b_unit = _operand_layout(b, 2)
    else:
        a_unit, b_unit = 2, 2
    for t, k_major, unit in ((a, a_unit == 2, a_unit), (b, b_unit == 1, b_unit)):
        data, offset, length = _buffer(t) if K > 0 else (b"", 0, 0)
        header += [int(k_major), offset, _kernel_stride(t, 0) if K else 0, _kernel_stride(t, 3 - unit) if K else 0,
                   length]
        blobs.append(data)
    if bias is None:
        header += [0] * 5
    else:
        bias = _epilogue_input(bias)
        data, offset, length = _buffer(bias)
        header += [1, DTYPE_CODES[bias.dtype], offset, _kernel_stride(bias, 0), length]
        blobs.append(data)
    if residual is None:
        header += [0] * 7
    else:
        residual = _epilogue_input(residual)
        data, offset, length = _buffer(residual)
        header += [1, DTYPE_CODES[residual.dtype], offset, *[_kernel_stride(residual, d) for d in range(3)], length]
        blobs.append(data)
    header += [DTYPE_CODES[out_dtype], cuda_gemm.ACTIVATION_CODES[activation], int(save_preact), warps, max_rows,
               max_ctas]
    header += [0] * (40 - len(header))
    inp, outp = tmp_path / "in.bin", tmp_path / "out.bin"
    inp.write_bytes(struct.pack("<40q", *header) + b"".join(blobs))
    result = subprocess.run([str(exe), str(inp), str(outp), copies, order], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, f"emulator exit {result.returncode}: {result.stderr}"
    data = outp.read_bytes()
    n = batch * M * N * torch.empty(0, dtype=out_dtype).element_size()
    assert len(data) == n * (2 if save_preact else 1)

    def tensor(raw):
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(out_dtype).view(batch, M, N)

    return tensor(data[:n]), tensor(data[n:]) if save_preact else None


# (batch, M, N, K): one element; edges inside one tile; K long (129 slices) and short; M and
# N across tiles; sizes not multiples of 8 (copied or partial chunks); a batch.
EMU_SHAPES = [(1, 1, 1, 1), (1, 17, 199, 33), (1, 199, 17, 4097), (1, 4097, 17, 40), (1, 130, 260, 72),
              (3, 33, 40, 24)]
# (a layout, b layout): the four kernel variants (a k-major / m-major x b n-major / k-major)
# read in place (padded rows), and two contiguous layouts whose odd sizes the binding copies.
EMU_LAYOUTS = [("rows-padded", "rows-padded"), ("rows-padded", "cols-padded"), ("cols-padded", "rows-padded"),
               ("cols-padded", "cols-padded"), ("rows", "cols"), ("cols", "rows")]


def variant(a, b):
    """(a k-major, b k-major): the kernel variant the binding picks for a and b."""
    return _operand_layout(a, 2)[1] == 2, _operand_layout(b, 2)[1] == 1


def _emulated_cases():
    """Every (shape, layouts, dtype), but the long shapes (K or M over 1000) only on two
    layouts, and M over 1000 in float16 only: emulation time."""
    cases = []
    for shape in EMU_SHAPES:
        for layouts in EMU_LAYOUTS:
            for dtype, name in zip(DTYPES, ("f16", "bf16")):
                _, M, _, K = shape
                if (K > 1000 or M > 1000) and layouts not in (("rows", "cols"), ("cols-padded", "rows-padded")) \
                        or M > 1000 and dtype != torch.float16:
                    continue
                cases.append(pytest.param(shape, layouts, dtype,
                                          id=f"{'x'.join(map(str, shape))}-{'-'.join(layouts)}-{name}"))
    return cases


@pytest.mark.parametrize("shape,layouts,dtype", _emulated_cases())
def test_emulated_kernel_matches_oracle(emulator, tmp_path, shape, layouts, dtype):
    batch, M, N, K = shape
    a = operand(batch, M, K, dtype, "cpu", layouts[0])
    b = operand(batch, K, N, dtype, "cpu", layouts[1], scale=K ** -0.5)
    if "padded" in layouts[0] and min(M, K) > 1:
        assert variant(a, b)[0] == (layouts[0] == "rows-padded"), "a is read in place"
    if "padded" in layouts[1] and min(K, N) > 1:
        assert variant(a, b)[1] == (layouts[1] == "cols-padded"), "b is read in place"
    bias = torch.randn(N).to(dtype)
    residual = torch.randn(batch, M, N).to(dtype)
    out, preact = run_emulated(emulator, tmp_path, a, b, bias, residual, "gelu_tanh", save_preact=True)
    check(out, a, b, bias, "gelu_tanh", residual, preact, what=f"emulated {shape} {layouts} {dtype}")
    out, _ = run_emulated(emulator, tmp_path, a, b)
    check(out, a, b, what=f"emulated plain {shape} {layouts} {dtype}")


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=[str(x) for x in ACTIVATIONS])
def test_emulated_epilogues(emulator, tmp_path, activation):
    # Every activation with and without bias / residual, bias and residual of other dtypes
    # than the operands', a broadcast and a transposed residual, every output dtype.
    a = operand(1, 37, 29, torch.bfloat16, "cpu", "rows-padded")
    b = operand(1, 29, 150, torch.bfloat16, "cpu", "cols", scale=29 ** -0.5)
    bias32 = torch.randn(150)
    residuals = {"dense": torch.randn(1, 37, 150).bfloat16(),
                 "row broadcast": torch.randn(150).half().expand(1, 37, 150),
                 "transposed float32": torch.randn(1, 150, 37).transpose(1, 2)}
    for label, residual in residuals.items():
        for bias in (None, bias32, torch.randn(300).bfloat16()[::2]):
            out, preact = run_emulated(emulator, tmp_path, a, b, bias, residual, activation, save_preact=True)
            check(out, a, b, bias, activation, residual, preact, what=f"{activation} {label} bias={bias is not None}")
    for out_dtype in (torch.float32, torch.float16):
        out, preact = run_emulated(emulator, tmp_path, a, b, bias32, None, activation, out_dtype, save_preact=True)
        check(out, a, b, bias32, activation, None, preact, what=f"{activation} out {out_dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
def test_emulated_kernel_reads_every_layout(emulator, tmp_path, dtype):
    # Padded rows (in place, a partial 16-byte chunk at the end of every row: the padding is
    # NaN, so reading it would show), strided and misaligned views (copied), shared operands
    # (batch stride 0), an a whose rows are one broadcast row.
    cases = {
        "a rows-padded, b rows-padded": ("rows-padded", "rows-padded"),
        "a cols-padded, b cols-padded": ("cols-padded", "cols-padded"),
        "a strided, b offset": ("strided", "offset"),
        "a offset, b strided": ("offset", "strided"),
        "a shared, b rows-padded": ("shared", "rows-padded"),
        "a cols, b shared": ("cols", "shared"),
    }
    for M, N, K in ((45, 37, 43), (46, 38, 42)):  # partial chunks of odd and even lengths
        for label, (la, lb) in cases.items():
            a = operand(3, M, K, dtype, "cpu", la)
            b = operand(3, K, N, dtype, "cpu", lb, scale=K ** -0.5)
            bias = torch.randn(N).to(dtype)
            out, _ = run_emulated(emulator, tmp_path, a, b, bias, None, "silu")
            check(out, a, b, bias, "silu", what=f"{label} {M}x{N}x{K}")
    M, N, K = 45, 37, 43
    a = torch.randn(1, 1, K).to(dtype).expand(1, M, K)  # row stride 0
    b = operand(1, K, N, dtype, "cpu", "cols", scale=K ** -0.5)
    out, _ = run_emulated(emulator, tmp_path, a, b)
    check(out, a, b, what="expanded a rows")


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("copies, order", [("eager", "rr"), ("eager", "low"), ("lazy", "rr"), ("lazy", "low"),
                                           ("lazy", "high")])
def test_emulated_kernel_under_every_schedule(emulator, tmp_path, warps, copies, order):
    # cp.async landing at issue or only at the wait, warps in lockstep or one far ahead of the
    # others: a missing barrier or wait shows as a reported race or a wrong result.
    a = operand(1, 140, 150, torch.float16, "cpu", "cols")
    b = operand(1, 150, 135, torch.float16, "cpu", "rows", scale=150 ** -0.5)
    bias, residual = torch.randn(135).half(), torch.randn(1, 140, 135).half()
    out, preact = run_emulated(emulator, tmp_path, a, b, bias, residual, "relu", save_preact=True, warps=warps,
                               copies=copies, order=order)
    check(out, a, b, bias, "relu", residual, preact, what=f"warps={warps} {copies} copies, {order} order")


def test_emulated_split_into_launches(emulator, tmp_path):
    # Limits of 128 rows and 6 CTAs per launch split (batch 5, 296 rows, 3 column tiles) into
    # launches by row block and by batch; the pointers of each launch are offset.
    b = operand(5, 24, 300, torch.bfloat16, "cpu", "cols", scale=0.2)
    residual = torch.randn(5, 296, 300).bfloat16()
    for layout in ("rows", "cols"):  # k-major a moves by rows of a_ld, m-major a by elements
        a = operand(5, 296, 24, torch.bfloat16, "cpu", layout)
        assert _operand_layout(a, 2)[1] == (2 if layout == "rows" else 1), "read in place"
        for max_rows, max_ctas in ((128, 6), (256, 3), (0, 9)):
            out, preact = run_emulated(emulator, tmp_path, a, b, None, residual, "gelu", save_preact=True,
                                       max_rows=max_rows, max_ctas=max_ctas)
            check(out, a, b, None, "gelu", residual, preact, what=f"a {layout} max_rows={max_rows} max_ctas={max_ctas}")


def test_emulated_empty_k_gives_the_epilogue_of_zeros(emulator, tmp_path):
    a = torch.empty(2, 9, 0, dtype=torch.float16)
    b = torch.empty(2, 0, 5, dtype=torch.float16)
    bias, residual = torch.randn(5).half(), torch.randn(2, 9, 5).half()
    out, preact = run_emulated(emulator, tmp_path, a, b, bias, residual, "gelu", save_preact=True)
    expected = (activation_value(bias.double(), "gelu") + residual.double()).half()
    # the kernel's epilogue is float32, rounded once to half; the oracle's float64 rounded once: the
    # two roundings may land an ulp of half apart where float32's error crosses a rounding boundary
    # (seed 1047822534 did), never more
    torch.testing.assert_close(out, expected, rtol=2 ** -10, atol=2 ** -24)
    assert not preact.any()


def test_shared_memory_table_matches_the_tiles(emulator):
    lines = subprocess.run([str(emulator), "--smem"], capture_output=True, text=True, check=True).stdout.splitlines()
    table = {tuple(map(int, line.split()[:3])): int(line.split()[3]) for line in lines}
    assert set(table) == {(w, ak, bk) for w in (4, 8) for ak in (0, 1) for bk in (0, 1)}
    assert max(table.values()) == cuda_gemm.SMEM_BYTES


# ----------------------------------------------------------------------------- GPU
# (batch, M, N, K) around the 128 x 128 x 32 tile, odd sizes, 4097 in each dim.
GPU_SHAPES = [(1, 1, 1, 1), (1, 17, 199, 4097), (1, 4097, 17, 199), (1, 199, 4097, 17), (1, 128, 128, 32),
              (2, 129, 257, 33), (1, 1000, 1000, 1000), (4, 300, 77, 512)]
GPU_LAYOUTS = EMU_LAYOUTS + [("rows", "rows"), ("cols", "cols"), ("strided", "offset")]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("layouts", GPU_LAYOUTS, ids=["-".join(x) for x in GPU_LAYOUTS])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=["x".join(map(str, s)) for s in GPU_SHAPES])
def test_matches_oracle(shape, layouts, dtype):
    batch, M, N, K = shape
    a = operand(batch, M, K, dtype, "cuda", layouts[0])
    b = operand(batch, K, N, dtype, "cuda", layouts[1], scale=K ** -0.5)
    compute = "fp16" if dtype == torch.float16 else "bf16"
    assert cuda_gemm.why_not(a, b, compute) is None
    bias = torch.randn(N, device="cuda").to(dtype)
    residual = torch.randn(batch, M, N, device="cuda").to(dtype)
    out, preact = cuda_gemm.gemm(a, b, bias, residual, "gelu_tanh", compute, dtype, True)
    check(out, a, b, bias, "gelu_tanh", residual, preact, what=f"{shape} {layouts} {dtype}")
    again = cuda_gemm.gemm(a, b, bias, residual, "gelu_tanh", compute, dtype, True)
    assert torch.equal(again[0], out) and torch.equal(again[1], preact), "the GEMM must be bitwise deterministic"
    out, preact = cuda_gemm.gemm(a, b, None, None, None, compute, dtype, False)
    assert preact is None
    check(out, a, b, what=f"plain {shape} {layouts} {dtype}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=[str(x) for x in ACTIVATIONS])
def test_every_epilogue(activation, dtype):
    compute = "fp16" if dtype == torch.float16 else "bf16"
    weight = torch.randn(300, 520, device="cuda").to(dtype) / 520 ** 0.5  # nn.Linear's layout: b = weight.t()
    a = torch.randn(1, 333, 520, device="cuda").to(dtype)
    b = weight.t().unsqueeze(0)
    biases = {"none": None, "same dtype": torch.randn(300, device="cuda").to(dtype),
              "float32": torch.randn(300, device="cuda"),
              "float64 strided": torch.randn(600, device="cuda").double()[::2]}
    residuals = {"none": None, "dense": torch.randn(1, 333, 300, device="cuda").to(dtype),
                 "broadcast row (N,)": torch.randn(300, device="cuda").to(dtype).expand(1, 333, 300),
                 "column (M, 1) float32": torch.randn(1, 333, 1, device="cuda").expand(1, 333, 300),
                 "transposed": torch.randn(1, 300, 333, device="cuda").to(dtype).transpose(1, 2)}
    for bias_label, bias in biases.items():
        for res_label, residual in residuals.items():
            out, preact = cuda_gemm.gemm(a, b, bias, residual, activation, compute, dtype, True)
            check(out, a, b, bias, activation, residual, preact, what=f"bias {bias_label}, residual {res_label}")
    for out_dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        bias = biases["float32"]
        out, preact = cuda_gemm.gemm(a, b, bias, None, activation, compute, out_dtype, True)
        assert out.dtype == out_dtype and preact.dtype == out_dtype
        if out_dtype == torch.float64:  # computed in float32, converted exactly
            ref = cuda_gemm.gemm(a, b, bias, None, activation, compute, torch.float32, True)
            assert torch.equal(out, ref[0].double()) and torch.equal(preact, ref[1].double())
        else:
            check(out, a, b, bias, activation, None, preact, what=f"out {out_dtype}")


@pytest.mark.gpu
@needs_cuda
def test_batches_and_shared_operands():
    dtype, s = torch.bfloat16, 0.125

    def pair(a_layout, b_layout, K=64):
        return operand(6, 104, K, dtype, "cuda", a_layout), operand(6, K, 96, dtype, "cuda", b_layout, scale=s)

    cases = {
        "both batched": pair("rows", "rows"),
        "a shared (stride 0)": pair("shared", "cols"),
        "b shared (stride 0)": pair("cols", "shared"),
        "b shared, copied": pair("rows", "shared", K=63),
        "a transposed batch": (torch.randn(104, 6, 64, device="cuda").to(dtype).transpose(0, 1),
                               operand(6, 64, 96, dtype, "cuda", "rows", scale=s)),
    }
    for label, (a, b) in cases.items():
        assert a.stride(0) != 0 or label.startswith("a shared")
        residual = torch.randn(1, 104, 96, device="cuda").to(dtype).expand(6, 104, 96)
        out, preact = cuda_gemm.gemm(a, b, None, residual, "silu", "bf16", dtype, True)
        check(out, a, b, None, "silu", residual, preact, what=label)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [256, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
def test_raw_api_matches_matmul(dtype, block_size):
    import kernelforge.cuda as kcuda

    shapes = [((77, 130), (130, 99)), ((3, 77, 130), (130, 99)), ((3, 77, 130), (3, 130, 99)),
              ((2, 1, 77, 130), (4, 130, 99)), ((5, 8), (5, 8, 3))]
    for sa, sb in shapes:
        a = torch.randn(*sa, device="cuda").to(dtype)
        b = torch.randn(*sb, device="cuda").to(dtype) / sa[-1] ** 0.5
        got = kcuda.gemm(a, b, block_size=block_size)
        want = torch.matmul(a, b)
        assert got.shape == want.shape and got.dtype == dtype
        a3, b3 = a.double().expand(*want.shape[:-2], *sa[-2:]), b.double().expand(*want.shape[:-2], *sb[-2:])
        assert_matches_oracle(got, want, torch.matmul(a3, b3), f"raw {sa} @ {sb}", reduced=sa[-1],
                              terms_scale=torch.matmul(a3.abs(), b3.abs()).max().item())
    a = torch.randn(64, 48, device="cuda").to(dtype)
    with pytest.raises(ValueError, match=r"a's last dim \(48\) must equal b's second-to-last"):
        kcuda.gemm(a, a)
    with pytest.raises(ValueError, match=r"batch dims of a \(2,\) and b \(3,\) do not broadcast"):
        kcuda.gemm(a.expand(2, 64, 48), a.t().expand(3, 48, 64))
    assert kcuda.gemm(a[:0], a.t()).shape == (0, 64)


@pytest.mark.gpu
@needs_cuda
def test_binding_messages_name_the_problem():
    ext = cuda_gemm._extension()
    a = torch.randn(1, 16, 32, device="cuda", dtype=torch.float16)
    b = torch.randn(1, 32, 8, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"kernelforge gemm: a must be float16 or bfloat16, got Float"):
        ext.forward(a.float(), b.float(), None, None, 0, 1, False, 8)
    with pytest.raises(RuntimeError, match=r"kernelforge gemm: b must have dtype Half like a, got BFloat16"):
        ext.forward(a, b.bfloat16(), None, None, 0, 1, False, 8)
    with pytest.raises(RuntimeError, match=r"b must have shape \[1, 32, N\] \(a's batch and K\), got \[1, 16, 8\]"):
        ext.forward(a, b[:, :16], None, None, 0, 1, False, 8)
    with pytest.raises(RuntimeError, match=r"b must be a CUDA tensor, got device cpu"):
        ext.forward(a, b.cpu(), None, None, 0, 1, False, 8)
    with pytest.raises(RuntimeError, match=r"a must be 3-D \(batch, rows, cols\), got 2-D"):
        ext.forward(a[0], b, None, None, 0, 1, False, 8)
    with pytest.raises(RuntimeError, match=r"bias must have shape \[8\] \(b's last dim\), got \[9\]"):
        ext.forward(a, b, torch.zeros(9, device="cuda"), None, 0, 1, False, 8)
    with pytest.raises(RuntimeError, match=r"residual must have shape \[1, 16, 8\] \(the output's\), got \[16, 8\]"):
        ext.forward(a, b, None, torch.zeros(16, 8, device="cuda"), 0, 1, False, 8)
    with pytest.raises(RuntimeError, match=r"activation must be 0 \(none\).*got 7"):
        ext.forward(a, b, None, None, 7, 1, False, 8)
    with pytest.raises(RuntimeError, match=r"warps must be 4 or 8 \(128 or 256 threads\), got 16"):
        ext.forward(a, b, None, None, 0, 1, False, 16)


@pytest.mark.gpu
@needs_cuda
def test_runs_on_the_current_stream_and_device():
    a = torch.randn(4, 700, 300, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4, 300, 500, device="cuda", dtype=torch.bfloat16)
    expected = cuda_gemm.gemm(a, b, None, None, "relu", "bf16", torch.bfloat16, False)[0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = cuda_gemm.gemm(a, b, None, None, "relu", "bf16", torch.bfloat16, False)[0]
    stream.synchronize()
    assert torch.equal(got, expected)
    if torch.cuda.device_count() > 1:
        a1, b1 = a.to("cuda:1"), b.to("cuda:1")
        got = cuda_gemm.gemm(a1, b1, None, None, "relu", "bf16", torch.bfloat16, False)[0]
        assert got.device == a1.device and torch.equal(got.cpu(), expected.cpu())
