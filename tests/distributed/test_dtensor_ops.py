"""kernelforge's row-wise and elementwise ops on DTensors (kernelforge.distributed): 2 CPU processes
over gloo, a 1-D mesh of 2 ranks. Each case runs an op on DTensor inputs (sharded, replicated,
Partial) and checks the output against the op on the full tensors (the reference backend), the
output's placements (sharded as the input: no gather happened), and the gradients of every input,
the replicated parameters' (Partial, reduced by full_tensor()) included.

The process group starts once for the module: one spawned job runs every case and writes each
case's failure (or None) to a file; the tests read it, one test a case."""
from __future__ import annotations

import pytest
import torch

from tests.distributed._harness import assert_passed, WORLD_SIZE, case_names, run_job, skip_without_gloo
from tests.distributed._harness import check as _check

pytestmark = skip_without_gloo


# ----------------------------------------------------------------------------- the checks (in a rank)
def _cases():
    """name -> case(mesh): every op, several placements."""
    import kernelforge as kf
    from torch.distributed.tensor import Replicate, Shard

    R, S = Replicate(), Shard
    x = lambda *shape: torch.randn(*shape, dtype=torch.float64)  # noqa: E731
    cases = {}

    for name, fn in (("softmax", kf.softmax), ("log_softmax", kf.log_softmax)):
        for p in (S(0), S(1), R):
            cases[f"{name}-{p}"] = lambda mesh, fn=fn, p=p: _check(mesh, lambda t: fn(t, -1), [x(4, 5, 8)], [p], [p])
        cases[f"{name}-dim1-Shard(2)"] = lambda mesh, fn=fn: _check(mesh, lambda t: fn(t, 1), [x(4, 5, 8)], [S(2)],
                                                                     [S(2)])

    for name, fn in (("layer_norm", kf.layer_norm), ("rms_norm", kf.rms_norm)):
        for p in (S(0), S(1), R):
            cases[f"{name}-{p}"] = lambda mesh, fn=fn, p=p: _check(
                mesh, lambda t, w, b: fn(t, w, bias=b), [x(4, 6, 8), x(8), x(8)], [p, R, R], [p])
        cases[f"{name}-no-weight-{S(0)}"] = lambda mesh, fn=fn: _check(mesh, fn, [x(4, 8)], [S(0)], [S(0)])
    for name, fn in (("add_layer_norm", kf.add_layer_norm), ("add_rms_norm", kf.add_rms_norm)):
        for p in (S(0), S(1), R):
            cases[f"{name}-{p}"] = lambda mesh, fn=fn, p=p: _check(
                mesh, lambda t, r, w, b: fn(t, r, w, bias=b), [x(4, 6, 8), x(4, 6, 8), x(8), x(8)], [p, p, R, R],
                [p, p])

    for name, fn in (("gelu", kf.gelu), ("silu", kf.silu), ("relu", kf.relu)):
        for p in (S(0), S(2), R):
            cases[f"{name}-{p}"] = lambda mesh, fn=fn, p=p: _check(mesh, fn, [x(4, 3, 8)], [p], [p])
    for name, fn in (("bias_gelu", kf.bias_gelu), ("bias_silu", kf.bias_silu)):
        # the bias replicated, or sharded as x's last dim (a column-parallel linear's bias)
        for p, bias_p in ((S(0), R), (S(1), R), (S(2), S(0)), (R, R)):
            cases[f"{name}-{p}-bias-{bias_p}"] = lambda mesh, fn=fn, p=p, bias_p=bias_p: _check(
                mesh, fn, [x(4, 3, 8), x(8)], [p, bias_p], [p])

    for name, fn in (("swiglu", kf.swiglu), ("geglu", kf.geglu)):
        for p in (S(0), S(2), R):
            cases[f"{name}-{p}"] = lambda mesh, fn=fn, p=p: _check(mesh, fn, [x(4, 3, 8), x(4, 3, 8)], [p, p], [p])
        cases[f"{name}-packed-{S(1)}"] = lambda mesh, fn=fn: _check(mesh, fn, [x(4, 6, 8)], [S(1)], [S(1)])

    def rope_case(q_p, cos_shape, cos_p, unsqueeze_dim=1, position_ids=None):
        def case(mesh):
            shape_q, shape_k = ((4, 4, 6, 8), (4, 2, 6, 8)) if unsqueeze_dim == 1 else ((4, 6, 4, 8), (4, 6, 2, 8))
            fn = lambda q, k, c, s: kf.rope(q, k, c, s, position_ids, unsqueeze_dim)  # noqa: E731
            _check(mesh, fn, [x(*shape_q), x(*shape_k), x(*cos_shape), x(*cos_shape)], [q_p, q_p, cos_p, cos_p],
                   [q_p, q_p])
        return case

    cases["rope-batch-Shard(0)-cos-Shard(0)"] = rope_case(S(0), (4, 6, 8), S(0))
    cases["rope-batch-Shard(0)-cos-Replicate"] = rope_case(S(0), (6, 8), R)
    cases["rope-heads-Shard(1)-cos-Replicate"] = rope_case(S(1), (1, 6, 8), R)
    cases["rope-heads-Shard(2)-unsqueeze_dim2"] = rope_case(S(2), (4, 6, 4), R, unsqueeze_dim=2)
    cases["rope-Replicate"] = rope_case(R, (4, 6, 8), R)
    # position ids per batch element sharded with q and k, the (positions, rot) tables replicated
    cases["rope-position_ids-Shard(0)"] = lambda mesh: _check(
        mesh, lambda q, k, c, s, ids: kf.rope(q, k, c, s, ids), [x(4, 4, 6, 8), x(4, 2, 6, 8), x(10, 8), x(10, 8),
                                                                 torch.randint(0, 10, (4, 6))],
        [S(0), S(0), R, R, S(0)], [S(0), S(0)])
    # the same ids replicated while q and k are sharded over the batch; and q, k sharded over heads
    cases["rope-position_ids-Replicate-q-Shard(0)"] = lambda mesh: _check(
        mesh, lambda q, k, c, s, ids: kf.rope(q, k, c, s, ids), [x(4, 4, 6, 8), x(4, 2, 6, 8), x(10, 8), x(10, 8),
                                                                 torch.randint(0, 10, (4, 6))],
        [S(0), S(0), R, R, R], [S(0), S(0)])
    cases["rope-position_ids-heads-Shard(1)"] = lambda mesh: _check(
        mesh, lambda q, k, c, s, ids: kf.rope(q, k, c, s, ids), [x(4, 4, 6, 8), x(4, 2, 6, 8), x(10, 8), x(10, 8),
                                                                 torch.randint(0, 10, (4, 6))],
        [S(1), S(1), R, R, R], [S(1), S(1)])

    # x sharded on the reduced dim: redistributed first (the output is not sharded there), right values
    cases["softmax-Shard(reduced dim)"] = lambda mesh: _check(mesh, kf.softmax, [x(4, 8)], [S(1)], [None])
    cases["rms_norm-Shard(normalized dim)"] = lambda mesh: _check(
        mesh, kf.rms_norm, [x(4, 8), x(8)], [S(1), R], [None])
    cases["swiglu-packed-Shard(last dim)"] = lambda mesh: _check(mesh, kf.swiglu, [x(4, 8)], [S(1)], [None])
    cases["reduced-dim-output-placements"] = _reduced_dim_placements
    cases["rules-read-every-non-tensor-argument"] = _non_tensor_arguments
    cases["partial-input-is-reduced-first"] = _partial_input
    return cases


def _reduced_dim_placements(mesh):
    import kernelforge as kf
    from torch.distributed.tensor import Shard, distribute_tensor

    y = kf.softmax(distribute_tensor(torch.randn(4, 8), mesh, [Shard(1)]), -1)
    assert not any(p == Shard(1) for p in y.placements), y.placements


def _non_tensor_arguments(mesh):
    """Calls alike but for a non-tensor argument the rule reads get their own sharding (DTensor
    caches a rule's answer): normalized_shape (which dims may stay sharded), and whether the weight
    needs a gradient (how many tensors the norm's backward returns)."""
    import kernelforge as kf
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.randn(4, 6, 8, dtype=torch.float64)
    x = distribute_tensor(full, mesh, [Shard(1)])
    assert kf.layer_norm(x, normalized_shape=(8,)).placements == (Shard(1),)
    y = kf.layer_norm(x, normalized_shape=(6, 8))
    torch.testing.assert_close(y.full_tensor(), kf.layer_norm(full, normalized_shape=(6, 8)))
    for weight_needs_grad in (True, False, True):
        w = distribute_tensor(torch.randn(8, dtype=torch.float64), mesh, [Replicate()]).requires_grad_(weight_needs_grad)
        xg = x.detach().requires_grad_()
        kf.rms_norm(xg, w).sum().backward()
        assert xg.grad is not None and (w.grad is not None) == weight_needs_grad


def _partial_input(mesh):
    """A Partial x (a row-parallel matmul's unreduced output) into a norm and an activation: the
    results are those of the reduced x, never the sum of each rank's results."""
    import kernelforge as kf
    from torch.distributed.tensor import DTensor, Partial, Replicate

    rank = torch.distributed.get_rank()
    pieces = [torch.randn(4, 8, dtype=torch.float64) for _ in range(WORLD_SIZE)]  # the same on each rank
    x = DTensor.from_local(pieces[rank], mesh, [Partial()])
    w = DTensor.from_local(torch.randn(8, dtype=torch.float64), mesh, [Replicate()])
    total = sum(pieces)
    torch.testing.assert_close(kf.rms_norm(x, w).full_tensor(), kf.rms_norm(total, w.to_local()))
    torch.testing.assert_close(kf.gelu(x).full_tensor(), kf.gelu(total))
    torch.testing.assert_close(kf.softmax(x, -1).full_tensor(), kf.softmax(total, -1))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory.mktemp("dtensor"), _cases)


@pytest.mark.parametrize("name", case_names(_cases))
def test_dtensor_op(results, name):
    assert_passed(results, name)
