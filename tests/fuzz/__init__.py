"""Property-based fuzzing of every public op against a float64 oracle (hypothesis).

The default run (`pytest -m "not gpu"`) takes a short profile of a few examples an op; `pytest -m fuzz`
takes the long profile. See tests/fuzz/conftest.py.
"""
