"""kernelforge under torch.distributed: DTensor sharding rules for the row-wise and elementwise ops
(kernelforge.distributed.sharding) and for gemm, flash_attention, cross_entropy and fused linear
cross-entropy (kernelforge.distributed.matmul_sharding), registered when this package is imported;
plans that tensor- or data-parallelize the example LanguageModel (kernelforge.distributed.plans:
tensor_parallel, data_parallel).

    import kernelforge.distributed  # noqa: F401  (or kernelforge.distributed.enable())
    y = kf.rms_norm(x_dtensor, weight_dtensor)  # runs on each rank's shard of x

Not imported by `import kernelforge`: see kernelforge.distributed.sharding's docstring.
"""
from kernelforge.distributed import matmul_sharding, sharding
from kernelforge.distributed.plans import data_parallel, tensor_parallel
from kernelforge.distributed.sharding import RULES, Role, row_op_strategies


def enable() -> bool:
    """Register every rule of sharding.RULES and matmul_sharding.RULES with DTensor (idempotent);
    False where torch.distributed is unavailable."""
    return sharding.enable(matmul_sharding.RULES)


enable()  # idempotent; nothing where torch.distributed is unavailable

__all__ = ["RULES", "Role", "data_parallel", "enable", "row_op_strategies", "tensor_parallel"]
