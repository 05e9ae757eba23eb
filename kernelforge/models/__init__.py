"""Example models built on kernelforge, each at five optimization levels (LEVELS): native
PyTorch, TorchScript, torch.compile, Triton kernels, CUDA kernels. The same weights give the
same outputs at every level, within the dtype's tolerance.

    from kernelforge.models import LanguageModel
    model = LanguageModel(vocab_size=256, dim=128, n_layers=2, n_heads=4, max_seq_len=256, level="triton")

The design documents' names are aliases: KernelOptimizedLanguageModel,
KernelOptimizedVisionTransformer, KernelOptimizedGraphNeuralNetwork.
"""
from kernelforge.models.language_model import LanguageModel, LanguageModelConfig
from kernelforge.models.levels import KERNELFORGE_LEVELS, LEVELS, LevelUnavailableError, why_level_unavailable
from kernelforge.models.transformer import BlockConfig, OptimizedTransformerBlock
from kernelforge.models.vision_transformer import VisionTransformer, VisionTransformerConfig

KernelOptimizedLanguageModel = LanguageModel
KernelOptimizedVisionTransformer = VisionTransformer

__all__ = ["BlockConfig", "KERNELFORGE_LEVELS", "KernelOptimizedLanguageModel", "KernelOptimizedVisionTransformer",
           "LEVELS", "LanguageModel", "LanguageModelConfig", "LevelUnavailableError", "OptimizedTransformerBlock",
           "VisionTransformer", "VisionTransformerConfig", "why_level_unavailable"]
