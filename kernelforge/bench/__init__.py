"""Benchmarking: timing primitives (the full harness grows here)."""
from kernelforge.bench.timing import Timing, time_function

__all__ = ["Timing", "time_function"]
