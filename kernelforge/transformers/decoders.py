"""The patch of transformers' decoder-only causal LMs built like Llama, and GPT-2 (FAMILIES;
kernelforge.transformers dispatches here): per instance, forwards of this model's RMSNorm, MLP and
attention modules, and the causal-LM head's loss. What the families differ in (their Family):
- the attention: every family but GPT-2 takes transformers' LlamaAttention.forward (theirs are the
  same; Granite's scale comes from its config; Gemma 2 hands its attention softcap on) with kf.rope
  in place of apply_rotary_pos_emb (transformers calls it by its module-level name, so no instance
  setting reaches it), with what they add: a sliding window handed to the attention function
  (Mistral / Mixtral / Phi-3 from the config, Qwen2 / Qwen3 / Qwen3-MoE / Gemma 2 / 3 per layer),
  RMSNorms on q and k before the rotation (over each head: Qwen3, Qwen3-MoE, Gemma 3; over the whole
  projection: OLMo 2), one packed qkv projection (Phi-3, whose rotation may cover part of each head).
  Separate q / k / v Linear layers run as one GEMM over their concatenated weights (_projections:
  x's gradient in one GEMM, not three and two adds). The cache update and the attention function
  transformers' registry picks (config._attn_implementation) are as transformers does them, in the
  versions of TESTED_VERSIONS;
  with another version the attention is left alone, and the report says so.
- the norm: x * rsqrt(mean(x^2) + eps) times w (Llama) or times 1 + w in float32 (Gemma's):
  kf.rms_norm either way (offset=1 for Gemma).
- the decoder layer, where its forward is LlamaDecoderLayer's to the letter (Llama, Mistral, Qwen2,
  Qwen3, Gemma, Qwen3-MoE): the same steps, the residual add before the post-attention norm and
  the norm in one kf.add_rms_norm (its backward adds the residual stream's gradient in the norm's
  kernel). Other layers (Gemma 2 / 3's sandwich norms, Granite's multipliers, OLMo 2's post-norms,
  Phi-3, Mixtral) keep transformers' forward.
- the MLP: gate_proj / up_proj / down_proj (kf.gated_mlp, the activation from the module: silu,
  gelu, gelu tanh) or a packed gate_up_proj (Phi-3: down_proj(kf.swiglu(gate_up_proj(x)))).
- mixtures of experts (Mixtral, Qwen3-MoE): the attention, norms, dense MLPs and loss as above; the
  experts (3-D weights, a packed [gate | up] projection) keep transformers' experts forward (its
  grouped GEMMs, by default), with act(gate) * up between the GEMMs by kf.swiglu (its _apply_gate,
  the hook transformers' experts implementations call; "eager" experts do not call it).
- GPT-2: its LayerNorms (kf.layer_norm) and its MLP's GELU (kf.gelu between the Conv1D projections);
  attention transformers'.
- the head: logits divided by a scale (Granite: the hidden states divided instead, by transformers'
  own code, before the fused loss) or softcapped (Gemma 2 / 3: the fused loss caps them).

The loss: with labels, the causal-LM forward (transformers' own, not a copy) runs with the head
passing the hidden states through and, for that call, a loss_function (transformers' per-instance
loss interface) that takes them to kf.fused_linear_cross_entropy with the head's weight, shifting
the labels and reducing as transformers' ForCausalLMLoss does (mean over the tokens not ignored, or
a sum over num_items_in_batch under gradient accumulation). The output then has no logits (None):
they were never made. In training only (as Liger-Kernel's does): in eval mode, without labels, or
with return_dict=False, the forward is transformers' as it was. A head whose weight is split over
the vocabulary (kernelforge.distributed.transformers_plans, head="vocab") takes the loss through
kernelforge.distributed.vocab_parallel_fused and gathers its logits where they are asked for.
"""
from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from kernelforge._replacements import Replacement, Replacements
from kernelforge.ops._common import autocast_cast, autocast_matmul_dtype, is_dtensor
from kernelforge.ops.activations import gelu
from kernelforge.ops.gated_activations import swiglu
from kernelforge.ops.gated_mlp import gated_mlp
from kernelforge.ops.linear_cross_entropy import fused_linear_cross_entropy
from kernelforge.ops.norms import add_rms_norm, rms_norm
from kernelforge.ops.rope import rope
from kernelforge.transformers import attention
from kernelforge.transformers.common import (GELU_APPROXIMATIONS, MARK, Patcher, layer_norm_forward, patched_function,
                                             plain_linears, untested_version)


@dataclass(frozen=True)
class Family:
    prefix: str  # the class names' prefix: <prefix>RMSNorm, <prefix>MLP, <prefix>Attention, <prefix>ForCausalLM
    attention: bool = True  # Llama's attention forward (kf.rope inside); False: transformers' own
    window: Optional[str] = None  # the sliding window the attention passes on: "config", "module" or none
    qk_norm: Optional[str] = None  # q_norm / k_norm before the rotation: over each "head" or the whole "projection"
    packed_qkv: bool = False  # one qkv_proj holds [q | k | v] (Phi-3)
    attention_softcap: bool = False  # the attention function gets softcap=module.attn_logit_softcapping (Gemma 2)
    norm_offset: bool = False  # the norm's scale is 1 + w, applied in float32 (Gemma)
    packed_mlp: bool = False  # gate_up_proj holds [gate | up] (Phi-3)
    gelu_mlp: bool = False  # c_proj(act(c_fc(x))) with torch.nn.LayerNorm norms (GPT-2)
    causal_lm: Optional[str] = None  # the causal LM's class name, if not <prefix>ForCausalLM

    @property
    def causal_lm_class(self) -> str:
        return self.causal_lm or f"{self.prefix}ForCausalLM"


# config.model_type -> what its transformers modeling code does (transformers 5.17 and 5.24)
FAMILIES = {"llama": Family("Llama"), "mistral": Family("Mistral", window="config"),
            "qwen2": Family("Qwen2", window="module"), "qwen3": Family("Qwen3", window="module", qk_norm="head"),
            "gemma": Family("Gemma", norm_offset=True),
            "gemma2": Family("Gemma2", window="module", attention_softcap=True, norm_offset=True),
            "gemma3_text": Family("Gemma3", window="module", qk_norm="head", norm_offset=True),
            "granite": Family("Granite"), "olmo2": Family("Olmo2", qk_norm="projection"),
            "phi3": Family("Phi3", window="config", packed_qkv=True, packed_mlp=True),
            # mixtures of experts: their experts' gated activation kernelforge's (_patch_experts)
            "mixtral": Family("Mixtral", window="config"),
            "qwen3_moe": Family("Qwen3Moe", window="module", qk_norm="head"),
            "gpt2": Family("GPT2", attention=False, gelu_mlp=True, causal_lm="GPT2LMHeadModel")}
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
# the MLP's activation module (transformers.activations) -> kernelforge's gated kind
GATED_KINDS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUActivation": "gelu", "GELUTanh": "gelu_tanh",
               "PytorchGELUTanh": "gelu_tanh"}


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != self.weight.dtype:  # transformers' mixed-dtype promotion, as it was
        return type(self).forward(self, hidden_states)
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _offset_rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Gemma's: normalized x times (1 + w), in float32, rounded once to x's dtype."""
    return rms_norm(x, self.weight, self.eps, 1.0)


def _norm_fused_with_the_add(norm, x: torch.Tensor, residual: torch.Tensor):
    """(weight, eps, offset) of an RMSNorm this patch took whose inputs share its weight's dtype:
    add_rms_norm computes it with the residual add; else None."""
    forward = patched_function(norm)
    if forward is _rms_norm_forward:
        eps, offset = norm.variance_epsilon, 0.0
    elif forward is _offset_rms_norm_forward:
        eps, offset = norm.eps, 1.0
    else:
        return None
    if not x.dtype == residual.dtype == norm.weight.dtype or x.shape != residual.shape:
        return None
    return norm.weight, eps, offset


def _decoder_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                           use_cache=False, position_embeddings=None, **kwargs):
    """transformers' LlamaDecoderLayer.forward (pre-norm: x + attn(norm(x)), then + mlp(norm(...)))
    with the residual add before the post-attention norm and the norm in one kf.add_rms_norm: one
    pass writes the sum and its normalized rows (the add's read and write of the sum saved), and
    its backward adds the residual stream's gradient inside the norm's kernel (an add kernel of
    tokens x hidden saved). The add after the MLP is the MLP's where this patch took it (and no hook
    was added since): kf.gated_mlp adds it in its last GEMM."""
    if cache is None:
        cache = kwargs.pop("past_key_values", None)  # the name transformers deprecates for `cache`
    residual = hidden_states
    hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                      position_ids=position_ids, cache=cache, use_cache=use_cache,
                                      position_embeddings=position_embeddings, **kwargs)
    norm = self.post_attention_layernorm
    fused = _norm_fused_with_the_add(norm, hidden_states, residual)
    if fused is not None:
        weight, eps, offset = fused
        normed, hidden_states = add_rms_norm(hidden_states, residual, weight, eps, offset)
    else:
        hidden_states = residual + hidden_states
        normed = norm(hidden_states)
    if _takes_residual(self.mlp):
        return self.mlp(normed, residual=hidden_states)
    return hidden_states + self.mlp(normed)


@functools.lru_cache(maxsize=None)
def _forward_source(cls) -> str:
    return inspect.getsource(cls.forward)


def _is_llama_decoder_layer(layer) -> bool:
    """The layer's forward is transformers' LlamaDecoderLayer.forward to the letter (Mistral, Qwen2,
    Qwen3, Gemma and Qwen3-MoE share it in the tested versions): what _decoder_layer_forward
    follows."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    try:
        return _forward_source(type(layer)) == _forward_source(LlamaDecoderLayer)
    except (OSError, TypeError):  # no source to compare
        return False


def _conv1d_mlp_forward(self, x: torch.Tensor, *, approximate: str) -> torch.Tensor:
    """GPT-2's: c_proj(gelu(c_fc(x))) (Conv1D projections: x @ W + b), the GELU by kf.gelu."""
    return self.dropout(self.c_proj(gelu(self.c_fc(x), approximate=approximate)))


# The gated MLPs' forwards add the decoder layer's residual= (the fused one in its last GEMM)
def _plus(residual: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    return out if residual is None else residual + out


def _mlp_forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _plus(residual, self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x))))


def _fused_mlp_forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, *, kind: str) -> torch.Tensor:
    # transformers' own forward for mixed dtypes, and for projections wrapped or hooked after the
    # patch (a LoRA adapter added by PEFT, say): the fused MLP reads the weights, not the modules
    if x.dtype != self.gate_proj.weight.dtype or not plain_linears(self, MLP_PROJECTIONS):
        return _plus(residual, type(self).forward(self, x))
    if residual is not None and (residual.dtype != x.dtype or autocast_matmul_dtype(x.device.type) is not None):
        # torch's add promotes (a float32 residual stream beside an autocast product): not the GEMM's
        return residual + gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                                    activation=kind)
    return gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, activation=kind,
                     residual=residual)


def _packed_mlp_forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _plus(residual, self.down_proj(swiglu(self.gate_up_proj(x))))


_RESIDUAL_MLP_FORWARDS = (_mlp_forward, _fused_mlp_forward, _packed_mlp_forward)


def _takes_residual(mlp) -> bool:
    """The MLP runs one of this patch's forwards above, not replaced since (a tensor-parallel plan's,
    whose output is a partial sum the residual must not join before its all-reduce) and not hooked
    since (a hook sees mlp(x))."""
    return patched_function(mlp) in _RESIDUAL_MLP_FORWARDS and not (mlp._forward_hooks or mlp._forward_pre_hooks)


class _ConcatenatedLinear(torch.autograd.Function):
    """x @ [W_1 | W_2 | ...]^T (+ the layers' biases concatenated) as one GEMM. The concatenated
    weight is kept for the backward, not made again there: (q + 2 kv heads) x head_dim x hidden
    elements a layer held from forward to backward (12 MiB at Llama-3.2-1B, 0.19 GB a step of 16
    layers) for one copy fewer a layer (a 12 MiB cat, about 31 us on an H200, and its launch)."""

    @staticmethod
    def forward(ctx, x, bias, *weights):
        weight = torch.cat(weights)
        ctx.save_for_backward(x, weight)
        ctx.rows = [w.shape[0] for w in weights]
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        rows = grad.reshape(-1, grad.shape[-1])
        grad_bias = rows.sum(0) if ctx.needs_input_grad[1] else None
        grad_weights = [None] * len(ctx.rows)
        if any(ctx.needs_input_grad[2:]):
            grad_weights = (rows.t() @ x.reshape(-1, x.shape[-1])).split(ctx.rows)
        return (grad_x, grad_bias, *grad_weights)


def _projections(self, hidden_states):
    """(q, k, v): one GEMM over [Wq | Wk | Wv] (and [bq | bk | bv]) where the three are plain
    Linear layers of one dtype with or without biases alike (no adapter, hook or sharded weight:
    else each its own). Why: the backward then makes x's gradient in one GEMM, not three GEMMs and
    two adds of (tokens x hidden), and the weights' in one, and no GEMM runs at the kv heads' narrow
    width. q, k and v are views of the one output (_attention_forward copies what a saved view
    would keep alive)."""
    layers = [getattr(self, name) for name in ATTENTION_PROJECTIONS]
    weights = [layer.weight for layer in layers]
    if (not plain_linears(self, ATTENTION_PROJECTIONS, bias=True) or len({w.dtype for w in weights}) != 1
            or len({layer.bias is None for layer in layers}) != 1 or any(is_dtensor(w) for w in weights)):
        return tuple(layer(hidden_states) for layer in layers)
    bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
    dtype = autocast_matmul_dtype(hidden_states.device.type)
    if dtype is not None:  # under torch.autocast: the product in its dtype, as F.linear's; its backward too
        hidden_states, bias, *weights = autocast_cast(dtype, hidden_states, bias, *weights)
    qkv = _ConcatenatedLinear.apply(hidden_states, bias, *weights)
    return qkv.split([w.shape[0] for w in weights], -1)


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, *, family,
                       **kwargs):
    """transformers' <family>Attention.forward (TESTED_VERSIONS), rope by kf.rope (q and k in one kernel)."""
    if cache is None:
        cache = kwargs.pop("past_key_values", None)  # the name transformers deprecates for `cache`
    modeling = sys.modules[type(self).__module__]
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    if family.packed_qkv:
        qkv = self.qkv_proj(hidden_states)
        q_end = self.config.num_attention_heads * self.head_dim
        k_end = q_end + self.num_key_value_heads * self.head_dim
        query, key, value = qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]
    else:
        query, key, value = _projections(self, hidden_states)
        # views of one GEMM's output: one the attention saves would keep all of it alive until the
        # backward (q, k and v: 48 MiB a layer at Llama-3.2-1B x 8192 tokens); v copied alone is 8.
        # q and k are too where a norm saves them; rope saves neither.
        if value._base is not None and torch.is_grad_enabled():
            value = value.contiguous()
            if family.qk_norm:
                query, key = query.contiguous(), key.contiguous()
    if family.qk_norm == "projection":
        query, key = self.q_norm(query), self.k_norm(key)
    query, key, value = query.view(hidden_shape), key.view(hidden_shape), value.view(hidden_shape)
    if family.qk_norm == "head":
        query, key = self.q_norm(query), self.k_norm(key)
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    cos, sin = position_embeddings  # Phi-3's may rotate part of each head: kf.rope leaves the rest
    query, key = rope(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    if family.window == "config":
        kwargs["sliding_window"] = getattr(self.config, "sliding_window", None)
    elif family.window == "module":
        kwargs["sliding_window"] = self.sliding_window
    if family.attention_softcap:
        kwargs["softcap"] = self.attn_logit_softcapping
    attention = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                modeling.eager_attention_forward)
    output, weights = attention(self, query, key, value, attention_mask,
                                dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                                **kwargs)
    return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


def _head_forward(self, x: torch.Tensor) -> torch.Tensor:
    # a plain attribute read of an attribute the patch made (False): under torch.compile Dynamo then
    # sees the value _causal_lm_forward set in the same graph. Read from the module's dict, or by
    # getattr with a default while the attribute did not exist yet, torch 2.11's Dynamo took the
    # value the module had before the call: the head made logits and the fused loss, given them as
    # hidden states, refused them
    if self._kernelforge_pass_hidden:
        return x
    if is_dtensor(self.weight) and not is_dtensor(x):  # split by the vocabulary (transformers_plans' head="vocab")
        from kernelforge.distributed.vocab_parallel_fused import vocab_parallel_logits

        return vocab_parallel_logits(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def _vocab_parallel_loss(*args, **options) -> torch.Tensor:
    """The fused loss of a vocabulary-sharded head: each rank its classes, the logits never gathered."""
    from kernelforge.distributed.vocab_parallel_fused import vocab_parallel_fused_linear_cross_entropy

    return vocab_parallel_fused_linear_cross_entropy(*args, **options).to_local()  # a Replicate DTensor's value


def _causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                    shift_labels=None, *, head, softcap=None, **kwargs):
    """transformers' ForCausalLMLoss over the hidden states (`logits` here: the head passed them)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = logits.reshape(-1, logits.shape[-1])
    target = shift_labels.reshape(-1).to(hidden.device)
    loss_fn = _vocab_parallel_loss if is_dtensor(head.weight) else fused_linear_cross_entropy
    if num_items_in_batch is None:
        return loss_fn(hidden, head.weight, target, head.bias, ignore_index=ignore_index, softcap=softcap)
    loss = loss_fn(hidden, head.weight, target, head.bias, ignore_index=ignore_index, reduction="sum",
                   softcap=softcap)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _causal_lm_forward(self, *args, **kwargs):
    head = self.lm_head
    if (not self.training or kwargs.get("labels") is None or kwargs.get("return_dict") is False
            or "_loss_function" in self.__dict__  # evaluation keeps its logits (metrics read them)
            # a head replaced (a PEFT wrapper, say) or hooked after the patch
            or "forward" not in head.__dict__ or head._forward_hooks or head._forward_pre_hooks):
        return type(self).forward(self, *args, **kwargs)
    # Gemma 2 / 3 cap the logits before the loss: the fused loss caps them, the forward must not
    # cap the hidden states the head passes through (for this call only)
    softcap = getattr(self.config, "final_logit_softcapping", None)
    self.loss_function = functools.partial(_causal_lm_loss, head=head, softcap=softcap)
    head._kernelforge_pass_hidden = True
    if softcap is not None:
        self.config.final_logit_softcapping = None
    try:
        out = type(self).forward(self, *args, **kwargs)
    finally:
        head._kernelforge_pass_hidden = False
        del self._loss_function
        if softcap is not None:
            self.config.final_logit_softcapping = softcap
    return type(out)(**{key: value for key, value in out.items() if key != "logits"})


def _loss_skip_reason(model, family: Family) -> str | None:
    untested = untested_version()
    if untested:
        return f"the fused loss follows transformers' causal-LM forward as tested; {untested}"
    if type(model).__name__ != family.causal_lm_class:
        return f"the fused loss is for {family.causal_lm_class}"
    if type(model.lm_head) is not torch.nn.Linear or model.lm_head._forward_hooks or model.lm_head._forward_pre_hooks:
        return "the head is not a plain nn.Linear without hooks"
    if "_loss_function" in model.__dict__ or getattr(model, "loss_type", None) not in (None, "ForCausalLM"):
        return "the model has a loss function of its own"
    return None


def _use_kernelforge_attention(model, patcher: Patcher) -> None:
    """A model on "sdpa" moves to "kernelforge": the same SDPA kernels, the causal mask implicit
    under torch.compile too (kernelforge.transformers.attention)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    untested = untested_version()
    if untested:
        patcher.skip("", model, f'attn_implementation stays "sdpa": the "{attention.NAME}" mask follows '
                                f"transformers' masks as tested; {untested}")
        return
    attention.register()
    model.set_attn_implementation(attention.NAME)
    patcher.replaced.append(Replacement("", type(model).__qualname__, type(model).__qualname__,
                                f'attn_implementation "sdpa" -> "{attention.NAME}" (SDPA; the causal mask stays '
                                "implicit under torch.compile)"))


def _patch_mlp(name: str, module, family: Family, patcher: Patcher) -> None:
    take = patcher.take
    act = getattr(module, "act_fn", getattr(module, "activation_fn", getattr(module, "act", None)))
    if family.gelu_mlp:
        approximate = GELU_APPROXIMATIONS.get(type(act).__name__)
        if approximate is None:
            patcher.skip(name, module, f"activation {type(act).__name__}, not a GELU")
        else:
            take(name, module, functools.partial(_conv1d_mlp_forward, approximate=approximate),
                 f"forward -> c_proj(kf.gelu(c_fc(x), approximate={approximate!r}))")
        return
    gated = GATED_KINDS.get(type(act).__name__)
    if family.packed_mlp:
        if gated == "silu":
            take(name, module, _packed_mlp_forward, "forward -> down_proj(kf.swiglu(gate_up_proj(x)))")
        else:
            patcher.skip(name, module, f"activation {type(act).__name__}, not silu")
    elif gated is None:
        patcher.skip(name, module, f"activation {type(act).__name__}, not one of {sorted(GATED_KINDS)}")
    elif plain_linears(module, MLP_PROJECTIONS):
        take(name, module, functools.partial(_fused_mlp_forward, kind=gated),
             f"forward -> kf.gated_mlp ({gated}; the backward recomputes act(gate) * up instead of keeping it)")
    elif gated == "silu":
        take(name, module, _mlp_forward, "forward -> down_proj(kf.swiglu(gate_proj(x), up_proj(x)))")
    else:
        patcher.skip(name, module, "a projection has a bias or hooks")


def _packed_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up of the experts' packed [gate | up] projection (transformers' _apply_gate)."""
    return swiglu(gate_up)


def _patch_experts(name: str, module, model, patcher: Patcher) -> None:
    """The experts' _apply_gate -> kf.swiglu, where it is transformers' default (silu, [gate | up])."""
    gate = getattr(type(module), "_apply_gate", None)
    act = getattr(module, "act_fn", None)
    implementation = getattr(model.config, "_experts_implementation", None)
    if (getattr(gate, "__name__", None) != "_default_apply_gate" or not getattr(module, "is_concatenated", False)
            or not getattr(module, "has_gate", False)):
        patcher.skip(name, module, "its gated activation is not transformers' default act(gate) * up of [gate | up]")
    elif GATED_KINDS.get(type(act).__name__) != "silu":
        patcher.skip(name, module, f"activation {type(act).__name__}, not silu")
    elif implementation not in ("grouped_mm", "batched_mm"):
        patcher.skip(name, module, f"experts_implementation {implementation!r} computes act(gate) * up itself; "
                                   "model.set_experts_implementation('grouped_mm') before kf.patch takes it")
    else:
        patcher.take(name, module, _packed_gate, f"_apply_gate -> kf.swiglu (between the {implementation} "
                                                 "experts' GEMMs)", method="_apply_gate")


def patch(model: torch.nn.Module, model_type: str) -> Replacements:
    family = FAMILIES[model_type]
    patcher = Patcher()
    take = patcher.take

    untested = untested_version()
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind == f"{family.prefix}Attention" and family.attention and not module.__dict__.get(MARK):
            if untested:
                patcher.skip(name, module, f"its forward (for kf.rope) follows transformers' as tested; {untested}")
            else:
                take(name, module, functools.partial(_attention_forward, family=family),
                     "forward with kf.rope for q and k")
        elif kind.endswith("DecoderLayer") and family.attention and _is_llama_decoder_layer(module):
            if untested:
                patcher.skip(name, module, f"its forward (for kf.add_rms_norm) follows transformers' as tested; "
                                           f"{untested}")
            else:
                take(name, module, _decoder_layer_forward,
                     "forward with the residual add and post_attention_layernorm in one kf.add_rms_norm")
        elif kind == f"{family.prefix}RMSNorm":
            if family.norm_offset:
                take(name, module, _offset_rms_norm_forward, "forward -> kf.rms_norm with 1 + w (float32)")
            else:
                take(name, module, _rms_norm_forward, "forward -> kf.rms_norm")
        elif kind == f"{family.prefix}MLP" and not module.__dict__.get(MARK):
            _patch_mlp(name, module, family, patcher)
        elif family.gelu_mlp and type(module) is torch.nn.LayerNorm:
            take(name, module, layer_norm_forward, "forward -> kf.layer_norm")
        elif kind == f"{family.prefix}Experts" and not model.__dict__.get(MARK):
            _patch_experts(name, module, model, patcher)
    if not model.__dict__.get(MARK):
        _use_kernelforge_attention(model, patcher)
        reason = _loss_skip_reason(model, family)
        if reason is None:
            take("lm_head", model.lm_head, _head_forward,
                 "passes the hidden states to the fused loss when labels are given")
            model.lm_head._kernelforge_pass_hidden = False  # _head_forward's flag, made here (its comment)
            take("", model, _causal_lm_forward, "loss with labels -> kf.fused_linear_cross_entropy (logits None)")
        else:
            patcher.skip("", model, reason)
        model.__dict__.setdefault(MARK, "patched")
    return patcher.report()


__all__ = ["FAMILIES", "Family", "patch"]
