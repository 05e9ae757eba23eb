"""torch.compile of the language model's loss on the GPU, static and dynamic shapes: torch 2.11's
Inductor fails on this graph under dynamic shapes (an assertion in its tiling analysis), passes with
static shapes or with `triton.coalesce_tiling_analysis` off; the cross-entropy of a projection alone
compiles either way. Dynamo turns shapes dynamic when one function sees a second shape, which is how
tests/models met it (the compile level's test now starts Dynamo afresh).

    python benchmarks/inductor_loss_probe.py
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from tests.models.test_transformer_models import randomize, tiny_lm

VARIANTS = ((None, {}), (True, {}), (True, {"triton.coalesce_tiling_analysis": False}))


def attempt(what: str, fn, *args) -> None:
    try:
        fn(*args).backward()
        print(what, "ok")
    except Exception as e:  # report the failure and go on to the next variant
        print(what, "FAILED", type(e).__name__, (str(e).splitlines() or [""])[0][:150])


def main() -> None:
    torch.manual_seed(0)
    model = randomize(tiny_lm()).cuda()
    for shape in [(3, 12), (2, 17), (4, 33)]:
        ids = torch.randint(0, 61, shape, device="cuda")
        for dynamic, options in VARIANTS:
            torch._dynamo.reset()
            m = copy.deepcopy(model)
            compiled = torch.compile(lambda i: m.compute_loss(i), dynamic=dynamic, options=options or None)
            attempt(f"LM loss {shape} {'dynamic' if dynamic else 'static'} {options}", compiled, ids)
    for rows, classes in [(33, 61), (34, 61), (33, 64), (1008, 256)]:
        for options in ({}, {"triton.coalesce_tiling_analysis": False}):
            torch._dynamo.reset()
            x = torch.randn(rows, 48, device="cuda", requires_grad=True)
            w = torch.randn(classes, 48, device="cuda", requires_grad=True)
            t = torch.randint(0, classes, (rows,), device="cuda")
            compiled = torch.compile(lambda x, w: F.cross_entropy((x @ w.t()).float(), t), options=options or None)
            attempt(f"loss alone {rows}x{classes} {options}", compiled, x, w)


if __name__ == "__main__":
    main()
