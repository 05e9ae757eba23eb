"""Plans that parallelize a Hugging Face transformers causal LM of the Llama family (FAMILIES:
Llama, Mistral, Qwen2), patched by kf.patch or not, on torch.distributed's own APIs.

    kf.patch(model)                                         # first: the patch reads the classes
    tensor_parallel_transformers(model, mesh)               # in place; model(ids, labels=ids) as before
    fully_shard_transformers(model, mesh)                   # in place (FSDP2)
    # both, on a 2-D mesh ("dp", "tp"): tensor parallel over "tp" first, then FSDP2 over "dp"
    tensor_parallel_transformers(model, mesh2d["tp"]); fully_shard_transformers(model, mesh2d["dp"])

tensor_parallel_transformers: the layout of transformers' config.base_model_tp_plan, applied with
torch.distributed.tensor.parallel.parallelize_module over the 1-D `mesh`:
  - q_proj, k_proj, v_proj column-wise (each rank its heads' rows; their outputs plain local
    tensors), o_proj row-wise (a Partial sum reduced to a replicated plain tensor). The attention
    views q, k and v with -1 heads (transformers' `hidden_shape = (*input_shape, -1, head_dim)`,
    kf.patch's forward as well), so it runs on the rank's heads as they come; the ratio of query
    to key / value heads (num_key_value_groups, GQA) is the same on every rank since both counts
    are divided by the mesh size: both must split evenly;
  - the MLP: gate_proj and up_proj column-wise, down_proj row-wise. kf.patch's MLP forward is one
    kf.gated_mlp over the three weights, an op without a DTensor rule: on a patched MLP the plan
    keeps the weights DTensors (their gradients, checkpoints and FSDP2 see the sharded layout) and
    runs kf.gated_mlp on the local shards, its Partial output reduced to Replicate, as
    kernelforge.distributed.plans' FusedColwise does for the example model. An unpatched MLP (or
    one the patch left to transformers or to kf.swiglu) gets torch's Colwise / Rowwise styles;
  - the token embeddings row-wise (vocabulary-sharded), or replicated (plain) when the head is
    tied to them or `embeddings="replicate"`;
  - the norms replicated, and the LM head replicated (plain parameters: the patched loss,
    kf.fused_linear_cross_entropy over the replicated hidden states, reads the full head weight)
    or, with head="vocab", split by the vocabulary: each rank the rows of its classes, the patched
    loss kernelforge.distributed.vocab_parallel_fused's loss (the logits never gathered: each rank
    computes its classes' part of the head's GEMMs), the logits of evaluation and generation
    gathered (vocab_parallel_logits); an unpatched head gets torch's ColwiseParallel.
Training and forward passes; generation with a cache sized from the config (a StaticCache) does
not know the local head counts.

fully_shard_transformers: torch.distributed.fsdp.fully_shard on each decoder layer, then on the
root. The root's unit holds the embeddings, the final norm and the LM head, and the root's forward
is kf.patch's causal-LM forward, the fused loss included: the loss reads `lm_head.weight` inside
the root's forward, between FSDP2's pre-forward (which gathers the root's parameters) and its
post-forward, so it reads the full unsharded parameter and its gradient is reduce-scattered with
the others. (Patch before sharding: kf.patch recognizes the model by its class, which
fully_shard replaces with an FSDP subclass.)
"""
from __future__ import annotations

from torch import nn

FAMILIES = ("llama", "mistral", "qwen2")  # config.model_type values whose layers these plans know
ATTENTION_COLUMNS = ("q_proj", "k_proj", "v_proj")
# attributes some attention modules keep with a global head count (Llama's keeps none of them)
HEAD_COUNT_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads")


def _decoder(model, who: str):
    """The model's decoder (the module holding embed_tokens, layers and norm), after checking the
    family."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"{who}: {type(model).__qualname__} (model_type {model_type!r}) is not a transformers model "
                         f"of the families these plans know: {FAMILIES}")
    decoder = getattr(model, "model", model)
    if not hasattr(decoder, "layers") or not hasattr(decoder, "embed_tokens"):
        raise ValueError(f"{who}: {type(model).__qualname__} has no decoder layers where a {model_type} model keeps "
                         "them")
    return decoder


def _fused_mlp_activation(mlp):
    """The gated kind ("silu", ...) when kf.patch made this MLP one kf.gated_mlp, else None: the
    patch does so exactly for a gated activation it knows over plain bias-free projections."""
    from kernelforge.transformers.common import MARK, plain_linears
    from kernelforge.transformers.decoders import GATED_KINDS, MLP_PROJECTIONS

    if not mlp.__dict__.get(MARK) or not plain_linears(mlp, MLP_PROJECTIONS):
        return None
    return GATED_KINDS.get(type(getattr(mlp, "act_fn", None)).__name__)


def _local_gated_mlp_style():
    """The ParallelStyle of a patched gated MLP (module docstring). Built here: torch.distributed
    may be unavailable at import."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    from kernelforge.ops.gated_mlp import gated_mlp

    class LocalGatedMLP(ParallelStyle):
        """gate_proj and up_proj Shard(0), down_proj Shard(1) (DTensor parameters); the forward
        runs on the local shards: x replicated (its gradient a Partial sum, reduced), each rank's
        columns of act(gate) * up times its rows of down a Partial sum of the output, reduced."""

        def __init__(self, activation: str):
            super().__init__()
            self.activation = activation

        def _apply(self, module, device_mesh):
            for name, placement in (("gate_proj", Shard(0)), ("up_proj", Shard(0)), ("down_proj", Shard(1))):
                linear = getattr(module, name)
                linear.weight = nn.Parameter(distribute_tensor(linear.weight, device_mesh, [placement]),
                                             requires_grad=linear.weight.requires_grad)
            activation = self.activation

            def forward(x):
                x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                x = x.to_local(grad_placements=[Partial()])
                gate, up, down = (getattr(module, name).weight.to_local()
                                  for name in ("gate_proj", "up_proj", "down_proj"))
                if x.dtype == gate.dtype:
                    out = gated_mlp(x, gate, up, down, activation=activation)
                else:  # mixed dtypes (autocast): transformers' math, as the patched forward falls back to
                    out = F.linear(module.act_fn(F.linear(x, gate)) * F.linear(x, up), down)
                out = DTensor.from_local(out, device_mesh, [Partial()], run_check=False)
                return out.redistribute(placements=[Replicate()]).to_local()

            module.forward = forward  # kf.patch's MLP forward, on the local weights
            return module

    return LocalGatedMLP


def _shard_head_by_vocabulary(model, decoder, mesh, tied: bool) -> None:
    """The LM head's weight (and bias) Shard(0) DTensors over `mesh`: each rank its classes' rows.
    A head kf.patch took (an instance forward: kernelforge.transformers' _head_forward) keeps no
    hook: its loss becomes the vocabulary-parallel fused loss, its logits (evaluation, generation)
    vocab_parallel_logits, both chosen there by the weight being a DTensor. Any other head gets
    torch's ColwiseParallel with its logits gathered. Tied: the embeddings are Shard(0) the same
    way (row-wise), so the two names hold one parameter again."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    head = model.lm_head
    patched = "forward" in head.__dict__
    if not patched:
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    elif not tied:
        head.weight = nn.Parameter(distribute_tensor(head.weight, mesh, [Shard(0)]),
                                   requires_grad=head.weight.requires_grad)
    if tied:
        head.weight = decoder.embed_tokens.weight
    if patched and head.bias is not None:
        head.bias = nn.Parameter(distribute_tensor(head.bias, mesh, [Shard(0)]), requires_grad=head.bias.requires_grad)


def tensor_parallel_transformers(model, mesh, embeddings: str = "auto", head: str = "replicate"):
    """Tensor-parallelize `model` (a transformers Llama / Mistral / Qwen2 causal LM or base model,
    patched by kf.patch or not) in place over the 1-D `mesh` (module docstring); returns it.
    embeddings: "rowwise" (vocabulary-sharded), "replicate", or "auto": row-wise unless the LM
    head is tied to them and replicated. head: "replicate" (every rank the whole head: the fused
    loss reads it whole) or "vocab" (each rank its classes' rows: the loss through
    kernelforge.distributed.vocab_parallel_fused, the logits never gathered in training; a tied head
    takes the row-wise embeddings' parameter). Every rank must pass the same model (same seed or
    checkpoint): each keeps its shards of it."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    who = "tensor_parallel_transformers"
    decoder = _decoder(model, who)
    config = model.config
    tp = mesh.size()
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % tp or kv_heads % tp:
        raise ValueError(f"{who}: {heads} attention heads and {kv_heads} key / value heads must both split evenly "
                         f"over {tp} ranks")
    lm_head = getattr(model, "lm_head", None)
    tied = lm_head is not None and lm_head.weight is decoder.embed_tokens.weight
    if head not in ("replicate", "vocab"):
        raise ValueError(f"{who}: head must be 'replicate' or 'vocab', got {head!r}")
    if head == "vocab" and lm_head is None:
        raise ValueError(f"{who}: head='vocab' needs a causal LM (a model with lm_head), got "
                         f"{type(model).__qualname__}")
    if embeddings == "auto":
        embeddings = "rowwise" if head == "vocab" or not tied else "replicate"
    if embeddings not in ("rowwise", "replicate"):
        raise ValueError(f"{who}: embeddings must be 'auto', 'rowwise' or 'replicate', got {embeddings!r}")
    if tied and (embeddings == "rowwise") != (head == "vocab"):
        raise ValueError(f"{who}: the LM head is tied to the embeddings: both replicated (embeddings='replicate', "
                         f"head='replicate') or both split by the vocabulary (embeddings='rowwise', head='vocab'), "
                         f"got embeddings={embeddings!r}, head={head!r}")

    LocalGatedMLP = _local_gated_mlp_style()
    for layer in decoder.layers:
        plan = {f"self_attn.{name}": ColwiseParallel() for name in ATTENTION_COLUMNS}
        plan["self_attn.o_proj"] = RowwiseParallel()
        activation = _fused_mlp_activation(layer.mlp)
        if activation is not None:
            plan["mlp"] = LocalGatedMLP(activation)
        else:
            plan.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                         "mlp.down_proj": RowwiseParallel()})
        parallelize_module(layer, mesh, plan)
        attention = layer.self_attn
        for name in HEAD_COUNT_ATTRIBUTES:  # the rank's heads, where the module keeps a count
            if isinstance(getattr(attention, name, None), int):
                setattr(attention, name, getattr(attention, name) // tp)
    if embeddings == "rowwise":
        parallelize_module(decoder, mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                                           output_layouts=Replicate())})
    if head == "vocab":
        _shard_head_by_vocabulary(model, decoder, mesh, tied)
    return model


def fully_shard_transformers(model, mesh=None, **kwargs):
    """FSDP2 on `model` (a transformers Llama / Mistral / Qwen2 causal LM, patched by kf.patch
    before, or not): fully_shard on each decoder layer, then on the root, over `mesh` (1-D; the
    "dp" dimension of a 2-D mesh after tensor_parallel_transformers on its "tp" one) or the
    default group's; in place, returns it. kwargs go to fully_shard. The root's unit holds the LM
    head, whose weight the patched loss reads inside the root's forward (module docstring)."""
    from torch.distributed.fsdp import fully_shard

    decoder = _decoder(model, "fully_shard_transformers")
    if mesh is not None:
        kwargs.setdefault("mesh", mesh)
    for layer in decoder.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


__all__ = ["FAMILIES", "fully_shard_transformers", "tensor_parallel_transformers"]
