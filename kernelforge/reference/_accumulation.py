"""The precision every reference accumulates in: float64 for float64 inputs, float32 for the rest
(float32, float16, bfloat16), rounding once to the output's dtype as a fused kernel does."""
import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32
