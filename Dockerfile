# GPU development image: the CUDA toolkit with nvcc (kernelforge compiles its CUDA C++ kernels on
# first use), Python 3.12, a CUDA build of torch, Triton, Jupyter Lab, TensorBoard, and this
# checkout installed the way the Makefile installs it. docker-compose.yml builds it (services dev
# and jupyter: `make setup`, `make dev`, `make jupyter`) and mounts the checkout over /workspace,
# where the editable install points, so the container imports the host's working tree.
#
# The defaults are what the GPU suite runs (README, "Compatibility"): torch 2.11's CUDA 13.0 build,
# which pins requirements-test.txt's Triton (3.6.0), on Ubuntu 24.04's Python 3.12. Another torch:
# --build-arg TORCH_VERSION=X.Y.Z (a release the index has; from 2.12 on, torch pins a newer Triton,
# which requirements-test.txt's pin then replaces, with a warning from pip). Another CUDA: change
# the FROM line and TORCH_INDEX_URL together (cu128 with 12.8): nvcc must match torch's CUDA.
FROM nvidia/cuda:13.0.2-devel-ubuntu24.04

ARG DEBIAN_FRONTEND=noninteractive
# build-essential: the host compiler for nvcc, Triton's launcher stubs and torch.compile;
# python3-dev: the headers those stubs include; git: benchmark reports name the commit
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        build-essential ca-certificates git python3 python3-dev python3-venv \
    && rm -rf /var/lib/apt/lists/*

# A non-root user with the host user's uid/gid (the Makefile passes `id -u` / `id -g`), so what the
# container writes into the mounted checkout stays the host user's. Ubuntu's own user holds 1000,
# the usual host uid: it goes. -o: a gid may still be taken (macOS's staff group, 20, is Debian's
# dialout). ~/.cache is made now, before docker-compose.yml mounts a volume on it, so that the
# volume belongs to the user.
ARG USER_UID=1000
ARG USER_GID=1000
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && groupadd -o -g "$USER_GID" dev \
    && useradd -l -o -m -u "$USER_UID" -g "$USER_GID" -s /bin/bash dev \
    && mkdir -p /opt/venv /workspace /home/dev/.cache \
    && chown dev:dev /opt/venv /workspace /home/dev/.cache
USER dev

# PYTHON, VENV and TORCH_SPEC are the Makefile's variables: `make test` or `make demo` in the
# container finds the environment installed below (its stamp is touched last) and reuses it.
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ENV PYTHON=/usr/bin/python3 \
    VENV=/opt/venv \
    TORCH_SPEC=torch==$TORCH_VERSION \
    PIP_NO_CACHE_DIR=1
ENV PATH=$VENV/bin:$PATH
WORKDIR /workspace

# The Makefile's install steps in its order (pip pinned here, for a repeatable image), torch from
# the index of its CUDA build; the checkout is copied last, so that editing it reinstalls nothing
# but the package itself
RUN "$PYTHON" -m venv "$VENV" \
    && python -m pip install -q --upgrade pip==26.3 \
    && python -m pip install -q --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
COPY --chown=dev:dev requirements-test.txt ./
# then the tools of docker-compose.yml's jupyter service (the tests do not need them)
RUN python -m pip install -q -r requirements-test.txt \
    && python -m pip install -q jupyterlab==4.6.6 tensorboard==2.21.0
COPY --chown=dev:dev . .
RUN python -m pip install -q --no-deps --no-build-isolation -e . \
    && touch "$VENV/.kernelforge-installed"

CMD ["bash"]
