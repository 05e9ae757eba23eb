# The two commands: `make demo` (the main job) and `make test` (the CPU suite).
# Each builds its own virtual environment on first use; nothing is installed globally.
PYTHON ?= python3
VENV   ?= .venv
# A CPU machine must not pull a CUDA build of torch: pin the release whose CPU wheel is
# on our machines. On a GPU machine, point TORCH_SPEC at the CUDA build you want.
TORCH_SPEC ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kernelforge-installed

.PHONY: demo test test-gpu bench doctor build clean

$(STAMP): pyproject.toml requirements-test.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -r requirements-test.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

demo: $(STAMP)
	$(BIN)/kernelforge demo

# CPU suite: Triton kernels run through Triton's interpreter; .cu files compile with nvcc if present.
test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not gpu"

# GPU suite, on a machine with a CUDA GPU and a CUDA build of torch.
test-gpu:
	python3 -m pytest -q -m gpu

doctor: $(STAMP)
	$(BIN)/kernelforge doctor

clean:
	rm -rf $(VENV) build *.egg-info
