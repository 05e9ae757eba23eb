"""Diagnostics a developer runs again (benchmarks/README.md)."""
