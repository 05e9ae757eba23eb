"""Example models built on kernelforge, each at five optimization levels (LEVELS): native
PyTorch, TorchScript, torch.compile, Triton kernels, CUDA kernels; and at the fastest level
(FASTEST: torch.compile with kernelforge's kernels where they win, in CUDA graphs). The same
weights give the same outputs at every level, within the dtype's tolerance.

    from kernelforge.models import LanguageModel
    model = LanguageModel(vocab_size=256, dim=128, n_layers=2, n_heads=4, max_seq_len=256, level="triton")
    gnn = GraphNeuralNetwork(node_features=64, hidden=128, num_classes=10, layers=3, aggregation="mean")
    logits = gnn(x, edge_index, batch)    # (N, 64), (2, E) [source, target], (N,) -> (graphs, 10)

Aliases kept from the earlier API: KernelOptimizedLanguageModel,
KernelOptimizedVisionTransformer, KernelOptimizedGraphNeuralNetwork. Their demo entry point,
run_progressive_optimization_demo, is kernelforge.demo's (which imports this package).
"""
from kernelforge.models.graph_neural_network import GraphNeuralNetwork, GraphNeuralNetworkConfig
from kernelforge.models.language_model import LanguageModel, LanguageModelConfig
from kernelforge.models.levels import (EXTRA_LEVELS, FASTEST, KERNELFORGE_LEVELS, LEVELS, LevelUnavailableError,
                                      why_level_unavailable)
from kernelforge.models.transformer import BlockConfig, OptimizedTransformerBlock
from kernelforge.models.vision_transformer import VisionTransformer, VisionTransformerConfig

KernelOptimizedLanguageModel = LanguageModel
KernelOptimizedVisionTransformer = VisionTransformer
KernelOptimizedGraphNeuralNetwork = GraphNeuralNetwork

__all__ = ["BlockConfig", "EXTRA_LEVELS", "FASTEST", "GraphNeuralNetwork", "GraphNeuralNetworkConfig", "KERNELFORGE_LEVELS",
           "KernelOptimizedGraphNeuralNetwork", "KernelOptimizedLanguageModel", "KernelOptimizedVisionTransformer",
           "LEVELS", "LanguageModel", "LanguageModelConfig", "LevelUnavailableError", "OptimizedTransformerBlock",
           "VisionTransformer", "VisionTransformerConfig", "why_level_unavailable"]
