"""Ahead-of-time builds of the CUDA extensions (KERNELFORGE_BUILD_CUDA=1 pip install ..., see
setup.py): <name>.<abi>.so with <name>.json, the record of what it was built from. Empty in a
plain install; kernelforge.cuda.compiler loads a library from here when its record matches
this process, else builds the extension JIT."""
