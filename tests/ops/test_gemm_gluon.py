"""The warp-specialized Gluon GEMM (kernelforge/triton/gemm_gluon.py): on an sm_90 GPU, through
kf.gemm against the float64 oracle (outputs and gradients: the backward's plain GEMMs take it
too) at tile-edge and odd TMA-readable sizes, both layouts of b, every epilogue (bias, each
activation, residual, the saved pre-activation), e4m3 operands with both scalings and both
accumulation modes, with a check that it really ran; which calls its rule sends to it;
everywhere: it builds for sm_90a without spills, in the shared memory of one SM."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import HAS_CUDA
from tests.numerics import assert_matches_oracle
from tests.ops.test_gemm import check
from tests.ops.test_gemm_fp8 import dequantized, epilogue64, quantize

gemm_gluon = pytest.importorskip("kernelforge.triton.gemm_gluon")

ON_HOPPER = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU (wgmma)")
SM90_SHARED_BYTES = 227 * 1024  # the most one block may opt into on an H100 / H200

# these tests spy on or swap the launchers' Python, which a replayed eager plan does not run
pytestmark = pytest.mark.usefixtures("no_eager_plans")


@pytest.fixture
def gluon_calls(monkeypatch):
    calls = []
    run = gemm_gluon.Plan.__call__

    def counted(self, a, b, out, bias=None, residual=None, preact=None, scale_a=None, scale_b=None):
        tensors = dict(bias=bias, residual=residual, preact=preact, scale_a=scale_a, scale_b=scale_b)
        epilogue = sorted(k for k, v in tensors.items() if v is not None)
        if self.constexprs["ACTIVATION"] != "none":
            epilogue = sorted(epilogue + ["activation"])
        calls.append((tuple(a.shape), tuple(b.shape), *epilogue))
        return run(self, a, b, out, **tensors)

    monkeypatch.setattr(gemm_gluon.Plan, "__call__", counted)
    return calls


# (M, K, N): one tile, edges crossed in every dim (TMA zero-fills the loads past them and
# clips the store), a long odd K, rows not a multiple of anything
SHAPES = [(128, 64, 256), (200, 72, 264), (4097, 1000, 520), (33, 4104, 8)]


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_matches_oracle_on_both_layouts(dtype, shape, gluon_calls, monkeypatch):
    from kernelforge.triton import gemm as triton_gemm

    monkeypatch.setattr(triton_gemm, "USE_GLUON", True)
    M, K, N = shape
    weight = torch.randn(N, K, device="cuda", dtype=dtype) / K ** 0.5
    for label, b in (("b = Linear weight^T", weight.t()), ("b rows", weight.t().contiguous())):
        gluon_calls.clear()
        check("triton", "cuda", dtype, torch.randn(M, K, device="cuda", dtype=dtype), b, what=label)
        # forward, dA = grad @ b^T and dB = a^T @ grad: each operand order the kernel reads
        assert len(gluon_calls) == 3, (label, gluon_calls)


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("activation", [None, "gelu", "gelu_tanh", "silu", "relu"])
def test_epilogues_match_oracle(dtype, activation, gluon_calls, monkeypatch):
    # bias, activation and residual in every combination at a tile-edge size: the forward's
    # epilogue (with the pre-activation saved for act') and the backward's plain GEMMs
    from kernelforge.triton import gemm as triton_gemm

    monkeypatch.setattr(triton_gemm, "USE_GLUON", True)
    M, K, N = 200, 72, 264
    weight = torch.randn(N, K, device="cuda", dtype=dtype) / K ** 0.5
    bias = torch.randn(N, device="cuda", dtype=dtype)
    residual = torch.randn(M, N, device="cuda", dtype=dtype)
    for with_bias in (False, True):
        for with_residual in (False, True):
            if activation is None and not (with_bias or with_residual):
                continue  # the plain product: test_matches_oracle_on_both_layouts
            gluon_calls.clear()
            check("triton", "cuda", dtype, torch.randn(M, K, device="cuda", dtype=dtype), weight.t(),
                  bias if with_bias else None, activation, residual if with_residual else None,
                  what=f"bias={with_bias} residual={with_residual}")
            forward = gluon_calls[0]
            assert ("bias" in forward) == with_bias and ("residual" in forward) == with_residual, gluon_calls
            assert ("preact" in forward) == (activation is not None), gluon_calls
            assert len(gluon_calls) == 3, gluon_calls


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["row", "tensor"])
@pytest.mark.parametrize("fast_accum", [False, True], ids=["promoted", "fast-accum"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16-out", "fp32-out"])
def test_fp8_matches_oracle(scaling, fast_accum, out_dtype, gluon_calls, monkeypatch):
    # e4m3 operands given with their scales, a Linear weight read K-major; K = 1040 crosses
    # many K tiles, an odd count of them for the promoted loop's pairs (1040 / 128 -> 9), and
    # 656 an even count (6): both tails of its partials (K a multiple of 16: TMA-readable
    # rows). Against the float64 product of the e4m3 values: exact to the fp8 tensor cores'
    # in-tile error when promoted, and to their reduced precision over all of K with fast
    # accumulation (the Triton kernel's bounds, tests/ops/test_gemm_fp8.py).
    import kernelforge as kf
    from kernelforge.triton import gemm as triton_gemm

    monkeypatch.setattr(triton_gemm, "USE_GLUON", True)
    for M, K, N in ((200, 1040, 264), (4097, 656, 136)):
        a = torch.randn(M, K, device="cuda") * 3
        weight = torch.randn(N, K, device="cuda") / K ** 0.5
        qa, sa = quantize(a, scaling, -1)
        qw, sw = quantize(weight, scaling, -1)
        sb = sw.reshape(1, -1)
        bias = torch.randn(N, device="cuda", dtype=out_dtype)
        residual = torch.randn(M, N, device="cuda", dtype=out_dtype)
        product = torch.matmul(dequantized(qa, sa), dequantized(qw, sw).t())
        top = product.abs().max().item()
        for epilogue in ((None, None, None), (bias, "gelu_tanh", residual)):
            gluon_calls.clear()
            ours = kf.gemm(qa, qw.t(), bias=epilogue[0], activation=epilogue[1], residual=epilogue[2],
                           scale_a=sa, scale_b=sb, out_dtype=out_dtype, fp8_fast_accum=fast_accum)
            assert len(gluon_calls) == 1, gluon_calls
            oracle = epilogue64(product, *epilogue)
            label = f"{M}x{K}x{N} {scaling} fast={fast_accum} {out_dtype} act={epilogue[1]}"
            if epilogue[1] is None:
                bound = (1e-2 if fast_accum else 1e-3) * top
                error = (ours.double() - oracle).abs().max().item()
                assert error <= bound + 2 * torch.finfo(out_dtype).eps * top, f"{label}: {error} > {bound}"
            else:  # the epilogue's math on the same accumulator: as the Triton kernel's
                with kf.use_backend("triton"):
                    monkeypatch.setattr(triton_gemm, "USE_GLUON", False)
                    same = kf.gemm(qa, qw.t(), bias=bias, activation="gelu_tanh", residual=residual, scale_a=sa,
                                   scale_b=sb, out_dtype=out_dtype, fp8_fast_accum=fast_accum)
                    monkeypatch.setattr(triton_gemm, "USE_GLUON", True)
                assert_matches_oracle(ours, same, oracle, label, reduced=K, terms_scale=top)


@needs_hopper
@pytest.mark.gpu
def test_rule_takes_large_products_only(gluon_calls):
    import kernelforge as kf

    a = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    kf.gemm(a, w.t())
    assert len(gluon_calls) == 1  # 16 x 16 tiles of 128 x 256: every SM has one
    kf.gemm(a[:256], w.t())  # 2 x 16 tiles: the Triton kernels' smaller tiles fill the GPU better
    kf.gemm(a, w.t(), bias=torch.randn(4096, device="cuda", dtype=torch.bfloat16), activation="gelu")  # an epilogue
    kf.gemm(a.half(), w.t().half(), precision="bf16")  # fp16 inputs computed at bf16: rounded first
    kf.gemm(a.view(2, 1024, 512), w.t())  # a batch folded into rows goes; a batch of both does not
    kf.gemm(a.view(2, 1024, 512), w.t().expand(2, 512, 4096))
    kf.gemm(a, w.t(), residual=torch.randn(4096, device="cuda", dtype=torch.bfloat16))  # a broadcast residual
    kf.gemm(a, w.t(), precision="fp8")  # e4m3: 16 x 32 tiles of 128 x 128
    kf.gemm(a, w.t()[:, :96], precision="fp8")  # 16 x 1
    assert len(gluon_calls) == 4, gluon_calls
    # e4m3 goes from 3/4 of the SMs' worth of 128 x 128 tiles of 128 rows: 113 on 132 SMs
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wide = torch.randn(128 * math.ceil(0.85 * sms), 512, device="cuda", dtype=torch.bfloat16)
    kf.gemm(a[:128], wide.t(), precision="fp8")
    assert len(gluon_calls) == 5, gluon_calls
    kf.gemm(a[:16], wide.t(), precision="fp8")  # 16 rows: the Triton kernel's 64-row tiles
    kf.gemm(a[:128], wide[:128 * (sms // 2)].t(), precision="fp8")  # half the SMs' worth
    assert len(gluon_calls) == 5, gluon_calls


BUILDS = {  # compile_for_sm90's arguments: a M-major, b K-major, operand dtype, out dtype, epilogue, fast accum
    "bf16-a-rows-b-k-major": (False, True, "bfloat16", None, False, False),
    "bf16-a-rows-b-rows-epilogue": (False, False, "bfloat16", None, True, False),
    "fp16-a-m-major-b-k-major-epilogue": (True, True, "float16", None, True, False),
    "fp8-promoted-epilogue": (False, True, "float8_e4m3fn", "bfloat16", True, False),
    "fp8-promoted-fp32-out": (False, True, "float8_e4m3fn", "float32", False, False),
    "fp8-fast-accum": (False, True, "float8_e4m3fn", "bfloat16", False, True),
    "fp8-fast-accum-fp32-out-epilogue": (False, True, "float8_e4m3fn", "float32", True, True),
}
# Run by a fresh Python without TRITON_INTERPRET (and without tests.conftest, which sets it):
# under the interpreter the activations' @triton.jit functions, which the epilogue calls, are
# interpreter objects that a Gluon kernel cannot call. The GPU never runs so.
BUILD_SCRIPT = """
import json, sys, torch
from kernelforge.triton import gemm_gluon
builds = json.loads(sys.argv[1])
dtype = lambda name: None if name is None else getattr(torch, name)
print(json.dumps({name: gemm_gluon.compile_for_sm90(a_m, b_k, dtype(d), dtype(o), epilogue, fast)
                  for name, (a_m, b_k, d, o, epilogue, fast) in builds.items()}))
"""


@pytest.fixture(scope="module")
def sm90_builds() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", BUILD_SCRIPT, json.dumps(BUILDS)], env=env, capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("build", list(BUILDS))
def test_compiles_for_sm90_in_one_sm(build, sm90_builds):
    """Builds for sm_90a with this Triton (no GPU needed: ptxas ships with Triton), without
    spills, within the shared memory one program may take."""
    usage = sm90_builds[build]
    assert usage["spills"] == 0, usage
    assert usage["shared"] <= SM90_SHARED_BYTES, usage
