"""The example models at every optimization level: same weights, same outputs.

kernelforge.models holds three small models (a LanguageModel, a VisionTransformer, a
GraphNeuralNetwork). Each runs at one of five levels, switched with `model.set_level(...)` on the
same parameters:

    native       PyTorch eager
    torchscript  the native computation traced by torch.jit.trace
    compile      the native computation under torch.compile
    triton       kernelforge's ops on their Triton kernels (on a CPU: Triton's interpreter)
    cuda         kernelforge's CUDA C++ kernels (needs a GPU: on a CPU it says so and is skipped)

plus "fastest" (torch.compile with kernelforge's kernels where they win, CUDA graphs on a GPU) and
"reference" (kernelforge's ops on their PyTorch reference: what they run on a CPU). This script
runs each model at each level this machine has and checks its outputs against the reference
level's; for the language model it also checks the training loss and every gradient.

    python examples/04_optimization_levels.py                       # tiny models on the CPU, ~30 s
    python examples/04_optimization_levels.py --levels native,triton   # some levels only
"""
from __future__ import annotations

import argparse
import os
import time
import warnings

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton level on a CPU: Triton's interpreter
warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")

from kernelforge.models import (EXTRA_LEVELS, LEVELS, GraphNeuralNetwork, LanguageModel,  # noqa: E402
                                LevelUnavailableError, VisionTransformer, why_level_unavailable)

ALL_LEVELS = LEVELS + EXTRA_LEVELS  # native, torchscript, compile, triton, cuda, fastest, reference
TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # float32: the levels differ in the order of their sums only


def tiny_models(device) -> dict:
    """{name: (model, inputs of its forward)}: each model at a size that runs in milliseconds."""
    torch.manual_seed(0)
    lm = LanguageModel(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16)
    ids = torch.randint(0, 64, (2, 16))
    vit = VisionTransformer(image_size=16, patch_size=8, num_classes=5, dim=32, depth=2, heads=2)
    images = torch.randn(2, 3, 16, 16)
    gnn = GraphNeuralNetwork(node_features=8, hidden=16, num_classes=3, layers=2, aggregation="mean")
    nodes = torch.randn(20, 8)
    edge_index = torch.randint(0, 10, (2, 40)) + torch.tensor([[0] * 20 + [10] * 20] * 2)  # two graphs of 10 nodes
    graph_of_node = torch.arange(2).repeat_interleave(10)
    return {
        "LanguageModel": (lm.to(device).eval(), (ids.to(device),)),
        "VisionTransformer": (vit.to(device).eval(), (images.to(device),)),
        "GraphNeuralNetwork": (gnn.to(device).eval(), (nodes.to(device), edge_index.to(device),
                                                       graph_of_node.to(device))),
    }


def runnable_levels(levels, device) -> tuple[list, dict]:
    """(the levels that run here, {level: why not} for the rest)."""
    why_not = {level: why_level_unavailable(level, device) for level in levels}
    return [lv for lv in levels if why_not[lv] is None], {lv: why for lv, why in why_not.items() if why is not None}


def outputs_at_every_level(model, inputs, levels) -> dict:
    """{level: largest difference from the reference level's output} for the forward; asserts closeness."""
    model.set_level("reference")
    with torch.no_grad():
        expected = model(*inputs)
    differences = {}
    for level in levels:
        start = time.perf_counter()
        try:
            model.set_level(level)
        except LevelUnavailableError as err:  # a level this machine cannot run at all
            print(f"    {level:<12} skipped: {err}")
            continue
        with torch.no_grad():
            output = model(*inputs)
        torch.testing.assert_close(output, expected, **TOLERANCE)
        differences[level] = (output - expected).abs().max().item()
        print(f"    {level:<12} same output (largest difference {differences[level]:.1e}; "
              f"first call {time.perf_counter() - start:.2f} s, tracing or compiling included)")
    model.set_level("reference")
    return differences


def loss_and_gradients(model, ids) -> tuple[torch.Tensor, dict]:
    """The next-token loss and the gradient of every parameter at the model's level. Inside
    kernel_scope() the backward's ops run on the level's backend too, as a training step should."""
    model.zero_grad(set_to_none=True)
    with model.kernel_scope():
        loss = model.loss(ids)
        loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), gradients


def training_at_every_level(model, ids, levels) -> dict:
    """{level: largest gradient difference from the reference level's}; asserts loss and gradients close."""
    model.train().set_level("reference")
    expected_loss, expected_grads = loss_and_gradients(model, ids)
    differences = {}
    for level in levels:
        model.set_level(level)
        loss, grads = loss_and_gradients(model, ids)
        torch.testing.assert_close(loss, expected_loss, **TOLERANCE)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], **TOLERANCE, msg=lambda m: f"{level} {name}: {m}")
        differences[level] = max((grads[n] - expected_grads[n]).abs().max().item() for n in grads)
        print(f"    {level:<12} loss {loss.item():.6f} (reference {expected_loss.item():.6f}), "
              f"{len(grads)} gradients match (largest difference {differences[level]:.1e})")
    model.eval().set_level("reference")
    return differences


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--levels", default=",".join(ALL_LEVELS),
                        help=f"comma-separated, of {', '.join(ALL_LEVELS)} (default all)")
    parser.add_argument("--no-training", action="store_true", help="skip the language model's loss and gradients")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    levels, unavailable = runnable_levels(args.levels.split(","), device)
    for level, why in unavailable.items():
        print(f"level {level!r} does not run here: {why}")

    for name, (model, inputs) in tiny_models(device).items():
        print(f"\n{name}: forward at each level against the reference level")
        outputs_at_every_level(model, inputs, levels)
        if name == "LanguageModel" and not args.no_training:
            print(f"{name}: loss and gradients at each level against the reference level")
            training_at_every_level(model, inputs[0], levels)
    print("\nevery level that runs here gave the reference level's outputs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
