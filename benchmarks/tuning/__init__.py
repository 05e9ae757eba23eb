"""The sweeps whose results set shipped defaults (benchmarks/README.md)."""
