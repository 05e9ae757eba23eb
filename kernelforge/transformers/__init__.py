"""kernelforge for Hugging Face transformers models: kf.patch(model) dispatches here for a model
of a family listed in FAMILIES (it imports this module only then: kernelforge works without
transformers). Per instance: only this model's modules change (instance attributes; the classes
and every other model are left alone), the Parameters and the state_dict stay as they are, and a
second patch changes nothing.

    model = transformers.LlamaForCausalLM(config)
    report = kf.patch(model)        # Replacements: what changed, and .skipped: what did not, why

    with kernelforge.transformers.apply("llama"):   # or around from_pretrained: patched at exit
        model = transformers.AutoModelForCausalLM.from_pretrained(path)

What a family's patch does (kernelforge/transformers/decoders.py has each family's details):
    RMSNorm        forward -> kf.rms_norm (one kernel, float32 inside, rounded once; Gemma's 1 + w);
                   GPT-2's LayerNorms -> kf.layer_norm
    gated MLP      forward -> kf.gated_mlp (its backward makes act(gate) * up again instead of
                   keeping it: one (tokens x intermediate) tensor less a layer); with a bias or
                   hooks on a projection, down_proj(kf.swiglu(gate_proj(x), up_proj(x))); Phi-3's
                   packed gate_up_proj: down_proj(kf.swiglu(gate_up_proj(x))); GPT-2's:
                   c_proj(kf.gelu(c_fc(x)))
    attention      every family but GPT-2: transformers' forward with kf.rope for q and k (the
                   attention function is the one config._attn_implementation names in
                   transformers' registry); GPT-2 keeps transformers' attention. A model on
                   "sdpa" moves to "kernelforge" (kernelforge/transformers/attention.py: SDPA
                   whose causal mask stays implicit under torch.compile)
    causal-LM loss with labels, the head and the loss -> kf.fused_linear_cross_entropy over the
                   hidden states in training (the logits never exist whole; the output's logits
                   are None), Granite's logit scale and Gemma 2 / 3's softcap included
The Linear layers stay torch's (cuBLAS), the MLP's GEMMs too. The attention and the loss follow
transformers' forwards (the attention's is a replacement with kf.rope in it; the loss's wraps
transformers' own) as the versions in TESTED_VERSIONS have them; with another version they are not
patched, and the report says so. The experts of mixtures of experts (Mixtral, Qwen3-MoE) keep
transformers' grouped GEMMs, with kf.swiglu between them. BERT and ViT
(kernelforge/transformers/encoders.py): their LayerNorms, their MLP's GELU and BERT's residual + LayerNorm blocks (kf.add_layer_norm).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch

TESTED_VERSIONS = ("5.17", "5.24")  # transformers major.minor whose causal-LM forward the loss patch was tested on
# config.model_type values patched here (kernelforge/transformers/decoders.py: decoder-only causal
# LMs built like Llama, and GPT-2; encoders.py: BERT and ViT)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite", "olmo2", "phi3",
            "mixtral", "qwen3_moe", "gpt2", "bert", "vit")


def family(model: torch.nn.Module) -> Optional[str]:
    """The model's family if this module patches it (a transformers model of FAMILIES), else None.
    Reads the class's module name: no transformers import."""
    if not type(model).__module__.startswith("transformers."):
        return None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type if model_type in FAMILIES else None


def transformers_version_tested() -> tuple[bool, str]:
    """(whether the installed transformers is one of TESTED_VERSIONS, its version)."""
    import transformers

    version = transformers.__version__
    return ".".join(version.split(".")[:2]) in TESTED_VERSIONS, version


def patch(model: torch.nn.Module):
    """Patch a model of a supported family in place (see the module docstring); returns
    kernelforge.patching.Replacements."""
    name = family(model)
    if name is None:
        raise ValueError(f"kernelforge.transformers.patch: {type(model).__qualname__} is not a transformers model of "
                         f"a supported family {FAMILIES}")
    from kernelforge.transformers import decoders, encoders

    if name in encoders.ENCODERS:
        return encoders.patch(model, name)
    return decoders.patch(model, name)


@contextlib.contextmanager
def apply(*families: str):
    """A context manager: every transformers model of these families (config.model_type, one of
    FAMILIES; all of them when none is named) built inside the block is patched as patch() does
    when the block exits, so the loading inside it (from_pretrained's weights, its tying, its
    dtype and device moves) happens first. Yields a list it fills at exit with (model, report)
    pairs. Nothing outlives the block: models built after it, and other families, are untouched.

        with kernelforge.transformers.apply("llama") as patched:
            model = transformers.AutoModelForCausalLM.from_pretrained(path)
        # model is patched here; patched == [(model, Replacements([...]))]

    While the block runs, transformers' PreTrainedModel.post_init also records each model it
    finishes (every transformers model calls it at the end of __init__); the outermost ones of
    the families are patched (an inner LlamaModel inside a LlamaForCausalLM is patched with it)."""
    wanted = set(families or FAMILIES)
    unknown = wanted - set(FAMILIES)
    if unknown:
        raise ValueError(f"kernelforge.transformers.apply: unknown families {sorted(unknown)}; supported: {FAMILIES}")
    from transformers import PreTrainedModel

    built: list = []
    original = PreTrainedModel.__dict__["post_init"]

    def post_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if family(self) in wanted:
            built.append(weakref.ref(self))

    patched: list = []
    PreTrainedModel.post_init = post_init
    try:
        yield patched
    finally:
        PreTrainedModel.post_init = original
        models = [model for model in (ref() for ref in built) if model is not None]
        inner = {id(sub) for model in models for sub in model.modules() if sub is not model}
        patched.extend((model, patch(model)) for model in models if id(model) not in inner)


def register() -> None:
    """Register attn_implementation="kernelforge" with transformers (before from_pretrained with
    it): kernelforge.transformers.attention."""
    from kernelforge.transformers import attention

    attention.register()


__all__ = ["FAMILIES", "TESTED_VERSIONS", "apply", "family", "patch", "register", "transformers_version_tested"]
