"""A tour of kernelforge's ops, each checked against PyTorch, and of `kf.explain`.

Every op runs on each backend that can take its inputs (on a CPU: the pure-PyTorch reference,
and the Triton kernels through Triton's interpreter; on a GPU also the CUDA C++ kernels), and
every output is compared with what torch computes. `kf.explain` says which backend a call would
run on, and why the others could not.

    python examples/01_tour_of_ops.py                 # small shapes on the CPU, a few seconds
    python examples/01_tour_of_ops.py --device cuda   # the same on a GPU
"""
from __future__ import annotations

import argparse
import os
import warnings

import torch

if not torch.cuda.is_available():
    # Triton kernels take CPU tensors only through its interpreter, which is chosen when Triton is
    # first imported: set it before kernelforge loads Triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The interpreter computes masked-off lanes too (1/0 past a row's end); no result reads them.
warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")

import torch.nn.functional as F  # noqa: E402

import kernelforge as kf  # noqa: E402

BACKENDS = ("reference", "triton", "cuda")


def on_each_backend(fn, backends=BACKENDS) -> dict:
    """{backend: fn() run on it} for each backend; a backend that cannot take these inputs (or
    has no kernel for the op) maps to the reason, a string."""
    results = {}
    for backend in backends:
        try:
            with kf.use_backend(backend):
                results[backend] = fn()
        except kf.BackendUnsupportedError as err:
            results[backend] = str(err).split(" is forced but ", 1)[-1]
    return results


def check(name: str, results: dict, expected, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    """Each backend's result (a tensor or a tuple of them) against torch's, within float32 rounding."""
    for backend, got in results.items():
        if isinstance(got, str):
            print(f"    {backend:<9} {name}: not run, {got}")
            continue
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
        pairs = zip(got, expected) if isinstance(got, tuple) else [(got, expected)]
        error = max((g - e).abs().max().item() for g, e in pairs)
        print(f"    {backend:<9} {name}: matches torch (largest difference {error:.1e})")


def softmax_section(device) -> None:
    print("softmax / log_softmax (any dim, any layout; gradients through the same backend)")
    x = torch.randn(6, 50, 9, device=device, requires_grad=True)
    check("softmax(dim=1)", on_each_backend(lambda: kf.softmax(x, dim=1)), torch.softmax(x, dim=1))
    check("log_softmax", on_each_backend(lambda: kf.log_softmax(x)), torch.log_softmax(x, dim=-1))
    grad_out = torch.randn(6, 50, 9, device=device)
    (expected,) = torch.autograd.grad(torch.softmax(x, dim=1), x, grad_out)
    check("softmax gradient", on_each_backend(lambda: torch.autograd.grad(kf.softmax(x, dim=1), x, grad_out)[0]),
          expected)


def norms_section(device) -> None:
    print("norms: layer_norm, rms_norm (Gemma's offset too), add_rms_norm (residual add fused)")
    x, residual = torch.randn(2, 7, 64, device=device), torch.randn(2, 7, 64, device=device)
    weight, bias = torch.randn(64, device=device), torch.randn(64, device=device)
    check("layer_norm", on_each_backend(lambda: kf.layer_norm(x, weight, bias, eps=1e-5)),
          F.layer_norm(x, (64,), weight, bias, eps=1e-5))
    check("rms_norm", on_each_backend(lambda: kf.rms_norm(x, weight, eps=1e-6)), F.rms_norm(x, (64,), weight, 1e-6))
    check("rms_norm offset=1", on_each_backend(lambda: kf.rms_norm(x, weight, eps=1e-6, offset=1.0)),
          F.rms_norm(x, (64,), 1 + weight, 1e-6))
    summed = x + residual
    check("add_rms_norm", on_each_backend(lambda: kf.add_rms_norm(x, residual, weight, eps=1e-6)),
          (F.rms_norm(summed, (64,), weight, 1e-6), summed))


def activations_section(device) -> None:
    print("activations: gelu (erf and tanh), silu, bias + gelu fused, swiglu / geglu on [gate | up]")
    x, bias = torch.randn(5, 96, device=device), torch.randn(96, device=device)
    check("gelu", on_each_backend(lambda: kf.gelu(x)), F.gelu(x))
    check("gelu tanh", on_each_backend(lambda: kf.gelu(x, approximate="tanh")), F.gelu(x, approximate="tanh"))
    check("silu", on_each_backend(lambda: kf.silu(x)), F.silu(x))
    check("bias_gelu", on_each_backend(lambda: kf.bias_gelu(x, bias)), F.gelu(x + bias))
    gate, up = x.chunk(2, dim=-1)
    check("swiglu", on_each_backend(lambda: kf.swiglu(x)), F.silu(gate) * up)
    check("geglu", on_each_backend(lambda: kf.geglu(gate, up)), F.gelu(gate) * up)


def gemm_section(device) -> None:
    print("gemm with its epilogue fused: act(a @ b + bias) + residual, b a Linear weight read transposed")
    a, weight = torch.randn(3, 16, 48, device=device), torch.randn(40, 48, device=device) / 7
    bias, residual = torch.randn(40, device=device), torch.randn(3, 16, 40, device=device)
    check("gemm + bias + gelu_tanh + residual",
          on_each_backend(lambda: kf.gemm(a, weight.t(), bias=bias, activation="gelu_tanh", residual=residual)),
          F.gelu(F.linear(a, weight, bias), approximate="tanh") + residual)
    linear = kf.nn.Linear(48, 40, activation="silu").to(device)  # an nn.Linear (same state_dict) on kf.gemm
    check("kf.nn.Linear(activation='silu')", on_each_backend(lambda: linear(a)),
          F.silu(F.linear(a, linear.weight, linear.bias)))


def attention_section(device) -> None:
    print("flash_attention: grouped-query heads, causal, a boolean mask, a sliding window, a BlockMask")
    q = torch.randn(2, 4, 40, 16, device=device)
    k, v = torch.randn(2, 2, 40, 16, device=device), torch.randn(2, 2, 40, 16, device=device)  # 2 kv heads: GQA

    def sdpa(mask=None, causal=False):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)

    check("causal", on_each_backend(lambda: kf.flash_attention(q, k, v, causal=True)), sdpa(causal=True))
    keep = torch.rand(2, 1, 40, 40, device=device) > 0.3  # True = attend; broadcast over heads
    keep[..., 0] = True  # every query sees a key (a query that sees none gets zeros, SDPA's gets NaN)
    check("attn_mask", on_each_backend(lambda: kf.flash_attention(q, k, v, attn_mask=keep)), sdpa(keep))
    position = torch.arange(40, device=device)
    distance = position[:, None] - position[None, :]
    band = (distance >= 0) & (distance <= 8)  # each query sees itself and the 8 keys before it
    check("window=(8, 0)", on_each_backend(lambda: kf.flash_attention(q, k, v, window=(8, 0))), sdpa(band))
    block_mask = kf.sliding_window_block_mask(40, 40, 8, block_q=16, block_k=16, device=device)
    check("sliding_window_block_mask", on_each_backend(lambda: kf.flash_attention(q, k, v, block_mask=block_mask)),
          sdpa(band))

    print("flash_attention_varlen: sequences of 7, 0 and 13 tokens packed, no padding")
    lengths = [7, 0, 13]
    cu = torch.tensor([0, 7, 7, 20], device=device, dtype=torch.int32)  # cumulative offsets
    qp, kp, vp = (torch.randn(20, h, 16, device=device) for h in (4, 2, 2))
    # each sequence on its own, as a batch of one: what the packed call must give
    starts = [0, 7, 7]
    expected = torch.cat([F.scaled_dot_product_attention(*(t[s:s + n].transpose(0, 1)[None] for t in (qp, kp, vp)),
                                                         is_causal=True, enable_gqa=True)[0].transpose(0, 1)
                          for s, n in zip(starts, lengths) if n])
    check("causal, per sequence", on_each_backend(
        lambda: kf.flash_attention_varlen(qp, kp, vp, cu, cu, max_seqlen_q=13, max_seqlen_k=13, causal=True)),
        expected)

    print("flash_attention with a paged KV cache: one new token a sequence, keys in shuffled 4-slot pages")
    cache_k, cache_v = torch.randn(2, 2, 12, 16, device=device), torch.randn(2, 2, 12, 16, device=device)
    seqlens = torch.tensor([12, 5], device=device, dtype=torch.int32)
    table = torch.tensor([[4, 0, 2], [5, 1, 3]], device=device, dtype=torch.int32)  # sequence b's pages in order
    pool_k, pool_v = torch.zeros(6, 2, 4, 16, device=device), torch.zeros(6, 2, 4, 16, device=device)
    for b in range(2):
        for j, page in enumerate(table[b].tolist()):  # logical keys 4j..4j+3 of sequence b live in `page`
            pool_k[page], pool_v[page] = cache_k[b, :, 4 * j:4 * j + 4], cache_v[b, :, 4 * j:4 * j + 4]
    q1 = torch.randn(2, 4, 1, 16, device=device)
    expected = torch.cat([F.scaled_dot_product_attention(q1[b:b + 1], cache_k[b:b + 1, :, :n], cache_v[b:b + 1, :, :n],
                                                         enable_gqa=True) for b, n in enumerate(seqlens.tolist())])
    check("block_table", on_each_backend(lambda: kf.flash_attention(
        q1, pool_k, pool_v, cache_seqlens=seqlens, block_table=table)), expected)


def losses_section(device) -> None:
    print("cross_entropy, and the LM head + loss fused (fused_linear_cross_entropy: no logits tensor)")
    logits, target = torch.randn(12, 300, device=device), torch.randint(0, 300, (12,), device=device)
    target[3] = -100  # ignored, as in torch
    check("cross_entropy", on_each_backend(lambda: kf.cross_entropy(logits, target, label_smoothing=0.1)),
          F.cross_entropy(logits, target, label_smoothing=0.1))
    hidden = torch.randn(12, 32, device=device, requires_grad=True)
    head = torch.randn(300, 32, device=device, requires_grad=True)

    def loss_and_grads(loss_fn):
        loss = loss_fn()
        return (loss.detach(), *torch.autograd.grad(loss, (hidden, head)))

    expected = loss_and_grads(lambda: F.cross_entropy(hidden @ head.t(), target))
    check("fused_linear_cross_entropy (loss, grad hidden, grad weight)",
          on_each_backend(lambda: loss_and_grads(lambda: kf.fused_linear_cross_entropy(hidden, head, target))),
          expected)


def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rope_section(device) -> None:
    print("rope: rotary embedding of q and k in one kernel, as transformers' apply_rotary_pos_emb")
    q, k = torch.randn(2, 4, 10, 16, device=device), torch.randn(2, 2, 10, 16, device=device)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2, device=device) / 16)
    angles = torch.arange(10, device=device)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((angles, angles), -1).cos()[None], torch.cat((angles, angles), -1).sin()[None]  # (1, S, D)
    expected = tuple(t * cos[:, None] + rotate_half(t) * sin[:, None] for t in (q, k))
    check("rope(q, k)", on_each_backend(lambda: kf.rope(q, k, cos, sin)), expected)


# kf.explain takes a public function's name ("rms_norm", "silu", "flash_attention") or the name
# of the registry family that function runs through (the families share kernels and rules)
REGISTRY_NAMES = {"softmax / log_softmax": "softmax", "layer_norm / rms_norm / add_*_norm": "norms",
                  "gelu / silu / relu / bias_*": "activation", "swiglu / geglu": "gated_activation",
                  "gemm": "gemm", "flash_attention": "attention", "cross_entropy": "cross_entropy", "rope": "rope"}


def explain_section(device) -> None:
    print("kf.explain(op, *inputs): which backend runs these inputs and why")
    x = torch.randn(8, 64, device=device)
    print(kf.explain("softmax", x))
    print("  a float64 input (the Triton kernels take float32 / float16 / bfloat16):")
    print(kf.explain("softmax", x.double()))
    print("  inside kf.prefer_backend('triton') (a preference: falls back where Triton cannot run):")
    with kf.prefer_backend("triton"):
        print(kf.explain("rms_norm", x, torch.ones(64, device=device)))
    print("  the registry families behind the public names:")
    for functions, name in REGISTRY_NAMES.items():
        print(f"    {name!r:<20} {functions}")


SECTIONS = {"softmax": softmax_section, "norms": norms_section, "activations": activations_section,
            "gemm": gemm_section, "attention": attention_section, "losses": losses_section, "rope": rope_section,
            "explain": explain_section}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, of: " + ", ".join(SECTIONS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    for name in args.sections.split(","):
        SECTIONS[name](torch.device(args.device))
        print()
    print("every op matched PyTorch on every backend that ran it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
