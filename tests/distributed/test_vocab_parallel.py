"""Vocabulary-parallel cross-entropy and fused linear cross-entropy
(kernelforge.distributed.vocab_parallel): 2 CPU processes over gloo, each holding a slice of the
classes (even 8/8 and uneven 19/18 splits). Every case builds the full tensors on every rank (the
harness seeds them alike), runs the op on this rank's slice, and compares the loss with
F.cross_entropy (or kernelforge.fused_linear_cross_entropy, for softcap and z_loss) on the full
tensors in float64, and each rank's gradient with the full gradient's rows (x's: the whole of it).

One spawned job runs the default cases (the `cases` dict), another the slow sweep."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tests.distributed._harness import WORLD_SIZE, assert_passed, case_names, run_job, skip_without_gloo

pytestmark = skip_without_gloo

ROWS, HIDDEN = 10, 6
SPLITS = {16: (8, 8), 37: (19, 18)}  # vocabulary -> classes a rank (DTensor's split of 37 is 19 / 18)


# ----------------------------------------------------------------------------- helpers (in a rank)
def rank_slice(vocab: int) -> slice:
    sizes = SPLITS[vocab]
    rank = torch.distributed.get_rank()
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def targets(vocab: int, ignored=(), rows: int = ROWS) -> torch.Tensor:
    """Random global class ids with the first class (rank 0's) and the last (rank 1's) present."""
    t = torch.randint(0, vocab, (rows,))
    t[0], t[1] = 0, vocab - 1
    t[list(ignored)] = -100
    return t


def upstream(loss: torch.Tensor) -> torch.Tensor:
    """A random gradient for the loss (the same on every rank: the seed is shared)."""
    return torch.randn_like(loss)


def close(actual, expected, what: str, dtype=torch.float64) -> None:
    tol = {} if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(actual, expected, equal_nan=True, msg=lambda m: f"{what}: {m}", **tol)


def ce_case(vocab, reduction="mean", ignored=(), label_smoothing=0.0, dtype=torch.float64, give_start=True):
    def case(mesh):
        from kernelforge.distributed import vocab_parallel_cross_entropy

        full = torch.randn(ROWS, vocab, dtype=dtype, requires_grad=True)
        t = targets(vocab, ignored)
        part = rank_slice(vocab)
        local = full.detach()[:, part].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, t, vocab_start=part.start if give_start else None,
                                            reduction=reduction, ignore_index=-100, label_smoothing=label_smoothing)
        ref = F.cross_entropy(full, t, reduction=reduction, label_smoothing=label_smoothing)
        close(loss, ref, "loss", dtype)
        g = upstream(ref)
        loss.backward(g)
        ref.backward(g)
        close(local.grad, full.grad[:, part], "logits' gradient", dtype)
    return case


def fused_case(vocab, reduction="mean", ignored=(), label_smoothing=0.0, bias=True, softcap=None, z_loss=0.0,
               chunk_rows=4, dtype=torch.float64, give_start=True, batch=(2, 5)):
    """x (batch..., HIDDEN) against the full head: F.cross_entropy on x W^T + b, or
    kernelforge.fused_linear_cross_entropy where softcap / z_loss are set."""
    def case(mesh):
        import kernelforge as kf
        from kernelforge.distributed import vocab_parallel_fused_linear_cross_entropy

        x = torch.randn(*batch, HIDDEN, dtype=dtype, requires_grad=True)
        w = torch.randn(vocab, HIDDEN, dtype=dtype, requires_grad=True)
        b = torch.randn(vocab, dtype=dtype, requires_grad=True) if bias else None
        t = targets(vocab, ignored, rows=x[..., 0].numel()).view(batch)
        part = rank_slice(vocab)
        x_l = x.detach().clone().requires_grad_()
        w_l = w.detach()[part].clone().requires_grad_()
        b_l = b.detach()[part].clone().requires_grad_() if bias else None
        options = dict(reduction=reduction, label_smoothing=label_smoothing)
        loss = vocab_parallel_fused_linear_cross_entropy(x_l, w_l, t, b_l, vocab_start=part.start if give_start
                                                         else None, softcap=softcap, z_loss=z_loss,
                                                         chunk_rows=chunk_rows, **options)
        if softcap is None and not z_loss:
            logits = x @ w.T + (b if bias else 0)
            ref = F.cross_entropy(logits.reshape(-1, vocab), t.reshape(-1), **options)
            ref = ref.view(batch) if reduction == "none" else ref
        else:
            ref = kf.fused_linear_cross_entropy(x, w, t, b, softcap=softcap, z_loss=z_loss, **options)
        close(loss, ref.to(loss.dtype), "loss", dtype)
        g = upstream(ref)
        loss.backward(g)
        ref.backward(g)
        close(x_l.grad, x.grad, "x's gradient", dtype)
        close(w_l.grad, w.grad[part], "weight's gradient (this rank's rows)", dtype)
        if bias:
            close(b_l.grad, b.grad[part], "bias's gradient (this rank's rows)", dtype)
    return case


def logits_of_a_sharded_head(mesh):
    """vocab_parallel_logits: the whole logits from a Shard(0) weight and bias (37 classes, 19 / 18),
    and the gradients of x (summed over the ranks' classes) and of each rank's rows."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from kernelforge.distributed import vocab_parallel_logits

    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64, requires_grad=True)
    w = torch.randn(37, HIDDEN, dtype=torch.float64, requires_grad=True)
    b = torch.randn(37, dtype=torch.float64, requires_grad=True)
    x_l = x.detach().clone().requires_grad_()
    w_d = distribute_tensor(w.detach(), mesh, [Shard(0)]).requires_grad_()
    b_d = distribute_tensor(b.detach(), mesh, [Shard(0)]).requires_grad_()
    logits = vocab_parallel_logits(x_l, w_d, b_d)
    ref = x @ w.T + b
    close(logits, ref, "logits")
    g = upstream(ref)
    logits.backward(g)
    ref.backward(g)
    close(x_l.grad, x.grad, "x's gradient")
    close(w_d.grad.full_tensor(), w.grad, "weight's gradient")
    close(b_d.grad.full_tensor(), b.grad, "bias's gradient")


def dtensor_logits(mesh):
    """Shard(-1) logits of 37 classes (19 / 18): the mesh gives the group and vocab_start."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from kernelforge.distributed import vocab_parallel_cross_entropy

    full = torch.randn(ROWS, 37, dtype=torch.float64, requires_grad=True)
    t = targets(37, ignored=(3,))
    logits = distribute_tensor(full.detach(), mesh, [Shard(1)]).requires_grad_()
    assert logits.to_local().shape[1] == SPLITS[37][torch.distributed.get_rank()]
    loss = vocab_parallel_cross_entropy(logits, t, label_smoothing=0.1)
    ref = F.cross_entropy(full, t, label_smoothing=0.1)
    assert tuple(loss.placements) == (Replicate(),), loss.placements
    close(loss.full_tensor(), ref, "loss")
    loss.backward()
    ref.backward()
    assert tuple(logits.grad.placements) == (Shard(1),), logits.grad.placements
    close(logits.grad.full_tensor(), full.grad, "logits' gradient")


def dtensor_weight(mesh):
    """A Shard(0) weight and bias (37 classes), x a Replicate DTensor, reduction "none"."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from kernelforge.distributed import vocab_parallel_fused_linear_cross_entropy

    x = torch.randn(ROWS, HIDDEN, dtype=torch.float64, requires_grad=True)
    w = torch.randn(37, HIDDEN, dtype=torch.float64, requires_grad=True)
    b = torch.randn(37, dtype=torch.float64, requires_grad=True)
    t = targets(37, ignored=(4,))
    x_d = distribute_tensor(x.detach(), mesh, [Replicate()]).requires_grad_()
    w_d = distribute_tensor(w.detach(), mesh, [Shard(0)]).requires_grad_()
    b_d = distribute_tensor(b.detach(), mesh, [Shard(0)]).requires_grad_()
    loss = vocab_parallel_fused_linear_cross_entropy(x_d, w_d, t, b_d, reduction="none", chunk_rows=3)
    ref = F.cross_entropy(x @ w.T + b, t, reduction="none")
    close(loss.full_tensor(), ref, "loss")
    g = upstream(ref)
    loss.backward(distribute_tensor(g, mesh, [Replicate()]))
    ref.backward(g)
    close(x_d.grad.full_tensor(), x.grad, "x's gradient")
    close(w_d.grad.full_tensor(), w.grad, "weight's gradient")
    close(b_d.grad.full_tensor(), b.grad, "bias's gradient")


def gradient_accumulation(mesh):
    """Two micro-batches' backward into the same .grad (the mean path: gradients in the forward)."""
    from kernelforge.distributed import vocab_parallel_fused_linear_cross_entropy

    part = rank_slice(37)
    w = torch.randn(37, HIDDEN, dtype=torch.float64, requires_grad=True)
    w_l = w.detach()[part].clone().requires_grad_()
    for _ in range(2):
        x = torch.randn(ROWS, HIDDEN, dtype=torch.float64)
        t = targets(37, ignored=(2,))
        vocab_parallel_fused_linear_cross_entropy(x, w_l, t, chunk_rows=4).backward()
        F.cross_entropy(x @ w.T, t).backward()
    close(w_l.grad, w.grad[part], "accumulated weight gradient")


def group_of_one(mesh):
    """A group of one rank holding the whole vocabulary: the plain loss."""
    from kernelforge.distributed import vocab_parallel_cross_entropy, vocab_parallel_fused_linear_cross_entropy

    groups = [torch.distributed.new_group([r]) for r in range(WORLD_SIZE)]  # every rank creates every group
    mine = groups[torch.distributed.get_rank()]
    z = torch.randn(ROWS, 16, dtype=torch.float64)
    t = targets(16, ignored=(5,))
    close(vocab_parallel_cross_entropy(z, t, mine), F.cross_entropy(z, t), "loss (logits)")
    x, w = torch.randn(ROWS, HIDDEN, dtype=torch.float64), torch.randn(16, HIDDEN, dtype=torch.float64)
    close(vocab_parallel_fused_linear_cross_entropy(x, w, t, group=mine), F.cross_entropy(x @ w.T, t),
          "loss (fused)")


def under_autocast(mesh):
    """float32 x and weight under torch.autocast(bfloat16): as the one-process fused loss there (its
    GEMMs in bfloat16, the loss in float32), float32 gradients."""
    import kernelforge as kf
    from kernelforge.distributed import vocab_parallel_fused_linear_cross_entropy

    part = rank_slice(37)
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    w = torch.randn(37, HIDDEN, requires_grad=True)
    w_l = w.detach()[part].clone().requires_grad_()
    x_l = x.detach().clone().requires_grad_()
    t = targets(37, ignored=(3,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = vocab_parallel_fused_linear_cross_entropy(x_l, w_l, t, chunk_rows=4)
        ref = kf.fused_linear_cross_entropy(x, w, t)
    assert loss.dtype == ref.dtype == torch.float32
    loss.backward()
    ref.backward()
    assert x_l.grad.dtype == w_l.grad.dtype == torch.float32
    # the same bfloat16 products, summed in another order across the ranks
    torch.testing.assert_close(loss, ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x_l.grad, x.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w_l.grad, w.grad[part], rtol=2e-2, atol=2e-2)


def bad_inputs(mesh):
    from kernelforge.distributed import vocab_parallel_cross_entropy as ce
    from kernelforge.distributed import vocab_parallel_fused_linear_cross_entropy as fused

    part = rank_slice(16)
    z = torch.randn(ROWS, 8, dtype=torch.float64)
    x, w = torch.randn(ROWS, HIDDEN, dtype=torch.float64), torch.randn(8, HIDDEN, dtype=torch.float64)
    t = targets(16)
    expectations = [
        (ValueError, r"target must hold one GLOBAL class id a row, shape \(10,\), got \(9,\)",
         lambda: ce(z, t[:9], vocab_start=part.start)),
        (TypeError, "target must have dtype in .*got torch.float64", lambda: ce(z, t.double(), vocab_start=0)),
        (TypeError, "logits must have dtype", lambda: ce(t, t)),
        (ValueError, "reduction must be one of", lambda: ce(z, t, reduction="avg")),
        (ValueError, "label_smoothing must be a number in", lambda: ce(z, t, label_smoothing=1.5)),
        (ValueError, "vocab_start must be an int >= 0", lambda: ce(z, t, vocab_start=-1)),
        (ValueError, r"weight must be 2-D.*got shape \(8,\)", lambda: fused(x, w[:, 0], t)),
        (ValueError, r"x must be \(\.\.\., 6\)", lambda: fused(x[:, :5], w, t)),
        (TypeError, "must share a dtype, got x torch.float32, weight torch.float64", lambda: fused(x.float(), w, t)),
        (ValueError, r"bias must be \(8,\)", lambda: fused(x, w, t, torch.zeros(16, dtype=torch.float64))),
        (ValueError, r"target must hold one GLOBAL class id a row, shape \(10,\)", lambda: fused(x, w, t[None])),
        (ValueError, "softcap must be a number > 0", lambda: fused(x, w, t, softcap=-1.0)),
        (ValueError, "z_loss must be a number >= 0", lambda: fused(x, w, t, z_loss=-0.1)),
        (ValueError, "chunk_rows must be an int >= 1", lambda: fused(x, w, t, chunk_rows=0)),
        # both ranks claim classes [0, 8): every rank sees the overlap and raises, no rank hangs
        (ValueError, r"do not tile \[0, V\)", lambda: ce(z, t, vocab_start=0)),
        (ValueError, r"do not tile \[0, V\)", lambda: fused(x, w, t, vocab_start=0)),
    ]
    for error, message, call in expectations:
        with pytest.raises(error, match=message):
            call()


def cases() -> dict:
    """name -> case(mesh): the default run."""
    c = {}
    for reduction in ("mean", "sum", "none"):
        c[f"ce-{reduction}-uneven"] = ce_case(37, reduction, ignored=(2, 7))
        c[f"fused-{reduction}-uneven-bias-chunks"] = fused_case(37, reduction, ignored=(2, 7))
    c["ce-even-label_smoothing-vocab_start-gathered"] = ce_case(16, label_smoothing=0.2, give_start=False)
    c["ce-mean-every-row-ignored"] = ce_case(37, ignored=range(ROWS))
    c["ce-float32"] = ce_case(37, "none", ignored=(1,), label_smoothing=0.1, dtype=torch.float32)
    c["fused-mean-every-row-ignored"] = fused_case(16, ignored=range(ROWS), batch=(ROWS,))
    c["fused-label_smoothing-no-bias-vocab_start-gathered"] = fused_case(37, label_smoothing=0.3, bias=False,
                                                                        give_start=False)
    c["fused-softcap-z_loss-mean"] = fused_case(37, softcap=2.0, z_loss=1e-2, label_smoothing=0.1)
    c["fused-softcap-z_loss-none"] = fused_case(37, "none", softcap=2.0, z_loss=1e-2, ignored=(0,))
    c["fused-float32"] = fused_case(37, "sum", dtype=torch.float32, chunk_rows=3)
    c["fused-default-chunk_rows"] = fused_case(16, chunk_rows=None)
    c["dtensor-logits-Shard(1)"] = dtensor_logits
    c["logits-of-a-sharded-head"] = logits_of_a_sharded_head
    c["dtensor-weight-Shard(0)"] = dtensor_weight
    c["gradient-accumulation"] = gradient_accumulation
    c["group-of-one-rank"] = group_of_one
    c["under-autocast"] = under_autocast
    c["bad-inputs"] = bad_inputs
    return c


def slow_cases() -> dict:
    """Every combination of reduction, split, label smoothing, softcap / z_loss, chunking and bias."""
    c = {}
    for reduction, vocab, eps, (softcap, z_loss), chunk_rows, bias in itertools.product(
            ("mean", "sum", "none"), (16, 37), (0.0, 0.25), ((None, 0.0), (1.5, 1e-3)), (1, 4, 10), (True, False)):
        name = f"fused-{reduction}-V{vocab}-eps{eps}-softcap{softcap}-z{z_loss}-chunk{chunk_rows}-bias{bias}"
        c[name] = fused_case(vocab, reduction, ignored=(3,), label_smoothing=eps, bias=bias, softcap=softcap,
                             z_loss=z_loss, chunk_rows=chunk_rows)
    for reduction, vocab, eps in itertools.product(("mean", "sum", "none"), (16, 37), (0.0, 0.25)):
        c[f"ce-{reduction}-V{vocab}-eps{eps}"] = ce_case(vocab, reduction, ignored=(3, 4), label_smoothing=eps)
    return c


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory.mktemp("vocab_parallel"), cases)


@pytest.fixture(scope="module")
def slow_results(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory.mktemp("vocab_parallel_slow"), slow_cases)


@pytest.mark.parametrize("name", case_names(cases))
def test_vocab_parallel(results, name):
    assert_passed(results, name)


@pytest.mark.slow
def test_vocab_parallel_sweep(slow_results):
    failed = {name: failure for name, failure in slow_results.items() if failure is not None}
    assert len(slow_results) == len(slow_cases()) and not failed, "\n".join(failed.values())
