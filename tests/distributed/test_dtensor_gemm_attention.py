"""kernelforge's gemm, flash_attention, cross_entropy and fused_linear_cross_entropy on DTensors
(kernelforge.distributed.matmul_sharding): 2 CPU processes over gloo (tests/distributed/_harness.py),
float64 on the reference backend. Each accepted placement: the output against the op on the full
tensors, its placement (no gather), every input's gradient. Each refused one (row-parallel gemm
with an epilogue, a sequence dim, heads that do not split, a class dim, a "mean" of sharded rows):
torch redistributes and the result is still the unsharded op's."""
from __future__ import annotations

import pytest
import torch

from tests.distributed._harness import assert_passed, case_names, check, run_job, skip_without_gloo

pytestmark = skip_without_gloo


def _cases():
    """name -> case(mesh)."""
    import kernelforge as kf
    from torch.distributed.tensor import Partial, Replicate, Shard

    R, S, P = Replicate(), Shard, Partial()
    x = lambda *shape: torch.randn(*shape, dtype=torch.float64)  # noqa: E731
    cases = {}

    # ------------------------------------------------------------------ gemm
    def gemm_case(a_shape, b_shape, a_p, b_p, out_p, activation=None, bias=None, residual=None, grad=True):
        def case(mesh):
            tensors, placements = [x(*a_shape), x(*b_shape)], [a_p, b_p]
            for t in (bias, residual):
                if t is not None:
                    tensors.append(x(*t[0]))
                    placements.append(t[1])

            def fn(a, b, *rest):
                rest = list(rest)
                bias_t = rest.pop(0) if bias is not None else None
                residual_t = rest.pop(0) if residual is not None else None
                return kf.gemm(a, b, bias=bias_t, residual=residual_t, activation=activation)
            check(mesh, fn, tensors, placements, [out_p], grad=grad)
        return case

    epilogue = dict(activation="gelu", bias=((5,), R), residual=((4, 6, 5), R))
    cases["gemm-Replicate"] = gemm_case((4, 6, 8), (8, 5), R, R, R, **epilogue)
    cases["gemm-rows-Shard(0)"] = gemm_case((4, 6, 8), (8, 5), S(0), R, S(0), activation="gelu", bias=((5,), R),
                                            residual=((4, 6, 5), S(0)))
    cases["gemm-rows-Shard(M)-residual-broadcast"] = gemm_case((4, 6, 8), (8, 5), S(1), R, S(1), activation="silu",
                                                               residual=((6, 5), S(0)))
    cases["gemm-batched-b-Shard(0)"] = gemm_case((4, 6, 8), (4, 8, 5), S(0), S(0), S(0), activation="relu",
                                                 bias=((5,), R))
    cases["gemm-column-parallel"] = gemm_case((4, 6, 8), (8, 6), R, S(1), S(2), activation="silu",
                                              bias=((6,), S(0)), residual=((4, 6, 6), S(2)))
    cases["gemm-row-parallel-Partial"] = gemm_case((4, 6, 8), (8, 5), S(2), S(0), P)
    # refused: an epilogue on a partial sum; torch redistributes, the values are the unsharded op's
    cases["gemm-row-parallel-activation-refused"] = gemm_case((4, 6, 8), (8, 5), S(2), S(0), None, activation="gelu")
    cases["gemm-row-parallel-bias-refused"] = gemm_case((4, 6, 8), (8, 5), S(2), S(0), None, bias=((5,), R))
    cases["gemm-row-parallel-residual-refused"] = gemm_case((4, 6, 8), (8, 5), S(2), S(0), None,
                                                            residual=((4, 6, 5), R))
    cases["gemm-partial-key-per-activation"] = _gemm_cache_key
    cases["gemm-fp8-row-scaling-Shard(0)"] = lambda mesh: _gemm_fp8(mesh, "row", S(0))
    cases["gemm-fp8-tensor-scaling-refused"] = lambda mesh: _gemm_fp8(mesh, "tensor", None)

    # ------------------------------------------------------------------ attention
    def attention_case(q_p, out_p, heads=(4, 2), mask=None, causal=False, **kwargs):
        def case(mesh):
            tensors = [x(4, heads[0], 6, 8), x(4, heads[1], 6, 8), x(4, heads[1], 6, 8)]
            placements = [q_p] * 3
            if mask is not None:
                tensors.append(torch.rand(*mask[0]) > 0.3)
                placements.append(mask[1])
            fn = lambda q, k, v, m=None: kf.flash_attention(q, k, v, causal=causal, attn_mask=m)  # noqa: E731
            check(mesh, fn, tensors, placements, [out_p], **kwargs)
        return case

    cases["attention-Replicate"] = attention_case(R, R, causal=True)
    cases["attention-batch-Shard(0)"] = attention_case(S(0), S(0), causal=True)
    cases["attention-heads-Shard(1)-gqa"] = attention_case(S(1), S(1))
    cases["attention-batch-mask-Shard(0)"] = attention_case(S(0), S(0), mask=((4, 1, 6, 6), S(0)))
    cases["attention-heads-mask-Shard(1)"] = attention_case(S(1), S(1), mask=((1, 4, 6, 6), S(1)), causal=True)
    cases["attention-heads-mask-broadcast"] = attention_case(S(1), S(1), mask=((6, 6), R))
    # refused: 3 kv heads do not split over 2 ranks (q's 6 would, at the wrong group boundary); a
    # sequence dim. Redistributed: a mask sharded on its keys
    cases["attention-heads-gqa-uneven-refused"] = attention_case(S(1), None, heads=(6, 3))
    cases["attention-sequence-Shard(2)-refused"] = attention_case(S(2), None, causal=True)
    cases["attention-mask-keys-Shard(3)-redistributed"] = attention_case(S(0), S(0), mask=((4, 1, 6, 6), S(3)))
    cases["attention-lse-Shard(1)"] = _attention_lse
    cases["attention-cache_seqlens-Shard(0)"] = _attention_cache
    cases["attention-paged-batch-Shard(0)"] = lambda mesh: _attention_paged(mesh, 0)
    cases["attention-paged-heads-Shard(1)"] = lambda mesh: _attention_paged(mesh, 1)

    # ------------------------------------------------------------------ cross-entropy
    def ce_case(logits_shape, p, reduction, out_p, ignored=True):
        def case(mesh):
            logits = x(*logits_shape)
            target = torch.randint(0, logits_shape[1], (logits_shape[0], *logits_shape[2:]))
            if ignored:
                target[1] = -100  # a different count of targets on each rank
            fn = lambda z, t: kf.cross_entropy(z, t, reduction=reduction, label_smoothing=0.1)  # noqa: E731
            check(mesh, fn, [logits, target], [p, S(0) if p == S(0) else R], [out_p])
        return case

    cases["cross_entropy-none-Shard(0)"] = ce_case((8, 10), S(0), "none", S(0))
    cases["cross_entropy-none-3d-Shard(0)"] = ce_case((4, 10, 3), S(0), "none", S(0))
    cases["cross_entropy-sum-Shard(0)-Partial"] = ce_case((8, 10), S(0), "sum", P)
    cases["cross_entropy-mean-Shard(0)"] = ce_case((8, 10), S(0), "mean", None)
    cases["cross_entropy-class-Shard(1)-refused"] = ce_case((8, 10), S(1), "none", None)

    def flce_case(reduction, out_p, x_p=S(0)):
        def case(mesh):
            target = torch.randint(0, 10, (8,))
            target[1] = -100
            fn = lambda h, w, t, b: kf.fused_linear_cross_entropy(h, w, t, b, reduction=reduction)  # noqa: E731
            check(mesh, fn, [x(8, 6), x(10, 6), target, x(10)], [x_p, R, S(0) if x_p == S(0) else R, R], [out_p])
        return case

    cases["flce-none-Shard(0)"] = flce_case("none", S(0))
    cases["flce-sum-Shard(0)-Partial"] = flce_case("sum", P)
    cases["flce-mean-Shard(0)-refused"] = flce_case("mean", None)
    cases["flce-hidden-Shard(1)-refused"] = flce_case("none", None, x_p=S(1))
    return cases


def _gemm_cache_key(mesh):
    """Calls alike but for the activation: DTensor caches a rule's answer, and the activation decides
    whether row parallel is offered."""
    import kernelforge as kf
    from torch.distributed.tensor import Partial, Shard, distribute_tensor

    a_full, b_full = torch.randn(4, 8, dtype=torch.float64), torch.randn(8, 5, dtype=torch.float64)
    a, b = distribute_tensor(a_full, mesh, [Shard(1)]), distribute_tensor(b_full, mesh, [Shard(0)])
    for activation in (None, "gelu", None, "relu"):
        y = kf.gemm(a, b, activation=activation)
        assert (y.placements == (Partial(),)) == (activation is None), (activation, y.placements)
        torch.testing.assert_close(y.full_tensor(), kf.gemm(a_full, b_full, activation=activation))


def _gemm_fp8(mesh, scaling, out_p):
    import kernelforge as kf

    check(mesh, lambda a, b: kf.gemm(a, b, precision="fp8", fp8_scaling=scaling, out_dtype=torch.float64),
          [torch.randn(4, 6, 8, dtype=torch.float64), torch.randn(8, 5, dtype=torch.float64)],
          [torch.distributed.tensor.Shard(0), torch.distributed.tensor.Replicate()], [out_p], grad=False)


def _attention_lse(mesh):
    import kernelforge as kf
    from torch.distributed.tensor import Shard

    check(mesh, lambda q, k, v: kf.flash_attention(q, k, v, return_lse=True),
          [torch.randn(2, 4, 6, 8, dtype=torch.float64), torch.randn(2, 2, 6, 8, dtype=torch.float64),
           torch.randn(2, 2, 6, 8, dtype=torch.float64)], [Shard(1)] * 3, [Shard(1), Shard(1)], grad=False)


def _attention_cache(mesh):
    """A decode step on a KV cache: the lengths sharded with the batch."""
    import kernelforge as kf
    from torch.distributed.tensor import Shard

    check(mesh, lambda q, k, v, n: kf.flash_attention(q, k, v, causal=True, cache_seqlens=n),
          [torch.randn(4, 4, 1, 8, dtype=torch.float64), torch.randn(4, 2, 10, 8, dtype=torch.float64),
           torch.randn(4, 2, 10, 8, dtype=torch.float64), torch.tensor([3, 10, 1, 7])],
          [Shard(0)] * 4, [Shard(0)], grad=False)


def _attention_paged(mesh, dim):
    """A decode step on a paged cache: over the batch, the table and the lengths Shard(0) with q and
    the page pools Replicate (a rank's rows name pages anywhere); over the heads, q and the pools
    Shard(1), the table and the lengths Replicate."""
    import kernelforge as kf
    from torch.distributed.tensor import Replicate, Shard

    R = Replicate()
    table = torch.arange(12, dtype=torch.int32).flip(0).view(4, 3)  # pages 11..0, in reverse: not in order
    pool = lambda: torch.randn(12, 2, 4, 8, dtype=torch.float64)  # noqa: E731 (num_blocks, Hkv, page, D)
    placements = [Shard(0), R, R, Shard(0), Shard(0)] if dim == 0 else [Shard(1), Shard(1), Shard(1), R, R]
    check(mesh, lambda q, k, v, n, t: kf.flash_attention(q, k, v, causal=True, cache_seqlens=n, block_table=t),
          [torch.randn(4, 4, 1, 8, dtype=torch.float64), pool(), pool(), torch.tensor([3, 12, 0, 7]), table],
          placements, [Shard(dim)], grad=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory.mktemp("dtensor_gemm_attention"), _cases)


@pytest.mark.parametrize("name", case_names(_cases))
def test_dtensor_op(results, name):
    assert_passed(results, name)
