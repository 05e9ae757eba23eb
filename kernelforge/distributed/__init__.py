"""kernelforge under torch.distributed: DTensor sharding rules for the row-wise and elementwise ops
(kernelforge.distributed.sharding), registered when this package is imported.

    import kernelforge.distributed  # noqa: F401  (or kernelforge.distributed.enable())
    y = kf.rms_norm(x_dtensor, weight_dtensor)  # runs on each rank's shard of x

Not imported by `import kernelforge`: see kernelforge.distributed.sharding's docstring.
"""
from kernelforge.distributed.sharding import RULES, Role, enable, row_op_strategies

enable()  # idempotent; nothing where torch.distributed is unavailable

__all__ = ["RULES", "Role", "enable", "row_op_strategies"]
