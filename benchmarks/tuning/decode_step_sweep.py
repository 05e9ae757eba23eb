"""The kernels of a decoding step at its shapes, timed as the step runs them: one call per layer
over that layer's own weights (so the weights come from HBM, not L2), the layers' calls
captured in one CUDA graph and replayed (no host time, the launch gaps included).

GEMM: the few-row kernel (kernelforge/triton/gemm_kernels.py, gemv_kernel) at each config of
its grid next to F.linear (cuBLAS) and kf.gemm as it routes today. Attention: flash-decoding
over a static cache with cache_seqlens, at each key-range size and programs-per-SM, next to
SDPA over the masked whole cache (what the torch levels run).

    PYTHONPATH=. python benchmarks/tuning/decode_step_sweep.py [--rows 1,2,4,8] [--layers 16] [--top 5]

--tiny: a small bf16 weight and a float32 cache on the CPU, two layers, one point of each grid, the calls
timed one by one instead of from a CUDA graph (Triton through TRITON_INTERPRET=1): checks the
script runs.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import time

import torch
import torch.nn.functional as F

import kernelforge as kf
from kernelforge import _eager_plans
from kernelforge.triton import attention_decode as decode
from kernelforge.triton.gemm_kernels import gemv_kernel

# (N, K) of a Linear weight: the demo LM's decode step (dim 2048 x 16 layers, SwiGLU 5472,
# vocabulary 32000) and a Llama-3-8B-like one (4096, GQA 8 kv heads, 14336)
LINEAR_SHAPES = [(6144, 2048), (2048, 2048), (10944, 2048), (2048, 5472), (32000, 2048),
                 (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
GEMV_GRID = dict(BLOCK_N=(4, 8, 16, 32), BLOCK_K=(256, 512, 1024), num_warps=(4, 8), SPLIT_K=(1, 2, 4),
                 num_stages=(1, 3))
MAX_REGISTERS = 128  # float32 accumulators a thread: ROWS * BLOCK_N * BLOCK_K / threads
ATTENTION_GRID = dict(KEYS_PER_SPLIT=(64, 128, 256), PROGRAMS_PER_SM=(2, 4, 8), BLOCK_N=(32, 64))
# --tiny: a weight, a cache (position, rows) and grid points small enough for the interpreter
TINY_LINEAR_SHAPES, TINY_CACHES = [(64, 128)], [(40, 64)]
TINY_GEMV_GRID = dict(BLOCK_N=(8,), BLOCK_K=(64,), num_warps=(4,), SPLIT_K=(2,), num_stages=(1,))
TINY_ATTENTION_GRID = dict(KEYS_PER_SPLIT=(16,), PROGRAMS_PER_SM=(2,), BLOCK_N=(32,))


def graphed_us(calls, replays: int = 20) -> float:
    """Device time per call of `calls` (one per layer), captured in one CUDA graph."""
    for call in calls:  # compiles, autotunes, plans
        call()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / len(calls)


def gemv_call(x, w, out, config, split_buffers):
    M, K = x.shape
    N = w.shape[0]
    rows = max(1, 1 << (M - 1).bit_length())
    partials, arrivals = split_buffers
    grid = (triton_cdiv(N, config["BLOCK_N"]), config["SPLIT_K"])

    def call():
        gemv_kernel[grid](x, w.t(), out, out, out, out, partials, arrivals, M, N, K, x.stride(0), x.stride(1),
                          w.stride(1), w.stride(0), out.stride(0), out.stride(1), 0, 0, 0, 0, 1 << config["SPLIT_K"],
                          ROWS=rows, BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], SPLIT_K=config["SPLIT_K"],
                          EVEN_K=K % config["BLOCK_K"] == 0, COMPUTE="bf16", ACTIVATION="none", HAS_BIAS=False,
                          HAS_RESIDUAL=False, SAVE_PREACT=False, PRECISE=True, BF16_OUT=True,
                          num_warps=config["num_warps"], num_stages=config["num_stages"])
    return call


def called_us(calls) -> float:
    """--tiny's stand-in for graphed_us on the CPU: wall time per call, the calls one by one."""
    for call in calls:
        call()
    start = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - start) * 1e6 / len(calls)


def triton_cdiv(a, b):
    return -(-a // b)


def sweep_linear(rows_list, layers, top, bandwidth, tiny=False):
    device, dtype = "cpu" if tiny else "cuda", torch.bfloat16
    time_calls = called_us if tiny else graphed_us
    grid = TINY_GEMV_GRID if tiny else GEMV_GRID
    for (N, K), M in itertools.product(TINY_LINEAR_SHAPES if tiny else LINEAR_SHAPES, rows_list):
        count = max(2, min(layers, int(400e6 // (N * K * 2)) + 1))  # enough distinct weights to pass L2
        ws = [torch.randn(N, K, device=device, dtype=dtype) / K ** 0.5 for _ in range(count)]
        x = torch.randn(M, K, device=device, dtype=dtype)
        outs = [torch.empty(M, N, device=device, dtype=dtype) for _ in ws]
        split = (torch.empty(4 * M * N, device=device, dtype=torch.float32),
                 torch.zeros(N, device=device, dtype=torch.int32))
        limit = N * K * 2 / bandwidth * 1e6
        cublas = time_calls([lambda w=w, o=o: torch.mm(x, w.t(), out=o) for w, o in zip(ws, outs)])
        with kf.use_backend("triton"):
            today = time_calls([lambda w=w: kf.gemm(x, w.t()) for w in ws])
        want = x.float() @ ws[0].float().t()
        results = []
        for values in itertools.product(*grid.values()):
            config = dict(zip(grid, values))
            threads = 32 * config["num_warps"]
            rows = max(1, 1 << (M - 1).bit_length())
            if rows * config["BLOCK_N"] * config["BLOCK_K"] / threads > MAX_REGISTERS:
                continue
            if K // config["SPLIT_K"] < config["BLOCK_K"]:
                continue
            try:
                calls = [gemv_call(x, w, o, config, split) for w, o in zip(ws, outs)]
                calls[0]()
                torch.testing.assert_close(outs[0].float(), want, atol=2e-2, rtol=2e-2)
                results.append((time_calls(calls), values))
            except Exception as err:  # a config that does not compile or fit: reported
                print(f"   {config}: {type(err).__name__}: {str(err)[:160]}")
        results.sort()
        print(f"== M{M} N{N} K{K}: cuBLAS {cublas:.2f} us ({limit / cublas:.0%} of the copy bandwidth), "
              f"kf.gemm today {today:.2f} us ({cublas / today:.2f}x cuBLAS)", flush=True)
        for us, values in results[:top]:
            print(f"   {dict(zip(grid, values))}: {us:.2f} us, {limit / us:.0%} bw, {cublas / us:.2f}x cuBLAS",
                  flush=True)


def sweep_attention(layers, top, position: int, rows: int, tiny=False):
    B, H, D = (1, 2, 16) if tiny else (1, 16, 128)
    # float32 on the CPU: the Triton interpreter's bfloat16 dot is wrong
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    time_calls = called_us if tiny else graphed_us
    grid = TINY_ATTENTION_GRID if tiny else ATTENTION_GRID
    defaults = {name: getattr(decode, name) for name in grid}
    q = torch.randn(B, H, 1, D, device=device, dtype=dtype)
    caches = [(torch.randn(B, H, rows, D, device=device, dtype=dtype), torch.randn(B, H, rows, D, device=device,
                                                                                   dtype=dtype)) for _ in range(layers)]
    seqlens = torch.full((B,), position + 1, device=device, dtype=torch.int32)
    visible = (torch.arange(rows, device=device) <= position).view(1, 1, 1, rows)
    sdpa = time_calls([lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v, attn_mask=visible) for k, v in caches])
    filled = time_calls([lambda k=k, v=v: F.scaled_dot_product_attention(q, k[:, :, :position + 1],
                                                                         v[:, :, :position + 1]) for k, v in caches])
    want = F.scaled_dot_product_attention(q, *caches[0], attn_mask=visible)
    read = 2 * B * H * (position + 1) * D * 2
    print(f"== attention B{B} H{H} D{D} cache {rows} rows, {position + 1} filled: SDPA masked {sdpa:.2f} us, "
          f"SDPA over the filled rows {filled:.2f} us ({read / 1e3:.0f} KB a layer)", flush=True)
    results = []
    # on the CPU the default backend is the reference: the interpreter runs the Triton kernels
    with _eager_plans.disabled(), kf.use_backend("triton") if tiny else contextlib.nullcontext():
        for values in itertools.product(*grid.values()):
            for name, value in zip(grid, values):
                setattr(decode, name, value)
            try:
                out = kf.flash_attention(q, *caches[0], causal=True, cache_seqlens=seqlens)
                torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
                calls = [lambda k=k, v=v: kf.flash_attention(q, k, v, causal=True, cache_seqlens=seqlens)
                         for k, v in caches]
                results.append((time_calls(calls), values))
            except Exception as err:
                print(f"   {dict(zip(grid, values))}: {type(err).__name__}: {str(err)[:160]}")
        for name, value in defaults.items():
            setattr(decode, name, value)
    results.sort()
    for us, values in results[:top] + [r for r in results if r[1] == tuple(defaults.values())]:
        tag = " (current)" if values == tuple(defaults.values()) else ""
        print(f"   {dict(zip(grid, values))}: {us:.2f} us, {sdpa / us:.2f}x SDPA masked{tag}", flush=True)


def copy_bandwidth(device: str = "cuda", elements: int = 2 ** 29) -> float:
    """Bytes a second one read-and-write copy of `elements` bf16 (1 GB) moves, counted once each way."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = torch.empty(elements, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync()
    return 2 * x.numel() * 2 * 10 / (time.perf_counter() - start)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--skip", default="", help="linear / attention")
    parser.add_argument("--tiny", action="store_true", help="small sizes on the CPU: checks the script runs")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    layers, rows_list = (2, [1]) if args.tiny else (args.layers, [int(r) for r in args.rows.split(",")])
    bandwidth = copy_bandwidth("cpu", 2 ** 16) if args.tiny else copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; '% bw' = the weight's bytes at it over the time")
    if "attention" not in args.skip:
        for position, rows in TINY_CACHES if args.tiny else ((600, 768), (1500, 2048), (4000, 4096)):
            sweep_attention(layers, args.top, position, rows, args.tiny)
    if "linear" not in args.skip:
        sweep_linear(rows_list, layers, args.top, bandwidth, args.tiny)


if __name__ == "__main__":
    main()
