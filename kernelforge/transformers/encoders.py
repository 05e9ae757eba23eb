"""The patch of transformers' encoders, BERT and ViT (kernelforge.transformers dispatches here):
per instance, forwards of this model's LayerNorms (kf.layer_norm), its MLP's GELU (kf.gelu
between the Linear layers: BERT's <prefix>Intermediate, ViT's <prefix>MLP) and BERT's post-norm
residual blocks (<prefix>SelfOutput / <prefix>Output: LayerNorm(dropout(dense(h)) + input) by
kf.add_layer_norm, the sum and the norm in one kernel). The attention stays transformers' (its
registry's function), the heads and losses too.
"""
from __future__ import annotations

import functools

import torch

from kernelforge._replacements import Replacements
from kernelforge.ops.activations import gelu
from kernelforge.ops.norms import add_layer_norm
from kernelforge.transformers.common import GELU_APPROXIMATIONS, Patcher, layer_norm_forward

# config.model_type -> the class names' prefix
ENCODERS = {"bert": "Bert", "vit": "ViT"}


def _intermediate_forward(self, hidden_states: torch.Tensor, *, approximate: str) -> torch.Tensor:
    return gelu(self.dense(hidden_states), approximate=approximate)


def _mlp_forward(self, hidden_states: torch.Tensor, *, approximate: str) -> torch.Tensor:
    return self.fc2(gelu(self.fc1(hidden_states), approximate=approximate))


def _residual_norm_forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
    """LayerNorm(dropout(dense(h)) + input) with the sum and the norm in one kernel."""
    norm = self.LayerNorm
    h = self.dropout(self.dense(hidden_states))
    if not h.dtype == input_tensor.dtype == norm.weight.dtype:  # mixed dtypes: torch's promotion, as it was
        return norm(h + input_tensor)
    return add_layer_norm(h, input_tensor, norm.weight, norm.bias, norm.eps, normalized_shape=norm.normalized_shape)[0]


# an MLP block's class name after the prefix -> (its activation's attribute, the forward, what it does)
GELU_BLOCKS = {"Intermediate": ("intermediate_act_fn", _intermediate_forward, "kf.gelu(dense(x), approximate={!r})"),
               "MLP": ("activation_fn", _mlp_forward, "fc2(kf.gelu(fc1(x), approximate={!r}))")}


def patch(model: torch.nn.Module, model_type: str) -> Replacements:
    prefix = ENCODERS[model_type]
    patcher = Patcher()
    for name, module in model.named_modules():
        kind = type(module).__name__
        block = GELU_BLOCKS.get(kind[len(prefix):]) if kind.startswith(prefix) else None
        if type(module) is torch.nn.LayerNorm:
            patcher.take(name, module, layer_norm_forward, "forward -> kf.layer_norm")
        elif block is not None:
            attribute, forward, what = block
            activation = getattr(module, attribute)
            approximate = GELU_APPROXIMATIONS.get(type(activation).__name__)
            if approximate is None:
                patcher.skip(name, module, f"activation {type(activation).__name__}, not a GELU")
            else:
                patcher.take(name, module, functools.partial(forward, approximate=approximate),
                             f"forward -> {what.format(approximate)}")
        elif kind in (f"{prefix}SelfOutput", f"{prefix}Output") and type(getattr(module, "LayerNorm", None)) is \
                torch.nn.LayerNorm:
            norm = module.LayerNorm
            if norm._forward_hooks or norm._forward_pre_hooks:
                patcher.skip(name, module, "its LayerNorm has hooks")
            else:
                patcher.take(name, module, _residual_norm_forward,
                             "forward -> kf.add_layer_norm(dropout(dense(h)), input) (sum and norm in one kernel)")
    return patcher.report()


__all__ = ["ENCODERS", "patch"]
