"""Benchmark, tuning and diagnostic scripts (not part of the installed package; benchmarks/README.md).
A package so that a script can import another's helpers as benchmarks.tools.<name> (from the
repository root, or through the path the script itself adds)."""
