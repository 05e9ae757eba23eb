"""Attention on the CPU without the (queries x keys) score matrix.

`kf.cpu_fused_attention(q, k, v)` walks the keys in chunks with an online softmax (a running
maximum and a rescaled sum), so it holds (queries x chunk) scores per head at a time, never
(queries x keys). `kf.optimized_cpu_attention(q, k, v, chunk_size)` picks the chunk: memory
O(Sq * chunk). Both give SDPA's result. (`kf.flash_attention` runs this same path on the CPU,
with gradients, masks and every other option.)

This script checks both against `F.scaled_dot_product_attention`, then measures the memory
each one allocates while it runs: the textbook softmax(q k^T) v and SDPA's math backend make the
whole score matrix; the chunked versions grow with the chunk, not with the keys.

    python examples/06_cpu_attention.py                 # 1024 tokens, a few seconds
    python examples/06_cpu_attention.py --seq 4096      # the gap grows with the sequence
"""
from __future__ import annotations

import argparse
import weakref

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import kernelforge as kf
from kernelforge.bench import benchmark_kernel


class PeakMemory(TorchDispatchMode):
    """Counts the bytes of every tensor storage the ops inside create while it stays alive, and
    keeps the peak: what a call allocates on top of its inputs (the CPU allocator keeps no such
    statistics, as torch.cuda.max_memory_allocated does on a GPU). It sees the tensors ops
    return, not the scratch buffers inside one C++ kernel (SDPA's fused CPU kernel's own)."""

    def __init__(self, *inputs: torch.Tensor):
        super().__init__()
        self.live = {t.untyped_storage().data_ptr() for t in inputs}  # the inputs are not counted
        self.current = self.peak = 0

    def _freed(self, key: int, nbytes: int) -> None:
        self.live.discard(key)
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes and key not in self.live:  # a new storage (a view or an in-place result is not)
                self.live.add(key)
                self.current += nbytes
                self.peak = max(self.peak, self.current)
                weakref.finalize(tensor, self._freed, key, nbytes)
        return out


def textbook_attention(q, k, v, causal: bool = False):
    """softmax(q k^T / sqrt(d)) v with the whole (Sq x Sk) score matrix."""
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def sdpa_math(q, k, v, causal: bool = False):
    """SDPA's math backend (its reference path), which forms the score matrix too."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def implementations(chunks) -> dict:
    found = {"textbook softmax(qk^T)v": textbook_attention, "SDPA (math backend)": sdpa_math,
             "SDPA (default)": lambda q, k, v, causal=False: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
             "kf.cpu_fused_attention": lambda q, k, v, causal=False: kf.cpu_fused_attention(q, k, v, causal=causal)}
    for chunk in chunks:
        found[f"kf.optimized_cpu_attention, chunk {chunk}"] = (
            lambda q, k, v, causal=False, chunk=chunk: kf.optimized_cpu_attention(q, k, v, chunk, causal=causal))
    return found


def check_against_sdpa(q, k, v, chunks) -> None:
    for causal in (False, True):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        for name, fn in implementations(chunks).items():
            torch.testing.assert_close(fn(q, k, v, causal=causal), expected, rtol=1e-4, atol=1e-5)
    print(f"every implementation gives SDPA's output, causal and not ({len(implementations(chunks))} x 2 checks)")


def measure(q, k, v, chunks, repeat: int) -> dict:
    """{name: (peak MiB allocated during the call, median ms)}."""
    results = {}
    for name, fn in implementations(chunks).items():
        with PeakMemory(q, k, v) as memory:
            fn(q, k, v)
        results[name] = (memory.peak / 2**20, benchmark_kernel(fn, (q, k, v), warmup=1, repeat=repeat)["median_ms"])
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=1024, help="queries and keys (default 1024)")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--chunks", default="32,128", help="chunk sizes of optimized_cpu_attention")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs each (default 3)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.seq, args.head_dim) for _ in range(3))
    chunks = [int(c) for c in args.chunks.split(",")]

    check_against_sdpa(q, k, v, chunks)
    scores_mib = args.heads * args.seq * args.seq * 4 / 2**20
    print(f"\n{args.heads} heads x {args.seq} queries x {args.seq} keys: the score matrix is {scores_mib:.1f} MiB "
          f"(q, k, v: {q.nbytes / 2**20:.2f} MiB each)")
    print(f"  {'':<40} {'peak MiB':>9} {'median ms':>10}")
    for name, (peak_mib, ms) in measure(q, k, v, chunks, args.repeat).items():
        print(f"  {name:<40} {peak_mib:9.2f} {ms:10.2f}")
    print("the chunked versions hold about 2 x heads x seq x chunk floats at a time (a chunk's scores and their")
    print("exponentials) plus the output; cpu_fused_attention's chunk is 256 keys. SDPA's default CPU kernel")
    print("works in blocks too (its scratch buffers, inside one C++ kernel, are not counted); its math backend")
    print("and the textbook formula hold the whole score matrix")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
