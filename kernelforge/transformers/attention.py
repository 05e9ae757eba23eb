"""attn_implementation="kernelforge": transformers' SDPA attention with a causal mask that stays
implicit under torch.compile.

transformers builds the attention mask before the layers run (masking_utils.create_causal_mask,
through the mask function its AttentionMaskInterface registers for the implementation). For SDPA,
a plain causal mask over a whole sequence is left out (None) so that SDPA runs its causal kernels
(is_causal=True: cuDNN's or FlashAttention's, which skip the blocks above the diagonal) instead
of reading a (batch, 1, q, kv) boolean mask. While torch.compile traces, transformers
materializes the mask anyway (it cannot tell torch.compile from torch.export on torch < 2.14), and
the masked kernels run: measured on an H200 in a Llama-1B train step (4 x 2048 tokens, head dim
64), cuDNN's attention took 2.5x the device time it takes with is_causal (forward 0.55 against
0.21 ms a layer, backward 1.44 against 0.58).

The mask function here leaves the mask out whenever it is plain causal from what it is given,
without reading any tensor's values: no padding mask (attention_mask None), the plain causal
mask function (no sliding window, packing or custom mask), no cache offset, q as long as kv.
Anything else is transformers' own SDPA mask. The attention function is transformers' SDPA
attention, which turns a mask of None into is_causal. Under torch.export the skip is specialized
on q_length == kv_length, as a compiled graph is guarded on it.

    import kernelforge.transformers
    kernelforge.transformers.register()           # the name, in transformers' two registries
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="kernelforge")

kf.patch(model) registers the name and moves a model whose attention is "sdpa" onto it.
"""
from __future__ import annotations

# Imported with this module (kernelforge.transformers is imported only where transformers is): an
# import inside causal_mask, which runs while torch.compile traces the model, is a graph break under
# torch 2.11's Dynamo (transformers is a _LazyModule, "Bad import result")
from transformers import masking_utils

NAME = "kernelforge"


def causal_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                attention_mask=None, local_size=None, allow_is_causal_skip: bool = True, **kwargs):
    """transformers' sdpa_mask, or None (is_causal) for a plain causal mask over a whole sequence,
    also while torch.compile traces (module docstring)."""
    plain = mask_function is None or mask_function is masking_utils.causal_mask_function
    if (allow_is_causal_skip and plain and attention_mask is None and local_size is None
            and isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == 0 and kv_offset == 0
            and q_length == kv_length):
        return None
    if mask_function is not None:
        kwargs["mask_function"] = mask_function
    return masking_utils.sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask,
                                   local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def register() -> None:
    """Register attn_implementation="kernelforge" in transformers' AttentionInterface and
    AttentionMaskInterface (a name added; no existing one changes). Idempotent."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(NAME, sdpa_attention_forward)
    AttentionMaskInterface.register(NAME, causal_mask)


__all__ = ["NAME", "causal_mask", "register"]
