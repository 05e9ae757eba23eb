"""`kernelforge tune`: fill the cache of measured backend choices (kernelforge.tuning) ahead of time,
by running ops at a benchmark suite's shapes or an example model's forward and backward on the GPU.
Each first call at a new size bucket measures there and then; the runs themselves are not timed."""
from __future__ import annotations

from typing import Iterable, Optional, TextIO

import torch

from kernelforge import backends, tuning


_CUDA = torch.device("cuda")


def _count(device: torch.device) -> int:
    return len(tuning.entries(tuning.context_of(device)))


def fill_from_suites(names: Optional[list[str]], dtypes: Iterable[str], out: TextIO, device: torch.device = _CUDA,
                     quick: bool = False) -> int:
    """Run every shape of the suites (None: each suite of an op that opts in to measurement; quick:
    their quick shapes), forward and, where the suite has it, backward; returns how many cases
    failed (each reported)."""
    from kernelforge.bench.runner import DTYPES, SUITE_DTYPES, prepare_call
    from kernelforge.bench.suites import SUITES

    if names is None:
        names = [n for n, s in SUITES.items() if backends.tuned(s.registry_op or s.op)]
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise ValueError(f"no benchmark suite {unknown}; known: {sorted(SUITES)}")
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise ValueError(f"unknown dtype {bad}; expected some of {sorted(DTYPES)}")
    failures = 0
    for name in names:
        suite, before = SUITES[name], _count(device)
        direction = "fwd+bwd" if "fwd+bwd" in suite.directions else "fwd"
        for dtype_name in suite.dtypes or dtypes:
            for shape in suite.quick_shapes if quick else suite.shapes:
                try:
                    inputs = suite.make_inputs(shape, SUITE_DTYPES[dtype_name], device)
                    prepare_call(suite.kernelforge, inputs, direction)()
                except Exception as err:  # noqa: BLE001 - one case (too large here, say) does not stop the rest
                    failures += 1
                    out.write(f"  {name} {suite.label(shape)} {dtype_name}: failed: {type(err).__name__}: {err}\n")
                finally:
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        out.write(f"{name}: {_count(device) - before} new entries\n")
    return failures


def fill_from_models(names: list[str], dtypes: Iterable[str], out: TextIO, device: torch.device = _CUDA,
                     realistic: bool = True) -> int:
    """One forward and backward of each example model (the demo's sizes: realistic, or small) on
    kernelforge's ops, with nothing preferred (the models' own levels prefer a backend, which
    measures nothing); returns how many failed (each reported)."""
    from kernelforge.bench.runner import DTYPES
    from kernelforge.demo import workloads
    from kernelforge.models.levels import KERNELFORGE_KERNELS, TORCH_KERNELS

    wanted = {"lm": "LM forward", "vit": "ViT forward", "gnn": "GNN forward"}
    failures = 0
    for dtype_name in dtypes:
        if dtype_name not in DTYPES:
            raise ValueError(f"unknown dtype {dtype_name!r}; expected some of {sorted(DTYPES)}")
        chosen = [w for w in workloads(device, DTYPES[dtype_name], realistic=realistic)
                  if w.name in {wanted[n] for n in names}]
        for work in chosen:
            before, model = _count(device), work.model
            model.kernels.ops = KERNELFORGE_KERNELS
            try:
                # compute() is what the model's forward runs at its level, inside prefer_backend
                inputs = model.prepare(*work.inputs) if hasattr(model, "prepare") else work.inputs
                result = model.compute(*inputs)
                logits = result[0] if isinstance(result, tuple) else result
                logits.float().square().mean().backward()
                out.write(f"{work.name} ({dtype_name}): {_count(device) - before} new entries\n")
            except Exception as err:  # noqa: BLE001 - reported; the other models still run
                failures += 1
                out.write(f"{work.name} ({dtype_name}): failed: {type(err).__name__}: {err}\n")
            finally:
                model.kernels.ops = TORCH_KERNELS
                model.zero_grad(set_to_none=True)
        del chosen
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return failures
