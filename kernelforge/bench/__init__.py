"""Benchmarking and profiling: the one harness every performance claim comes from.

    from kernelforge.bench import benchmark_kernel, compare_implementations, quick_benchmark
    from kernelforge.bench import KernelProfiler, profile_model_inference
    `kernelforge bench softmax --dtype bf16 --out results/`  (the command line)
"""
from kernelforge.bench.profiler import InferenceReport, KernelProfiler, profile_model_inference
from kernelforge.bench.roofline import Ceilings, Cost, get_ceilings, measure_ceilings, roofline
from kernelforge.bench.timing import Timing, benchmark_kernel, compare_implementations, quick_benchmark, time_function

__all__ = ["Ceilings", "Cost", "InferenceReport", "KernelProfiler", "Timing", "benchmark_kernel",
           "compare_implementations", "get_ceilings", "measure_ceilings", "profile_model_inference",
           "quick_benchmark", "roofline", "time_function"]
