"""Patching a model: `kf.patch` swaps a model's layers for kernelforge's, in place, and the model
computes what it did before (outputs and every gradient), on the very same Parameter objects.

Two models, both tiny and random (nothing is downloaded):
  - a torch.nn model: a TransformerEncoder and an MLP head (Linear layers with the activation
    fused into the GEMM, LayerNorm, MultiheadAttention); one attention layer kf.patch cannot take
    (dropout > 0) is left as it was, and the report says why
  - a Hugging Face transformers Llama built from a config: norms, MLPs, rotary embedding and the
    head + loss (fused, no logits) on kernelforge's ops

    python examples/05_patching.py
    python examples/05_patching.py --skip-transformers   # without the transformers package
"""
from __future__ import annotations

import argparse
import copy
import warnings

import torch

import kernelforge as kf

TOLERANCE = dict(rtol=1e-4, atol=1e-5)


class Classifier(torch.nn.Module):
    """A token classifier from torch.nn parts: an encoder, a pooling attention layer, an MLP head."""

    def __init__(self, dim: int = 32, heads: int = 4, classes: int = 5):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, activation="gelu", batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        # dropout on the attention weights: flash attention never forms them, so kf.patch leaves it
        self.pool = torch.nn.MultiheadAttention(dim, heads, dropout=0.1, batch_first=True)
        self.head = torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, dim), torch.nn.SiLU(),
                                        torch.nn.Linear(dim, classes))

    def forward(self, x):
        h = self.encoder(x)
        pooled, _ = self.pool(h[:, :1], h, h, need_weights=False)
        return self.head(pooled[:, 0])


def outputs_and_gradients(model, inputs: dict, output=lambda out: out) -> tuple[torch.Tensor, dict]:
    """The model's output and the gradient of every parameter (and of any input that asks for one)
    under a fixed upstream gradient."""
    model.zero_grad(set_to_none=True)
    result = output(model(**inputs))
    result.backward(torch.ones_like(result) if result.dim() == 0 else torch.linspace(-1, 1, result.numel())
                    .view_as(result))
    # by state_dict key: kf.patch keeps those (named_parameters() may name a shared Parameter anew)
    grads = {key: p.grad.clone() for key, p in model.state_dict(keep_vars=True).items()
             if isinstance(p, torch.nn.Parameter) and p.grad is not None}
    grads.update({f"input {k}": v.grad.clone() for k, v in inputs.items() if v.requires_grad})
    for value in inputs.values():
        value.grad = None
    return result.detach(), grads


def assert_same(label: str, before: tuple, after: tuple) -> None:
    (out_before, grads_before), (out_after, grads_after) = before, after
    torch.testing.assert_close(out_after, out_before, **TOLERANCE)
    assert grads_after.keys() == grads_before.keys(), "the same parameters get gradients"
    for name in grads_before:
        torch.testing.assert_close(grads_after[name], grads_before[name], **TOLERANCE, msg=lambda m: f"{name}: {m}")
    largest = max((grads_after[n] - grads_before[n]).abs().max().item() for n in grads_before)
    print(f"  {label}: same output (largest difference {(out_after - out_before).abs().max().item():.1e}) and "
          f"{len(grads_before)} gradients (largest difference {largest:.1e})")


def patch_and_report(model) -> list:
    """kf.patch(model), printing what it replaced and what it skipped (it also warns the skips).
    Returns kf.patch's result: a list of Replacement, with `.skipped`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # printed below instead
        replaced = kf.patch(model)
    for r in replaced:
        print(f"  {r.name or '(the model)'}: {r.old} -> {r.new}" + (f"  [{r.note}]" if r.note else ""))
    for s in replaced.skipped:
        print(f"  skipped {s.name} ({s.type}): {s.reason}")
    return replaced


def torch_nn_model() -> None:
    print("a torch.nn model")
    torch.manual_seed(0)
    model = Classifier().eval()  # eval: the pooling layer's dropout off, so outputs can be compared
    reference = copy.deepcopy(model)
    parameters_before, keys_before = {id(p) for p in model.parameters()}, list(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the patch: still the model's parameters
    inputs = {"x": torch.randn(3, 10, 32, requires_grad=True)}

    replaced = patch_and_report(model)
    assert {id(p) for p in model.parameters()} == parameters_before, "the very same Parameter objects"
    assert list(model.state_dict()) == keys_before, "the same state_dict keys: checkpoints load either way"
    assert_same("patched vs unpatched", outputs_and_gradients(reference, inputs), outputs_and_gradients(model, inputs))
    optimizer.step()  # moves the patched model's weights: they are the optimizer's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns the skipped layer again
        assert kf.patch(model) == [], "a second patch replaces nothing"
    print(f"  {len(replaced)} replacements, {len(replaced.skipped)} skipped; a second kf.patch returns []\n")


def tiny_llama(seed: int = 0):
    """A random LlamaForCausalLM from a small config: built locally, no download."""
    # transformers loads tqdm, which in a notebook without ipywidgets warns that it cannot draw bars
    warnings.filterwarnings("ignore", message="IProgress not found")
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                      max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def transformers_llama() -> None:
    print("a Hugging Face transformers Llama (random weights, tiny config)")
    model = tiny_llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 300, (2, 12))
    patch_and_report(model)

    # training: given labels, the patched model computes the head and loss fused (its logits are None)
    model.train(), reference.train()
    train_inputs = {"input_ids": ids, "labels": ids}
    assert_same("training loss", outputs_and_gradients(reference, train_inputs, lambda out: out.loss),
                outputs_and_gradients(model, train_inputs, lambda out: out.loss))
    # evaluation: the logits, as before
    model.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, **TOLERANCE)
    print("  eval logits: same as the unpatched model's")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-transformers", action="store_true", help="only the torch.nn model")
    args = parser.parse_args(argv)
    torch_nn_model()
    if not args.skip_transformers:
        transformers_llama()
    print("\nthe patched models computed what the unpatched ones did")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
