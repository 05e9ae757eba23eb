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

# Development containers: Dockerfile (GPU image), Dockerfile.cpu (CPU image), docker-compose.yml
# (their services, which mount this checkout). `make setup` builds the image this machine can run;
# then `make dev` / `make jupyter` (GPU) or `make dev-cpu` / `make jupyter-cpu` (CPU): a shell, or
# Jupyter Lab on port 8888 with TensorBoard on 6006. DOCKER_COMPOSE: another compose command.
.PHONY: setup dev jupyter dev-cpu jupyter-cpu
DOCKER_COMPOSE ?= docker compose
# the images' user gets your uid and gid, so what a container writes in the checkout stays yours
COMPOSE := USER_UID=$$(id -u) USER_GID=$$(id -g) $(DOCKER_COMPOSE)

# An NVIDIA GPU that nvidia-smi lists ("GPU 0: ...") means the GPU image, anything else the CPU one.
# (Running the GPU image also needs the NVIDIA Container Toolkit.)
setup:
	@if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then \
		echo "setup: nvidia-smi lists an NVIDIA GPU: building the GPU image (Dockerfile) for make dev / make jupyter"; \
		$(COMPOSE) build dev; \
	else \
		echo "setup: no NVIDIA GPU listed by nvidia-smi: building the CPU image (Dockerfile.cpu) for make dev-cpu / make jupyter-cpu"; \
		$(COMPOSE) build dev-cpu; \
	fi

dev:
	$(COMPOSE) run --rm dev

jupyter:
	$(COMPOSE) up jupyter

dev-cpu:
	$(COMPOSE) run --rm dev-cpu

jupyter-cpu:
	$(COMPOSE) up jupyter-cpu
