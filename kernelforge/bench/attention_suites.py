"""Attention suites: full attention against FlashAttention-2 and cuDNN (through SDPA) and
FlexAttention; a causal sliding window against FlexAttention on the same mask; block-sparse
patterns (a kernelforge BlockMask and Flex's, built from one mask function); decoding a few
query tokens against a KV cache, contiguous or paged; the shapes of models' attention (head
dim 64 at 197-2048 tokens, 128 at 4096).

`kernelforge.bench.suites` adds `attention_suites()` to its SUITES. Baselines that cannot
take a case (SDPA's CUDA backends on the CPU, FlexAttention's backward on the CPU, the math
SDPA where its score matrix would be too large) raise `Unavailable`: the runner leaves
their row out and notes why.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kernelforge as kf
from kernelforge.bench.roofline import Cost
from kernelforge.bench.suite_types import Suite, Unavailable
from kernelforge.reference.attention import Visibility

# The math SDPA ("torch eager") materializes the B*H*Sq*Sk scores, their softmax and, for the
# backward, their gradients: it runs only up to this many score elements (the CPU shapes;
# the GPU grid starts at 2^28).
EAGER_MAX_SCORES = 1 << 26


def _precision(dtype: torch.dtype) -> str:
    """The matmul ceiling a compute-bound attention is held against (the ceilings measure
    bf16, tf32 and fp8 on GPUs and fp32 on the CPU: fp16 and GPU fp32 rows get no %)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def _qkv(batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int, head_dim: int, dtype, device) -> tuple:
    return (torch.randn(batch, heads, q_len, head_dim, device=device, dtype=dtype),
            torch.randn(batch, kv_heads, kv_len, head_dim, device=device, dtype=dtype),
            torch.randn(batch, kv_heads, kv_len, head_dim, device=device, dtype=dtype))


def _attention_cost(pairs_per_head: float, batch: int, heads: int, seq: int, head_dim: int, dtype: torch.dtype,
                    direction: str) -> Cost:
    """Self-attention: q, k, v read and o written once forward; fwd+bwd adds dO read and
    dq, dk, dv written. Two matmuls (QK^T, PV) of 2*D flops per visible (query, key) pair
    forward, and the backward counted as 2.5x the forward (3.5x in all, as FlashAttention's benchmarks count it)."""
    tensors = 4 if direction == "fwd" else 8
    flops = 4 * batch * heads * pairs_per_head * head_dim * (1 if direction == "fwd" else 3.5)
    return Cost(tensors * batch * heads * seq * head_dim * dtype.itemsize, int(flops), _precision(dtype))


def _self_attention_inputs(shape, dtype: torch.dtype, device: torch.device) -> tuple:
    """(B, H, S, D, x): q, k, v of (B, H, S, D) and x (causal, or the window) passed along."""
    B, H, S, D, x = shape
    return (*_qkv(B, H, H, S, S, D, dtype, device), x)


def _support_args(inputs: tuple, direction: str, vis: Visibility) -> tuple[tuple, dict]:
    """What attention's support predicates take: (q, k, v), the visibility, the direction."""
    return inputs[:3], {"vis": vis, "backward": direction != "fwd"}


# ----------------------------------------------------------------------------- baselines
def _sdpa(backend: SDPBackend | None, name: str, needs_cuda: bool = False, max_scores: int | None = None):
    """F.scaled_dot_product_attention on one SDPA backend (None: PyTorch's own choice), GQA
    through enable_gqa; `causal` is SDPA's top-left causal mask (the same as ours for Sq == Sk)."""
    def run(q, k, v, causal=False):
        if needs_cuda and q.device.type != "cuda":
            raise Unavailable(f"SDPA's {name} backend runs on CUDA only")
        if max_scores is not None and q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] > max_scores:
            raise Unavailable(f"the math SDPA materializes the scores: left out above {max_scores} score elements")
        gqa = k.shape[1] != q.shape[1]
        try:
            if backend is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        except RuntimeError as err:
            if "No available kernel" not in str(err):
                raise
            raise Unavailable(f"SDPA's {name} backend has no kernel for {str(q.dtype)[6:]}, head dim "
                              f"{q.shape[-1]}{', GQA' if gqa else ''}") from err

    return run


@functools.lru_cache(maxsize=16)
def _flex_mask(q_len: int, kv_len: int, window: int | None, device: torch.device):
    """FlexAttention's BlockMask, built once per case (outside the timed call): causal, or
    causal with `window` keys before each query."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx >= 0) & (q_idx - kv_idx <= window)

    return create_block_mask(causal if window is None else sliding, None, None, q_len, kv_len, device=device)


def _flex(sliding: bool = False):
    """FlexAttention, compiled (eager FlexAttention materializes the scores): run(q, k, v, x)
    with x = causal (the attention suite) or, when `sliding`, the window of a causal window."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v, x):
        if q.device.type == "cpu" and q.requires_grad:
            raise Unavailable("FlexAttention has no backward on the CPU")
        window, causal = (x, True) if sliding else (None, x)
        return compiled(q, k, v, block_mask=_flex_mask(q.shape[2], k.shape[2], window, q.device) if causal else None)

    return run


def _full_baselines() -> dict:
    return {"sdpa flash": _sdpa(SDPBackend.FLASH_ATTENTION, "flash", needs_cuda=True),
            "sdpa cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION, "cuDNN", needs_cuda=True),
            "flex attention": _flex(),
            "torch eager": _sdpa(SDPBackend.MATH, "math", max_scores=EAGER_MAX_SCORES)}


# ----------------------------------------------------------------------------- sliding window
@functools.lru_cache(maxsize=16)
def _window_block_mask(seq: int, window: int, device: torch.device) -> kf.BlockMask:
    return kf.sliding_window_block_mask(seq, seq, window, causal=True, device=device)


def _window_cost(shape, dtype: torch.dtype, direction: str) -> Cost:
    # pairs counted as FlexAttention's benchmarks do (S * (window + 1): the band, the first `window`
    # queries' shorter rows not subtracted; 0.03% at S=8192, window 512)
    B, H, S, D, window = shape
    return _attention_cost(S * (window + 1), B, H, S, D, dtype, direction)


# ----------------------------------------------------------------------------- block-sparse patterns
def _local_global(b, h, q_idx, kv_idx):
    """Longformer-style: keys within 256 positions either side, plus 64 global tokens that
    every query sees and that see every key (not causal)."""
    near = (q_idx - kv_idx <= 256) & (kv_idx - q_idx <= 256)
    return near | (kv_idx < 64) | (q_idx < 64)


def _dilated(b, h, q_idx, kv_idx):
    """Causal, every second key among the 1024 before the query (itself included): no tile
    is full, so every tile of it takes element masking."""
    d = q_idx - kv_idx
    return (d >= 0) & (d <= 1024) & (d % 2 == 0)


BLOCK_PATTERNS = {"local_global": _local_global, "dilated": _dilated}


@functools.lru_cache(maxsize=16)
def _pattern_masks(pattern: str, seq: int, device: torch.device):
    """(kernelforge BlockMask, FlexAttention BlockMask, visible pairs) of one pattern, from the
    same mask function, each on its library's default tiles (ours 64 x 64, Flex's 128 x 128:
    Flex's kernels refuse 64 x 64), built once per case outside the timed calls."""
    fn = BLOCK_PATTERNS[pattern]
    ours = kf.BlockMask.from_mask_function(fn, seq, seq, device=device)
    pairs = int(ours.to_dense().sum().item())
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        flex = create_block_mask(fn, None, None, seq, seq, device=device)
    except Exception as err:  # noqa: BLE001 - the Flex row is left out with the reason
        flex = err
    return ours, flex, pairs


def _flex_pattern():
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v, pattern):
        if q.device.type == "cpu" and q.requires_grad:
            raise Unavailable("FlexAttention has no backward on the CPU")
        flex = _pattern_masks(pattern, q.shape[2], q.device)[1]
        if isinstance(flex, Exception):
            raise Unavailable(f"FlexAttention could not build the {pattern} mask: {flex}")
        return compiled(q, k, v, block_mask=flex)

    return run


def _pattern_cost(shape, dtype: torch.dtype, direction: str) -> Cost:
    B, H, S, D, pattern = shape
    return _attention_cost(_pattern_masks(pattern, S, torch.device("cpu"))[2], B, H, S, D, dtype, direction)


# ----------------------------------------------------------------------------- decode
def _in_cuda_graph(fn):
    """fn captured in a CUDA graph on its first call with given inputs, replayed after: the
    cost of one decode step in a generation loop run under CUDA graphs (torch.compile's
    mode="reduce-overhead", gpt-fast), where no host time is paid per call. One graph is kept,
    with the inputs it reads."""
    captured = {}

    def run(*inputs):
        if not isinstance(inputs[0], torch.Tensor) or inputs[0].device.type != "cuda":
            raise Unavailable("CUDA graphs capture CUDA work only")
        key = tuple(id(t) for t in inputs)
        if key not in captured:
            captured.clear()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up off the capture (compiles, autotunes)
                for _ in range(2):
                    fn(*inputs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn(*inputs)
            captured[key] = (graph, out, inputs)
        graph, out, _ = captured[key]
        graph.replay()
        return out

    return run


def _decode_cost(shape, dtype: torch.dtype, direction: str) -> Cost:
    # memory-bound: the K and V caches read once (q read and o written: negligible but
    # counted); flops 4*B*H*Sq*Sk*D recorded, not held against a ceiling
    B, H, H_kv, S_q, S_k, D = shape
    return Cost((2 * B * H_kv * S_k + 2 * B * H * S_q) * D * dtype.itemsize, 4 * B * H * S_q * S_k * D)


def _paged_inputs(shape, dtype: torch.dtype, device: torch.device) -> tuple:
    """(B, H, H_kv, Sk, D, page): one query token a sequence against a cache of Sk keys per
    sequence, as a paged pool in shuffled pages (page_size `page`) with its block table and
    lengths, and the same keys as a contiguous cache (B, H_kv, Sk, D): q, k_pool, v_pool, table,
    lengths, k, v. Every sequence full (the contiguous baselines need no mask)."""
    B, H, H_kv, S_k, D, page = shape
    q, k, v = _qkv(B, H, H_kv, 1, S_k, D, dtype, device)
    pages = S_k // page
    table = torch.randperm(B * pages, device=device).reshape(B, pages).to(torch.int32)
    pool_k = torch.empty(B * pages, H_kv, page, D, device=device, dtype=dtype)
    pool_v = torch.empty_like(pool_k)
    # key j of sequence b is slot j % page of page table[b, j // page]
    pool_k[table.long().flatten()] = k.reshape(B, H_kv, pages, page, D).transpose(1, 2).reshape(-1, H_kv, page, D)
    pool_v[table.long().flatten()] = v.reshape(B, H_kv, pages, page, D).transpose(1, 2).reshape(-1, H_kv, page, D)
    lengths = torch.full((B,), S_k, device=device, dtype=torch.int32)
    return q, pool_k, pool_v, table, lengths, k, v


def _paged_cost(shape, dtype: torch.dtype, direction: str) -> Cost:
    B, H, H_kv, S_k, D, page = shape
    return _decode_cost((B, H, H_kv, 1, S_k, D), dtype, direction)


def _paged_sdpa(name: str, backend: SDPBackend | None):
    """SDPA over the same keys kept contiguous (what an engine without paging reads)."""
    sdpa = _sdpa(backend, name, needs_cuda=backend is not None)

    def run(q, pool_k, pool_v, table, lengths, k, v):
        return sdpa(q, k, v)

    return run


def _self_attention_suite(op: str, shapes: list, quick_shapes: list) -> Suite:
    """(B, H, S, D, causal) self-attention against the full baselines (cuDNN, FlashAttention-2,
    Flex, eager)."""
    return Suite(
        op=op,
        registry_op="attention",
        shapes=shapes,
        quick_shapes=quick_shapes,
        make_inputs=_self_attention_inputs,
        # causal: half of the S*S pairs (the FlashAttention convention)
        cost=lambda shape, dtype, direction: _attention_cost(
            shape[2] ** 2 / (2 if shape[4] else 1), *shape[:4], dtype, direction),
        kernelforge=lambda q, k, v, causal: kf.flash_attention(q, k, v, causal=causal),
        baselines=_full_baselines,
        support_args=lambda inputs, direction: _support_args(inputs, direction, Visibility.of(inputs[3], None)),
        label=lambda shape: "x".join(map(str, shape[:4])) + (" causal" if shape[4] else ""),
    )


def attention_suites() -> dict:
    return {
        # (B, H, S, D, causal) of models' attention: ViT-B/16 at batch 64 (197 tokens), BERT-base
        # (32 x 512), a GPT-2-sized causal LM (8 x 1024), Llama-3.2-1B (4 x 2048, head dim 64),
        # and head dim 128 at 4 x 4096 (Llama-3-8B's)
        "attention_models": _self_attention_suite(
            "attention_models", shapes=[(64, 12, 197, 64, False), (32, 12, 512, 64, False), (8, 12, 1024, 64, True),
                                        (4, 32, 2048, 64, True), (4, 32, 4096, 128, True)],
            quick_shapes=[(2, 2, 37, 32, False), (1, 2, 64, 32, True)]),
        # (B, H, H_kv, Sk, D, page): one token a sequence against a paged KV cache (block table),
        # beside kernelforge and SDPA on the same keys kept contiguous
        "attention_paged": Suite(
            op="attention_paged",
            registry_op="attention",
            shapes=[(B, 32, 8, S_k, 128, page) for B in (1, 8, 32, 64) for S_k in (4096, 16384) for page in (16, 64)],
            quick_shapes=[(2, 4, 2, 128, 32, 16), (1, 4, 4, 96, 32, 32)],
            make_inputs=_paged_inputs,
            cost=_paged_cost,
            kernelforge=lambda q, pk, pv, table, lengths, k, v: kf.flash_attention(
                q, pk, pv, cache_seqlens=lengths, block_table=table),
            variants=lambda: {
                "kernelforge contiguous": lambda q, pk, pv, table, lengths, k, v: kf.flash_attention(
                    q, k, v, cache_seqlens=lengths),
                "kernelforge (CUDA graph)": _in_cuda_graph(lambda q, pk, pv, table, lengths, k, v: kf.flash_attention(
                    q, pk, pv, cache_seqlens=lengths, block_table=table))},
            baselines=lambda: {"sdpa contiguous": _paged_sdpa("default", None),
                               "sdpa flash contiguous": _paged_sdpa("flash", SDPBackend.FLASH_ATTENTION)},
            directions=("fwd",),
            support_args=lambda inputs, direction: _support_args(
                inputs, direction, Visibility(None, None, seqlens=inputs[4], block_table=inputs[3])),
            label=lambda shape: "B{} H{}/{} Sk{} D{} page{}".format(*shape),
        ),
        # (B, H, S, D, causal): the target shapes: B*S = 16384 tokens, 16 heads, head dims 128 and 64
        "attention": _self_attention_suite(
            "attention", shapes=[(B, 16, S, D, causal) for D in (128, 64) for B, S, causal in (
                (16, 1024, False), (4, 4096, False), (4, 4096, True), (2, 8192, False), (2, 8192, True))],
            quick_shapes=[(1, 2, 128, 64, True), (1, 2, 64, 32, False)]),
        # (B, H, S, D, window): causal, each query sees itself and the `window` keys before it
        "attention_window": Suite(
            op="attention_window",
            registry_op="attention",
            shapes=[(2, 16, 8192, 128, 512)],
            quick_shapes=[(1, 2, 256, 32, 64)],
            make_inputs=_self_attention_inputs,
            cost=_window_cost,
            kernelforge=lambda q, k, v, window: kf.flash_attention(q, k, v, causal=True, window=(window, 0)),
            # the same window as a BlockMask (built once per case, outside the timed call)
            variants=lambda: {"kernelforge block_mask": lambda q, k, v, window: kf.flash_attention(
                q, k, v, block_mask=_window_block_mask(q.shape[2], window, q.device))},
            baselines=lambda: {"flex attention": _flex(sliding=True)},
            support_args=lambda inputs, direction: _support_args(inputs, direction, Visibility(inputs[3], 0)),
            label=lambda shape: "x".join(map(str, shape[:4])) + f" window {shape[4]}",
        ),
        # (B, H, S, D, pattern): a BlockMask pattern of BLOCK_PATTERNS, ours against Flex's
        "attention_block_mask": Suite(
            op="attention_block_mask",
            registry_op="attention",
            shapes=[(2, 16, 8192, 128, pattern) for pattern in BLOCK_PATTERNS],
            quick_shapes=[(1, 2, 256, 32, "local_global")],
            make_inputs=_self_attention_inputs,
            cost=_pattern_cost,
            kernelforge=lambda q, k, v, pattern: kf.flash_attention(
                q, k, v, block_mask=_pattern_masks(pattern, q.shape[2], q.device)[0]),
            baselines=lambda: {"flex attention": _flex_pattern()},
            support_args=lambda inputs, direction: _support_args(inputs, direction, Visibility(
                None, None, block_mask=_pattern_masks(inputs[3], inputs[0].shape[2], inputs[0].device)[0])),
            label=lambda shape: "x".join(map(str, shape[:4])) + f" {shape[4]}",
        ),
        # (B, H, H_kv, Sq, Sk, D): Sq new tokens against a cache of Sk keys, forward only.
        # Not causal: for Sq > 1 the last Sq keys would be masked bottom-right, which SDPA's
        # top-left is_causal does not do; the cost differs by under Sq^2/2 pairs of Sq*Sk.
        "attention_decode": Suite(
            op="attention_decode",
            registry_op="attention",
            shapes=[(B, 32, H_kv, S_q, S_k, 128) for B in (1, 8) for H_kv in (8, 32) for S_q in (1, 4)
                    for S_k in (4096, 16384, 65536)],
            quick_shapes=[(1, 4, 2, 1, 256, 32), (2, 4, 4, 4, 128, 32)],
            make_inputs=lambda shape, dtype, device: _qkv(*shape, dtype, device),
            cost=_decode_cost,
            kernelforge=lambda q, k, v: kf.flash_attention(q, k, v),
            variants=lambda: {"kernelforge (CUDA graph)": _in_cuda_graph(kf.flash_attention)},
            baselines=lambda: {"sdpa": _sdpa(None, "default"),
                               "sdpa flash": _sdpa(SDPBackend.FLASH_ATTENTION, "flash", needs_cuda=True),
                               "sdpa (CUDA graph)": _in_cuda_graph(_sdpa(None, "default"))},
            directions=("fwd",),
            support_args=lambda inputs, direction: _support_args(inputs, direction, Visibility(None, None)),
            label=lambda shape: "B{} H{}/{} Sq{} Sk{} D{}".format(*shape),
        ),
    }
