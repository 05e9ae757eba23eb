"""The CUDA flash-attention forward (csrc/attention_{mma,kernel}.cuh, attention_forward.cu,
attention_binding.cpp; kernelforge/cuda/attention.py).

CPU: why_not and the raw API refuse what the kernel does not take, with the reason. The
kernel itself runs on the CPU through an emulation of the warp-level instructions it is
built from (tests/cuda/attention_emu: every CUDA thread a fiber; mma, ldmatrix, shuffles,
cp.async with their PTX semantics; checks for shared-memory reads racing cp.async, reads
outside the inputs, writes past the outputs, divergent collectives and deadlocks), against
the float64 reference: the fragment layouts, masks, tile loop and epilogue are exercised
here; only the real instructions' timing and the SFU's ex2 are not.
GPU: the extension against the float64 reference under the accuracy rule (2x the error of
torch's own same-dtype SDPA + a floor) over head dims, dtypes, lengths around the tiles,
causal, windows, grouped-query heads, strided and unaligned views; messages; streams.
test_compiler.py compiles attention_forward.cu for sm_90 with -Werror and zero spills.
"""
from __future__ import annotations

import math
import struct
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernelforge.cuda import attention as cuda_attention
from kernelforge.cuda.compiler import EXTENSIONS
from tests.conftest import needs_cuda
from tests.cuda.emulation import build_emulator
from tests.numerics import assert_matches_oracle

HEAD_DIMS = (32, 64, 96, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- oracle
def visible(sq: int, sk: int, causal: bool, wl: int, wr: int, device="cpu") -> torch.Tensor:
    """(sq, sk) bool: key j visible to query i (FlashAttention-2's bottom-right alignment)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    off = sk - sq
    m = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        m &= j <= i + off
    if wl >= 0:
        m &= j >= i + off - wl
    if wr >= 0:
        m &= j <= i + off + wr
    return m


def reference(q, k, v, scale, causal, wl, wr):
    """float64 (out, lse) with scores materialized, one (batch, head) at a time."""
    B, H, Sq, D = q.shape
    group = H // k.shape[1]
    mask = visible(Sq, k.shape[2], causal, wl, wr, q.device)
    out = torch.zeros(B, H, Sq, D, dtype=torch.float64, device=q.device)
    lse = torch.empty(B, H, Sq, dtype=torch.float64, device=q.device)
    for b in range(B):
        for h in range(H):
            kk, vv = k[b, h // group].double(), v[b, h // group].double()
            s = (scale * q[b, h].double() @ kk.T).masked_fill(~mask, -math.inf)
            lse[b, h] = torch.logsumexp(s, -1)
            p = torch.where(mask, torch.exp(s - lse[b, h, :, None]), torch.zeros((), dtype=torch.float64,
                                                                                 device=q.device))
            out[b, h] = p.nan_to_num(0.0) @ vv
    return out, lse


def torch_same_dtype(q, k, v, scale, causal, wl, wr):
    """PyTorch's own SDPA in the tested dtype with the explicit mask (rows without visible
    keys set to 0, as the contract has them)."""
    group = q.shape[1] // k.shape[1]
    mask = visible(q.shape[2], k.shape[2], causal, wl, wr, q.device)
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         attn_mask=mask, scale=scale)
    return torch.where(mask.any(-1)[:, None], out, torch.zeros((), dtype=q.dtype, device=q.device)).nan_to_num(0.0)


def check(out, lse, q, k, v, scale, causal, wl, wr, what):
    B, H, Sq, D = q.shape
    assert out.shape == (B, H, Sq, D) and out.dtype == q.dtype and out.is_contiguous(), what
    assert lse.shape == (B, H, Sq) and lse.dtype == torch.float32, what
    assert not out.isnan().any() and not lse.isnan().any(), f"{what}: NaN in the outputs"
    ref_out, ref_lse = reference(q, k, v, scale, causal, wl, wr)
    assert_matches_oracle(out, torch_same_dtype(q, k, v, scale, causal, wl, wr), ref_out, what, reduced=k.shape[2])
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"{what}: lse is -inf exactly where a row sees no key"
    assert not out[empty].any(), f"{what}: rows without visible keys must be 0"
    if (~empty).any():
        err = (lse.double() - ref_lse)[~empty].abs().max().item()
        bound = 2e-5 * max(1.0, ref_lse[~empty].abs().max().item())
        assert err <= bound, f"{what}: lse max error {err:.3e} > {bound:.3e}"


def make_inputs(B, H, Hkv, Sq, Sk, D, dtype, device, layout="dense"):
    """q (B, H, Sq, D), k, v (B, Hkv, Sk, D) in one of the layouts a caller may pass."""
    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)

    if layout == "dense":
        return randn(B, H, Sq, D), randn(B, Hkv, Sk, D), randn(B, Hkv, Sk, D)
    if layout == "bshd":  # (batch, seq, heads, dim) memory, viewed as (B, H, S, D)
        return (randn(B, Sq, H, D).transpose(1, 2), randn(B, Sk, Hkv, D).transpose(1, 2),
                randn(B, Sk, Hkv, D).transpose(1, 2))
    if layout == "packed":  # q, k, v heads interleaved in one (B, S, H + 2 Hkv, D) buffer (Sq == Sk)
        qkv = randn(B, Sq, H + 2 * Hkv, D)
        return (qkv[:, :, :H].transpose(1, 2), qkv[:, :, H:H + Hkv].transpose(1, 2),
                qkv[:, :, H + Hkv:].transpose(1, 2))
    if layout == "broadcast":  # k, v shared over the batch (stride 0), q padded rows (row stride D + 16)
        return (randn(B, H, Sq, D + 16)[..., :D], randn(1, Hkv, Sk, D).expand(B, -1, -1, -1),
                randn(1, Hkv, Sk, D).expand(B, -1, -1, -1))
    assert layout == "unaligned"  # views one element off a 16-byte boundary: the binding copies them
    def off(*shape):
        n = math.prod(shape)
        return randn(n + 1)[1:].view(*shape)
    return off(B, H, Sq, D), off(B, Hkv, Sk, D), off(B, Hkv, Sk, D)


# ----------------------------------------------------------------------------- CPU: why_not
def test_extension_is_registered():
    assert EXTENSIONS["attention"].sources == ("attention_forward.cu", "attention_binding.cpp")
    import kernelforge.cuda as kcuda

    assert "flash_attention" in kcuda.__all__ and callable(kcuda.flash_attention)


def test_why_not_refuses_what_the_kernel_does_not_take():
    def qkv(dtype=torch.float16, d=64, hkv=2, device="cpu"):
        return (torch.randn(2, 4, 8, d, dtype=dtype, device=device),
                torch.randn(2, hkv, 8, d, dtype=dtype, device=device),
                torch.randn(2, hkv, 8, d, dtype=dtype, device=device))

    why = cuda_attention.why_not
    assert "CUDA tensors" in why(*qkv()) and "cpu" in why(*qkv())
    assert "CUDA tensors" in why(*qkv(device="meta"))
    assert "float16 or bfloat16" in why(*qkv(torch.float32)) and "torch.float32" in why(*qkv(torch.float32))
    reason = why(*qkv(d=80))
    assert "head dims" in reason and "80" in reason
    q, k, v = qkv()
    reason = why(q, k.bfloat16(), v)
    assert "one dtype" in reason and "torch.bfloat16" in reason
    reason = why(*qkv(hkv=3))
    assert "multiple of kv heads" in reason and "(3)" in reason
    q, k, v = qkv()
    reason = why(q, k, torch.randn(2, 2, 64, 8, dtype=torch.float16).transpose(2, 3))
    assert "unit stride in the last dim" in reason and "v" in reason
    reason = why(q[0], k, v)
    assert "4-D" in reason and "(4, 8, 64)" in reason
    reason = why(q, k[:1], v[:1])
    assert "batch" in reason


def test_flash_attention_raw_api_raises_with_the_reason():
    import kernelforge.cuda as kcuda

    q = torch.randn(1, 2, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"kernelforge.cuda.flash_attention: the CUDA extension runs on CUDA tensors"):
        kcuda.flash_attention(q, q, q)
    with pytest.raises(ValueError, match=r"float16 or bfloat16, got q of torch.float32"):
        kcuda.flash_attention(q.float(), q.float(), q.float())


# ----------------------------------------------------------------------------- CPU: emulation
EMU_DIR = Path(__file__).resolve().parent / "attention_emu"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory) -> Path:
    return build_emulator(tmp_path_factory, EMU_DIR)


def _readable_in_place(t: torch.Tensor) -> bool:  # the binding's rule (attention_binding.cpp)
    strides = [0 if t.shape[d] == 1 else t.stride(d) for d in range(3)]
    return t.storage_offset() * t.element_size() % 16 == 0 and all(s >= 0 and s % 8 == 0 for s in strides)


def run_emulated(exe, q, k, v, scale, causal, wl, wr, copies="eager", order="rr", tmp_path=None):
    """What the binding + kernel compute, run by the emulator (q, k, v CPU tensors)."""
    B, H, Sq, D = q.shape
    if scale < 0:  # as the binding does: softmax(|scale| * (-q) . k)
        q, scale = -q, -scale
    header = [B, H, k.shape[1], Sq, k.shape[2], D, 1 if q.dtype == torch.float16 else 2, int(causal), wl, wr]
    blobs = []
    for t in (q, k, v):
        if not _readable_in_place(t):
            t = t.clone(memory_format=torch.contiguous_format)
        storage = t.untyped_storage()
        flat = torch.empty(0, dtype=t.dtype).set_(storage, 0, (storage.nbytes() // t.element_size(),))
        header += [t.storage_offset(), *[0 if t.shape[d] == 1 else t.stride(d) for d in range(3)], flat.numel()]
        blobs.append(flat.view(torch.int16).numpy().tobytes())
    header += [0] * (32 - len(header))
    inp, outp = tmp_path / "in.bin", tmp_path / "out.bin"
    inp.write_bytes(struct.pack("<32q", *header) + struct.pack("<d", scale) + b"".join(blobs))
    result = subprocess.run([str(exe), str(inp), str(outp), copies, order], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, f"emulator exit {result.returncode}: {result.stderr}"
    data = outp.read_bytes()
    n = B * H * Sq * D
    out = torch.frombuffer(bytearray(data[:2 * n]), dtype=torch.int16).view(q.dtype).view(B, H, Sq, D)
    lse = torch.frombuffer(bytearray(data[2 * n:]), dtype=torch.float32).view(B, H, Sq)
    return out, lse


# (B, H, Hkv, Sq, Sk, causal, window_left, window_right): around the tiles (BM = 128, BN = 64
# or 128), Sq != Sk both ways, rows and whole CTAs without visible keys, windows, GQA / MQA.
EMU_CASES = [
    (1, 2, 1, 1, 1, False, -1, -1),
    (2, 2, 2, 17, 17, True, -1, -1),
    (1, 2, 2, 17, 200, True, -1, -1),
    (1, 2, 1, 200, 17, True, -1, -1),      # rows < 183 see nothing: CTA 0 skips every tile
    (1, 4, 2, 130, 130, False, 20, 5),
    (1, 2, 2, 300, 200, False, 5, 0),      # rows < 100 see nothing
    (1, 8, 1, 128, 128, False, -1, -1),
]
EMU_FULL = [(d, dt) for d in (64, 128) for dt in DTYPES]  # every case; the other head dims take two


def _emu_params():
    for d in HEAD_DIMS:
        for dtype in DTYPES:
            cases = EMU_CASES if (d, dtype) in EMU_FULL else [EMU_CASES[1], EMU_CASES[5]]
            for case in cases:
                yield pytest.param(d, dtype, case, id=f"d{d}-{str(dtype)[6:]}-{'x'.join(map(str, case))}")


@pytest.mark.parametrize("d, dtype, case", list(_emu_params()))
def test_emulated_kernel_matches_reference(emulator, tmp_path, d, dtype, case):
    B, H, Hkv, Sq, Sk, causal, wl, wr = case
    q, k, v = make_inputs(B, H, Hkv, Sq, Sk, d, dtype, "cpu")
    scale = d ** -0.5
    out, lse = run_emulated(emulator, q, k, v, scale, causal, wl, wr, tmp_path=tmp_path)
    check(out, lse, q, k, v, scale, causal, wl, wr, f"emulated d={d} {dtype} {case}")


@pytest.mark.parametrize("copies, order", [("eager", "low"), ("eager", "high"), ("lazy", "rr"), ("lazy", "low"),
                                           ("lazy", "high")])
def test_emulated_kernel_under_every_schedule(emulator, tmp_path, copies, order):
    # cp.async landing at issue or only at the wait, warps run in lockstep or one far ahead of
    # the others: a missing barrier or wait shows as a reported race or a wrong result.
    q, k, v = make_inputs(1, 4, 2, 150, 260, 128, torch.bfloat16, "cpu")
    out, lse = run_emulated(emulator, q, k, v, 0.1, True, 90, -1, copies, order, tmp_path=tmp_path)
    check(out, lse, q, k, v, 0.1, True, 90, -1, f"{copies} copies, {order} order")
    q, k, v = make_inputs(1, 2, 2, 130, 70, 256, torch.float16, "cpu")
    out, lse = run_emulated(emulator, q, k, v, 0.07, False, -1, 3, copies, order, tmp_path=tmp_path)
    check(out, lse, q, k, v, 0.07, False, -1, 3, f"d=256 {copies} copies, {order} order")


@pytest.mark.parametrize("layout, d, dtype", [("bshd", 96, torch.float16), ("packed", 64, torch.bfloat16),
                                              ("broadcast", 32, torch.float16), ("unaligned", 128, torch.bfloat16)])
def test_emulated_kernel_reads_strided_views(emulator, tmp_path, layout, d, dtype):
    q, k, v = make_inputs(2, 4, 2, 140, 140, d, dtype, "cpu", layout)
    out, lse = run_emulated(emulator, q, k, v, d ** -0.5, True, -1, -1, tmp_path=tmp_path)
    check(out, lse, q, k, v, d ** -0.5, True, -1, -1, f"{layout} d={d}")


@pytest.mark.parametrize("scale", [-0.2, 0.0, 1e-35])
def test_emulated_kernel_takes_any_finite_scale(emulator, tmp_path, scale):
    # Negative: the binding negates q; zero and denormal: uniform over the visible keys.
    q, k, v = make_inputs(1, 2, 1, 100, 150, 64, torch.float16, "cpu")
    out, lse = run_emulated(emulator, q, k, v, scale, True, 40, -1, tmp_path=tmp_path)
    check(out, lse, q, k, v, scale, True, 40, -1, f"scale {scale}")


def test_shared_memory_table_matches_the_tiles(emulator):
    lines = subprocess.run([str(emulator), "--smem"], capture_output=True, text=True, check=True).stdout.split()
    assert dict(zip(map(int, lines[::2]), map(int, lines[1::2]))) == cuda_attention.SMEM_BYTES


# ----------------------------------------------------------------------------- GPU
# (B, H, Hkv, Sq, Sk, causal, window_left, window_right)
GPU_CASES = [
    (2, 4, 4, 1, 1, False, -1, -1),
    (2, 4, 2, 17, 17, True, -1, -1),
    (1, 8, 2, 128, 128, False, -1, -1),
    (1, 8, 1, 1000, 1000, True, -1, -1),
    (2, 4, 4, 1000, 128, False, -1, -1),
    (2, 4, 4, 1000, 128, True, -1, -1),     # rows < 872 see nothing
    (2, 8, 2, 128, 1000, True, -1, -1),
    (1, 2, 1, 4097, 4097, True, -1, -1),
    (1, 2, 2, 4097, 4097, False, -1, -1),
    (1, 4, 2, 1000, 1000, False, 100, 0),
    (1, 4, 4, 1000, 1000, True, 64, -1),
    (1, 2, 2, 300, 200, False, 5, 0),       # rows < 100 see nothing
    (1, 2, 1, 17, 1000, False, 3, 3),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "x".join(map(str, c)))
def test_matches_reference(case, d, dtype):
    B, H, Hkv, Sq, Sk, causal, wl, wr = case
    q, k, v = make_inputs(B, H, Hkv, Sq, Sk, d, dtype, "cuda")
    assert cuda_attention.why_not(q, k, v) is None
    scale = d ** -0.5
    out, lse = cuda_attention.attention_forward(q, k, v, scale, causal, wl, wr)
    check(out, lse, q, k, v, scale, causal, wl, wr, f"d={d} {dtype} {case}")
    again = cuda_attention.attention_forward(q, k, v, scale, causal, wl, wr)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse), "the forward must be bitwise deterministic"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", ["bshd", "packed", "broadcast", "unaligned"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
def test_strided_views(layout, d, dtype):
    q, k, v = make_inputs(2, 8, 2, 1000, 1000, d, dtype, "cuda", layout)
    assert not q.is_contiguous() or q.storage_offset() % 8 != 0
    for causal in (False, True):
        out, lse = cuda_attention.attention_forward(q, k, v, 0.1, causal, -1, -1)
        check(out, lse, q, k, v, 0.1, causal, -1, -1, f"{layout} d={d} causal={causal}")


@pytest.mark.gpu
@needs_cuda
def test_large_scale_and_empty_keys():
    q, k, v = make_inputs(1, 2, 2, 300, 300, 128, torch.bfloat16, "cuda")
    out, lse = cuda_attention.attention_forward(q, k, v, 3.0, True, -1, -1)  # peaked softmax, large scores
    check(out, lse, q, k, v, 3.0, True, -1, -1, "scale 3")
    k0 = torch.empty(1, 2, 0, 128, dtype=torch.bfloat16, device="cuda")
    out, lse = cuda_attention.attention_forward(q, k0, k0, 0.1, False, -1, -1)
    assert not out.any() and torch.isneginf(lse).all()


@pytest.mark.gpu
@needs_cuda
def test_raw_api_matches_sdpa():
    import kernelforge.cuda as kcuda

    q, k, v = make_inputs(2, 4, 4, 333, 333, 64, torch.float16, "cuda")
    for causal in (False, True):
        expected = F.scaled_dot_product_attention(q, k, v, scale=0.125, is_causal=causal)
        torch.testing.assert_close(kcuda.flash_attention(q, k, v, causal=causal), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@needs_cuda
def test_binding_messages_name_the_problem():
    q, k, v = make_inputs(1, 4, 2, 16, 16, 64, torch.float16, "cuda")
    ext = cuda_attention._extension()
    with pytest.raises(RuntimeError, match=r"kernelforge attention: q must be float16 or bfloat16, got Float"):
        ext.forward(q.float(), k.float(), v.float(), 0.1, False, -1, -1)
    with pytest.raises(RuntimeError, match=r"kernelforge attention: k must have dtype Half like q, got BFloat16"):
        ext.forward(q, k.bfloat16(), v, 0.1, False, -1, -1)
    with pytest.raises(RuntimeError, match=r"head_dim \(q.size\(3\)\) must be 32, 64, 96, 128 or 256, got 80"):
        x = torch.randn(1, 4, 16, 80, dtype=torch.float16, device="cuda")
        ext.forward(x, x, x, 0.1, False, -1, -1)
    with pytest.raises(RuntimeError, match=r"q heads \(4\) must be a multiple of the number of kv heads"):
        kv = torch.randn(1, 3, 16, 64, dtype=torch.float16, device="cuda")
        ext.forward(q, kv, kv, 0.1, False, -1, -1)
    with pytest.raises(RuntimeError, match=r"v must have the shape of k"):
        ext.forward(q, k, v[:, :, :8], 0.1, False, -1, -1)
    with pytest.raises(RuntimeError, match=r"k must be a CUDA tensor, got device cpu"):
        ext.forward(q, k.cpu(), v, 0.1, False, -1, -1)
    with pytest.raises(RuntimeError, match=r"unit stride in the last dim"):
        ext.forward(q, k, v.transpose(2, 3).contiguous().transpose(2, 3), 0.1, False, -1, -1)


@pytest.mark.gpu
@needs_cuda
def test_runs_on_the_current_stream_and_device():
    q, k, v = make_inputs(2, 4, 4, 500, 500, 128, torch.bfloat16, "cuda")
    expected = cuda_attention.attention_forward(q, k, v, 0.1, True, -1, -1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = cuda_attention.attention_forward(q, k, v, 0.1, True, -1, -1)
    stream.synchronize()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    if torch.cuda.device_count() > 1:
        q1, k1, v1 = (t.to("cuda:1") for t in (q, k, v))
        got = cuda_attention.attention_forward(q1, k1, v1, 0.1, True, -1, -1)
        assert got[0].device == q1.device
        assert torch.equal(got[0].cpu(), expected[0].cpu()) and torch.equal(got[1].cpu(), expected[1].cpu())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("causal", [False, True])
def test_speed_against_sdpa(causal, capsys):
    # A catastrophe detector, not a benchmark (kernelforge bench is): throughput at
    # B=4, H=16, S=4096, D=128, bf16, against torch's SDPA (FlashAttention-2 / cuDNN on H100).
    q, k, v = make_inputs(4, 16, 16, 4096, 4096, 128, torch.bfloat16, "cuda")
    flops = 4 * 4 * 16 * 4096 * 4096 * 128 * (0.5 if causal else 1.0)

    def timed(fn):
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[len(times) // 2]

    ours = timed(lambda: cuda_attention.attention_forward(q, k, v, 0.088, causal, -1, -1))
    theirs = timed(lambda: F.scaled_dot_product_attention(q, k, v, scale=0.088, is_causal=causal))
    with capsys.disabled():
        print(f"\nflash attention fwd bf16 d=128 causal={causal}: kernelforge {flops / ours / 1e12:.0f} TFLOP/s, "
              f"torch SDPA {flops / theirs / 1e12:.0f} TFLOP/s")
    assert ours <= 4 * theirs, f"{ours * 1e3:.2f} ms against SDPA's {theirs * 1e3:.2f} ms"
