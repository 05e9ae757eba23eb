"""kernelforge.patch(model): swap torch.nn layers of an existing model for kernelforge modules, in place.

    import torch
    import kernelforge as kf

    layer = torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dropout=0.0, activation="gelu",
                                             batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=6)
    replaced = kf.patch(model)          # in place; the same Parameter objects, the same state_dict
    for r in replaced:                  # Replacement(name, old, new, note)
        print(r.name, r.old, "->", r.new, r.note)
    print(replaced.skipped)             # what it found but could not take, and why (also warned)
    assert kf.patch(model) == []        # a second call has nothing left to replace

What is replaced (exact types only: a subclass may compute something else, so it is skipped and
reported, as is a module with hooks registered on it, which a new module would not carry):
    torch.nn.LayerNorm / RMSNorm       -> kernelforge.nn.LayerNorm / RMSNorm
    torch.nn.GELU / SiLU               -> kernelforge.nn.GELU / SiLU
    torch.nn.Linear                    -> kernelforge.nn.Linear; followed directly by GELU / SiLU / ReLU
                                          in an nn.Sequential, the activation is fused into the Linear
                                          (activation=...) and its place taken by nn.Identity
    torch.nn.MultiheadAttention        -> kernelforge.patching.MultiheadAttention (kernelforge.nn.Attention
                                          with MHA's batch_first and state_dict keys)
    nn.TransformerEncoderLayer / DecoderLayer: the functional activation (F.gelu, F.relu, F.silu or such
        a module) is fused into linear1 and layer.activation becomes nn.Identity; torch's fused fast
        paths, which would bypass the new modules in eval mode, are turned off.
A submodule with a method kernelforge_patch(self) -> Optional[str] patches itself: it is called
(its note is recorded, None meaning nothing changed) and not descended into.
A Hugging Face transformers model of a family kernelforge.transformers knows (FAMILIES) is
patched by it instead (norms, MLPs, rope, attention masks, the causal-LM loss; its Linear layers
stay cuBLAS's).
"""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from kernelforge import nn as kfnn
from kernelforge import transformers as kf_transformers
from kernelforge._replacements import Replacement, Replacements, Skipped

__all__ = ["MultiheadAttention", "Replacement", "Replacements", "Skipped", "patch"]


class MultiheadAttention(kfnn.Attention):
    """kernelforge.nn.Attention in torch.nn.MultiheadAttention's clothes: batch_first=False takes
    (seq, batch, embed) inputs (transposed around the batch-first attention, as torch's MHA does
    itself the other way round), forward takes MHA's positional arguments and defaults
    (need_weights=True: the weights are computed, unfused, as torch computes them), and
    state_dict() writes MHA's keys (in_proj_weight / in_proj_bias, in the same order), so
    checkpoints go both ways."""

    def __init__(self, embed_dim: int, num_heads: int, *, batch_first: bool = True, **kwargs):
        super().__init__(embed_dim, num_heads, **kwargs)
        self.batch_first = batch_first  # an instance attribute over Attention's class-level True
        self.register_state_dict_post_hook(MultiheadAttention._save_mha_keys)

    @staticmethod
    def _save_mha_keys(module, state_dict, prefix, local_metadata) -> None:
        # This module's entries are the last ones written; re-insert them renamed, in order, so
        # the keys and their order are those of torch.nn.MultiheadAttention.
        mine = []
        for key in reversed(state_dict):
            if not key.startswith(prefix):
                break
            mine.append(key)
        renames = {prefix + "in_proj.weight": prefix + "in_proj_weight",
                   prefix + "in_proj.bias": prefix + "in_proj_bias"}
        for key in reversed(mine):
            state_dict[renames.get(key, key)] = state_dict.pop(key)

    @classmethod
    def from_torch_shared(cls, mha: torch.nn.MultiheadAttention) -> "MultiheadAttention":
        """A MultiheadAttention holding `mha`'s own Parameter objects (no copy); `mha` must pass
        why_not(mha)."""
        w = mha.in_proj_weight
        mine = cls(mha.embed_dim, mha.num_heads, batch_first=mha.batch_first, bias=mha.in_proj_bias is not None,
                   dropout=mha.dropout, device="meta", dtype=w.dtype)
        mine.in_proj.weight, mine.in_proj.bias = mha.in_proj_weight, mha.in_proj_bias
        mine.out_proj.weight, mine.out_proj.bias = mha.out_proj.weight, mha.out_proj.bias
        return mine.train(mha.training)

    @staticmethod
    def why_not(mha: torch.nn.MultiheadAttention) -> Optional[str]:
        """Why kernelforge.nn.Attention cannot compute what `mha` computes, or None."""
        if not mha._qkv_same_embed_dim:
            return f"kdim/vdim ({mha.kdim}/{mha.vdim}) != embed_dim ({mha.embed_dim})"
        if mha.bias_k is not None:
            return "add_bias_kv=True"
        if mha.add_zero_attn:
            return "add_zero_attn=True"
        if mha.dropout > 0:
            # Attention raises in training mode with dropout (flash attention has none); the model
            # may be trained after patching, so it keeps torch's.
            return f"dropout={mha.dropout} (kernelforge flash attention has no attention dropout)"
        return None

    def forward(self, query: torch.Tensor, key: Optional[torch.Tensor] = None, value: Optional[torch.Tensor] = None,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False):
        """As torch.nn.MultiheadAttention.forward, its default need_weights=True included: then
        the weights are computed as torch computes them (flash attention never forms them), with
        the output, by torch's unfused attention; need_weights=False takes flash attention."""
        if is_causal and attn_mask is not None:
            # torch's MHA takes is_causal as a hint that attn_mask is the causal mask: the mask decides
            is_causal = False
        elif is_causal:
            seq = 0 if query.dim() == 2 or not self.batch_first else 1
            length, keys = query.shape[seq], (query if key is None else key).shape[seq]
            if length != keys:  # torch aligns causality to the top left, kernelforge to the bottom right
                raise ValueError(f"kernelforge.patching.MultiheadAttention: is_causal without attn_mask needs as "
                                 f"many queries as keys, got {length} and {keys}; pass the causal attn_mask")
            if need_weights:  # torch's weights path takes is_causal as a hint only: it needs the mask
                attn_mask = torch.ones(length, keys, dtype=torch.bool, device=query.device).triu(1)
        if need_weights:
            return self._forward_with_weights(query, key, value, key_padding_mask, attn_mask, average_attn_weights,
                                              is_causal)
        options = dict(attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=need_weights,
                       is_causal=is_causal, average_attn_weights=average_attn_weights)
        if self.batch_first or query.dim() != 3:  # unbatched (seq, embed) is the same either way
            return super().forward(query, key, value, **options)
        # Keep `key is query` / `key is value`: Attention picks its fused projections by identity.
        q = query.transpose(0, 1)
        k = q if key is query else None if key is None else key.transpose(0, 1)
        v = q if value is query else k if value is key else None if value is None else value.transpose(0, 1)
        out, weights = super().forward(q, k, v, **options)
        return out.transpose(0, 1), weights

    def _forward_with_weights(self, query, key, value, key_padding_mask, attn_mask, average_attn_weights, is_causal):
        """(out, weights) by torch.nn.functional.multi_head_attention_forward on this module's
        parameters: what torch.nn.MultiheadAttention returns when asked for the weights."""
        if key is None and value is None:  # kernelforge.nn.Attention's self-attention call
            key = value = query
        batch_first = self.batch_first and query.dim() == 3
        if batch_first:  # the functional form takes (seq, batch, embed)
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        out, weights = F.multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads, self.in_proj.weight, self.in_proj.bias, None, None,
            False, 0.0, self.out_proj.weight, self.out_proj.bias, training=self.training,
            key_padding_mask=key_padding_mask, need_weights=True, attn_mask=attn_mask,
            average_attn_weights=average_attn_weights, is_causal=is_causal)
        return (out.transpose(0, 1) if batch_first else out), weights

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.batch_first else ", batch_first=False")


# ----------------------------------------------------------------------------- the walk
def _type_name(obj) -> str:
    """torch.nn.LayerNorm rather than torch.nn.modules.normalization.LayerNorm, where it is that;
    for a function (a layer's functional activation), its name, e.g. torch.nn.functional.gelu."""
    if not isinstance(obj, (type, torch.nn.Module)):
        name = getattr(obj, "__name__", type(obj).__name__)
        return f"torch.nn.functional.{name}" if getattr(F, name, None) is obj else f"{obj.__module__}.{name}"
    cls = obj if isinstance(obj, type) else type(obj)
    for public, namespace in (("torch.nn", torch.nn), ("kernelforge.nn", kfnn)):
        if getattr(namespace, cls.__name__, None) is cls:
            return f"{public}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _has_hooks(module: torch.nn.Module) -> bool:
    return any(getattr(module, attr, None) for attr in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
        "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"))


def _is_kernelforge(module: torch.nn.Module) -> bool:
    # kernelforge's own modules are what patch() produces; it neither replaces nor enters them.
    return type(module).__module__.startswith(("kernelforge.nn.", __name__))


def _meta_params(new: torch.nn.Module, old: torch.nn.Module, names=("weight", "bias")) -> torch.nn.Module:
    # `new` was built on the meta device; give it `old`'s Parameter objects (or None).
    for name in names:
        setattr(new, name, getattr(old, name, None))
    return new.train(old.training)


def _layer_norm(m):
    return _meta_params(kfnn.LayerNorm(m.normalized_shape, m.eps, m.elementwise_affine, m.bias is not None,
                                       device="meta"), m), "kernelforge layer_norm"


def _rms_norm(m):
    return _meta_params(kfnn.RMSNorm(m.normalized_shape, m.eps, m.elementwise_affine, device="meta"), m,
                        ("weight",)), "kernelforge rms_norm"


def _gelu(m):
    return kfnn.GELU(m.approximate).train(m.training), f"kernelforge gelu (approximate={m.approximate!r})"


def _silu(m):
    return kfnn.SiLU().train(m.training), "kernelforge silu"


def _linear(m):
    return kfnn.Linear.from_torch(m).train(m.training), "kernelforge gemm"


def _mha(m):
    layout = "" if m.batch_first else "; (seq, batch, embed) inputs transposed to batch first"
    return (MultiheadAttention.from_torch_shared(m),
            f"kernelforge flash_attention, in_proj / out_proj parameters shared{layout}")


# exact type -> (why it cannot be replaced or None, build the replacement -> (module, note))
_SWAPS: dict[type, tuple[Callable, Callable]] = {
    torch.nn.LayerNorm: (lambda m: None, _layer_norm),
    torch.nn.RMSNorm: (lambda m: None, _rms_norm),
    torch.nn.GELU: (lambda m: None, _gelu),
    # kernelforge.nn.SiLU's backward needs its input, which an in-place SiLU overwrites.
    torch.nn.SiLU: (lambda m: "inplace=True (kernelforge.nn.SiLU does not write into its input)" if m.inplace
                    else None, _silu),
    torch.nn.Linear: (lambda m: None, _linear),
    torch.nn.MultiheadAttention: (MultiheadAttention.why_not, _mha),
}


def _fusable_activation(act) -> Optional[str]:
    """kernelforge.nn.Linear's activation name for an activation module or function that computes
    exactly that, else None."""
    if type(act) is torch.nn.GELU and not _has_hooks(act):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    if type(act) in (torch.nn.SiLU, torch.nn.ReLU) and not _has_hooks(act):
        # In place or not: the Linear's output it would overwrite is nobody else's.
        return "silu" if type(act) is torch.nn.SiLU else "relu"
    return {F.gelu: "gelu", F.relu: "relu", F.silu: "silu"}.get(act)


class _Patcher:
    def __init__(self, model: torch.nn.Module):
        # How many places hold each module: one registered twice is replaced by one new module,
        # and a Linear used elsewhere too is never fused with the activation that follows it here.
        # Keyed by id(): the modules are held in self.originals so that no id is reused by a module
        # made here while an old one it named is freed.
        self.originals = [m for _, m in model.named_modules(remove_duplicate=False)]
        self.uses = Counter(id(m) for m in self.originals)
        self.done: dict[int, torch.nn.Module] = {}
        self.replaced: list[Replacement] = []
        self.skipped: list[Skipped] = []

    def record(self, name: str, old, new, note: str) -> None:
        self.replaced.append(Replacement(name, _type_name(old), _type_name(new), note))

    def visit(self, module: torch.nn.Module, name: str) -> torch.nn.Module:
        """What `module` (at `name`) becomes: a new module, or itself (patched inside)."""
        if id(module) in self.done:
            return self.done[id(module)]
        self.done[id(module)] = result = self._visit(module, name)
        return result

    def _visit(self, module: torch.nn.Module, name: str) -> torch.nn.Module:
        hook = getattr(module, "kernelforge_patch", None)
        if callable(hook):
            note = hook()
            if note is not None:
                self.record(name, module, module, str(note))
            return module
        if _is_kernelforge(module):
            return module
        kind = type(module)
        if kind in _SWAPS:
            why_not, build = _SWAPS[kind]
            reason = "hooks are registered on it (a new module would not carry them)" if _has_hooks(module) \
                else why_not(module)
            if reason is not None:
                self.skipped.append(Skipped(name, _type_name(module), reason))
                return module
            if not name:
                self.skipped.append(Skipped(name, _type_name(module), "it is the model itself, and patch() "
                                            "replaces submodules in place"))
                return module
            new, note = build(module)
            self.record(name, module, new, note)
            return new
        for base in _SWAPS:
            if isinstance(module, base):
                self.skipped.append(Skipped(name, _type_name(module), f"a subclass of {_type_name(base)}: its "
                                            "forward may compute something else"))
                return module
        self._container(module, name)
        return module

    def _container(self, module: torch.nn.Module, name: str) -> None:
        prefix = f"{name}." if name else ""
        count = len(self.replaced)
        if type(module) is torch.nn.Sequential:
            self._fuse_sequential(module, prefix)
        elif type(module) in (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer):
            self._fuse_feedforward(module, prefix)
        for child_name, child in list(module._modules.items()):
            if child is not None:
                new = self.visit(child, prefix + child_name)
                if new is not child:
                    setattr(module, child_name, new)
        if len(self.replaced) == count:
            return
        # torch's fused eval-mode paths read the parameters and bypass the submodules: turn them off
        # so the kernelforge modules run (what they compute is the same).
        if isinstance(module, torch.nn.TransformerEncoderLayer) and module.activation_relu_or_gelu:
            module.activation_relu_or_gelu = 0
            self.record(name, module, module, "torch's fused eval fast path off (activation_relu_or_gelu=0), "
                                              "so the kernelforge submodules run")
        if isinstance(module, torch.nn.TransformerEncoder) and getattr(module, "use_nested_tensor", False):
            module.use_nested_tensor = False
            self.record(name, module, module, "nested-tensor fast path off (use_nested_tensor=False): it would "
                                              "hand nested tensors to the kernelforge layers")

    def _fusable_linear(self, linear) -> bool:
        return type(linear) is torch.nn.Linear and self.uses[id(linear)] == 1 and not _has_hooks(linear)

    def _fuse(self, linear: torch.nn.Linear, activation: str, linear_name: str, act_name: str, act) -> kfnn.Linear:
        new = kfnn.Linear.from_torch(linear, activation=activation).train(linear.training)
        self.done[id(linear)] = new
        self.record(linear_name, linear, new, f"kernelforge gemm with {act_name} fused in (activation={activation!r})")
        self.record(act_name, act, torch.nn.Identity, f"fused into {linear_name}")
        return new

    def _fuse_sequential(self, seq: torch.nn.Sequential, prefix: str) -> None:
        items = list(seq._modules.items())
        for (lin_name, linear), (act_name, act) in zip(items, items[1:]):
            activation = _fusable_activation(act)
            if activation and self._fusable_linear(linear) and seq._modules[lin_name] is linear:
                setattr(seq, lin_name, self._fuse(linear, activation, prefix + lin_name, prefix + act_name, act))
                setattr(seq, act_name, torch.nn.Identity())  # no parameters: the state_dict keys stay

    def _fuse_feedforward(self, layer, prefix: str) -> None:
        # _ff_block computes linear2(dropout(activation(linear1(x)))): activation(linear1(x)) is one GEMM.
        activation = _fusable_activation(layer.activation)
        if activation and self._fusable_linear(layer.linear1):
            layer.linear1 = self._fuse(layer.linear1, activation, prefix + "linear1", prefix + "activation",
                                       layer.activation)
            layer.activation = torch.nn.Identity()


_WARNED = "_kernelforge_patch_warned"  # an instance attribute: this model's skipped modules were warned of


def patch(model: torch.nn.Module) -> Replacements:
    """Replace, in place, the torch.nn layers of `model` that kernelforge has modules for, keeping
    their Parameter objects (so the state_dict, its keys, and optimizers built on model.parameters()
    are unchanged). Returns the Replacements (a list of Replacement; `.skipped` lists what was left
    as it was, and why, which the first call also warns of). A second call replaces nothing and
    returns [] (its `.skipped` the same list, not warned again).

        layer = torch.nn.TransformerEncoderLayer(64, 4, dropout=0.0, activation="gelu")
        model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        for r in kernelforge.patch(model):
            print(f"{r.name}: {r.old} -> {r.new}")
        # layers.0.linear1: torch.nn.Linear -> kernelforge.nn.Linear        (note: gelu fused in)
        # layers.0.activation: torch.nn.functional.gelu -> torch.nn.Identity
        # layers.0.self_attn: torch.nn.MultiheadAttention -> kernelforge.patching.MultiheadAttention
        # layers.0.linear2: torch.nn.Linear -> kernelforge.nn.Linear
        # layers.0.norm1: torch.nn.LayerNorm -> kernelforge.nn.LayerNorm
        # layers.0.norm2: torch.nn.LayerNorm -> kernelforge.nn.LayerNorm
        # layers.0: torch.nn.TransformerEncoderLayer -> torch.nn.TransformerEncoderLayer  (fast path off)
        # layers.1.linear1: ...

    See the module docstring (kernelforge.patching) for what is replaced by what.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"kernelforge.patch: model must be a torch.nn.Module, got {type(model).__module__}."
                        f"{type(model).__qualname__}")
    if kf_transformers.family(model) is not None:  # a transformers model kernelforge.transformers knows
        result = kf_transformers.patch(model)
    else:
        patcher = _Patcher(model)
        patcher.visit(model, "")
        result = Replacements(patcher.replaced, patcher.skipped)
    if result.skipped and not model.__dict__.get(_WARNED):  # once a model: a second patch says nothing new
        listing = "; ".join(f"{s.name or '<model>'} ({s.type}): {s.reason}" for s in result.skipped)
        warnings.warn(f"kernelforge.patch left {len(result.skipped)} module(s) as they were: {listing}",
                      stacklevel=2)
        model.__dict__[_WARNED] = True
    return result
