"""kernelforge under torch.distributed: DTensor sharding rules for the row-wise and elementwise ops
(kernelforge.distributed.sharding) and for gemm, flash_attention, cross_entropy and fused linear
cross-entropy (kernelforge.distributed.matmul_sharding), registered when this package is imported;
plans that tensor- or data-parallelize the example LanguageModel (kernelforge.distributed.plans:
tensor_parallel, data_parallel).
Plans for a transformers Llama / Mistral / Qwen2 causal LM, patched by kf.patch or not
(kernelforge.distributed.transformers_plans: tensor_parallel_transformers, fully_shard_transformers;
transformers imported only when they run).
Pipeline parallelism for the example LanguageModel on torch.distributed.pipelining, alone or with
DDP / FSDP2 on a ("pp", "dp") mesh (kernelforge.distributed.pipeline: pipeline_parallel).
Cross-entropy and fused linear cross-entropy over a vocabulary sharded across ranks, without the
(tokens x vocabulary) logits gathered (kernelforge.distributed.vocab_parallel, vocab_parallel_fused).
For training loops: optimizer_groups (a DTensor and a plain parameter group: CUDA's foreach
optimizers refuse a mix) and kernelforge.distributed.strided (gathering TP's fused weights, which
torch 2.11's full_tensor() cannot).

    import kernelforge.distributed  # noqa: F401  (or kernelforge.distributed.enable())
    y = kf.rms_norm(x_dtensor, weight_dtensor)  # runs on each rank's shard of x

Not imported by `import kernelforge`: see kernelforge.distributed.sharding's docstring.
"""
from kernelforge.distributed import matmul_sharding, sharding
from kernelforge.distributed.plans import data_parallel, optimizer_groups, tensor_parallel
from kernelforge.distributed.sharding import RULES, Role, row_op_strategies
from kernelforge.distributed.vocab_parallel import vocab_parallel_cross_entropy
from kernelforge.distributed.vocab_parallel_fused import vocab_parallel_fused_linear_cross_entropy, vocab_parallel_logits
from kernelforge.distributed.pipeline import LanguageModelPipeline, pipeline_parallel
from kernelforge.distributed.transformers_plans import fully_shard_transformers, tensor_parallel_transformers


def enable() -> bool:
    """Register every rule of sharding.RULES and matmul_sharding.RULES with DTensor (idempotent);
    False where torch.distributed is unavailable."""
    return sharding.enable(matmul_sharding.RULES)


enable()  # idempotent; nothing where torch.distributed is unavailable

__all__ = ["RULES", "Role", "data_parallel", "enable", "optimizer_groups", "row_op_strategies", "tensor_parallel"]
__all__ += ["fully_shard_transformers", "tensor_parallel_transformers"]
__all__ += ["LanguageModelPipeline", "pipeline_parallel"]
__all__ += ["vocab_parallel_cross_entropy", "vocab_parallel_fused_linear_cross_entropy", "vocab_parallel_logits"]
