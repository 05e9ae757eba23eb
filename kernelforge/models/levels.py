"""The five optimization levels of the example models, and the kernels each one runs.

    native       PyTorch eager: F.linear, F.layer_norm / F.rms_norm, F.scaled_dot_product_attention
    torchscript  the native computation traced by torch.jit.trace, once per input signature
    compile      the native computation under torch.compile (Inductor)
    triton       kernelforge ops on their Triton kernels (fused bias + activation GEMMs, fused
                 residual add + norm, flash attention and flash-decoding, SwiGLU, cross-entropy, the
                 GNN's fused gather-scatter)
    cuda         kernelforge ops on their CUDA C++ kernels where kernelforge has them (GEMM,
                 norms, attention forward, activations); the measured choice for the rest
and a sixth, the fastest way kernelforge knows to run the model:
    fastest      torch.compile of the model with kernelforge's kernels where they win (traced into the
                 graph: Inductor launches their Triton kernels and fuses around them) and torch's
                 elsewhere (FastestKernels says which, and the measurement behind each: today only
                 the loss), captured in CUDA graphs (mode="reduce-overhead") on a GPU where the
                 model's CUDA_GRAPHS says so (all but the GNN, whose batches change shape; and not
                 a model sharded by FSDP2, which compiles layer by layer here and at the compile
                 level). As with any CUDA-graphed model, a call's outputs live in the graphs' memory
                 until the next call reuses it: clone what you keep across calls (reading a reused
                 output raises), and train with zero_grad(set_to_none=True)

Every level runs the same modules with the same parameters. A model's components call the few
functions that differ between levels through a kernel set (`TorchKernels` or
`KernelforgeKernels`) held in one `KernelChoice` that the whole model shares; the level picks
the kernel set and wraps the computation (tracing, compiling, or a backend preference).

The kernelforge levels set their backend with `kernelforge.prefer_backend` while the model runs.
Autograd runs the backward later, outside the model's call: train inside
`with model.kernel_scope():` (forward, loss and backward) for the backward ops to follow the
level too; outside it they take each op's measured default.

One model runs one call at a time: the kernel set is switched on the model for the length of a
call, so two threads calling the same model at once could see each other's switch (as the
backend preference, it is process-wide). A LevelledModel inside another is a component of the
outer one (it shares the outer KernelChoice); call its compute, not its forward, from the outer.
"""
from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Optional

import torch

from kernelforge import backends
from kernelforge.models.kernel_sets import (FASTEST_KERNELS, KERNELFORGE_KERNELS, TORCH_KERNELS, FastestKernels,
                                            KernelforgeKernels, TorchKernels)

LEVELS = ("native", "torchscript", "compile", "triton", "cuda")
FASTEST = "fastest"
# Beside the five: the fastest level (above), and "reference": kernelforge's ops on their
# pure-PyTorch reference implementations (what they run on a CPU). The reference level runs
# anywhere; the CPU tests train with it, as it exercises kernelforge's registered ops and their
# hand-written backward formulas.
EXTRA_LEVELS = (FASTEST, "reference")
# The levels that run kernelforge's ops eagerly, each on the backend of its name.
KERNELFORGE_LEVELS = ("triton", "cuda", "reference")


MAX_TRACES = 16  # traces a torchscript-level model keeps (one per input signature)


class LevelUnavailableError(RuntimeError):
    """A level that cannot run here (a GPU level without a GPU, a CUDA level without CUDA)."""


def why_level_unavailable(level: str, device: Optional[torch.device] = None) -> Optional[str]:
    """None when `level` can run on tensors of `device` (default: the GPU if there is one),
    else the reason in words."""
    check_level(level)
    if level not in KERNELFORGE_LEVELS or level == "reference":
        return None
    device = torch.device(device) if device is not None else _default_device()
    if level == "triton":
        from kernelforge.triton import why_unavailable

        why = why_unavailable(device)
        return None if why is None else f"the triton level runs Triton kernels: {why} (this is a {device} input)"
    if device.type != "cuda":
        return (f"the cuda level runs kernelforge's CUDA C++ kernels, which need a CUDA GPU and CUDA tensors "
                f"(this is a {device} input)")
    from kernelforge.cuda import why_unavailable as why_cuda_unavailable

    why = why_cuda_unavailable()
    return None if why is None else f"the cuda level needs the CUDA toolchain: {why}"


def check_level(level: str) -> str:
    if level not in LEVELS + EXTRA_LEVELS:
        raise ValueError(f"level must be one of {LEVELS + EXTRA_LEVELS}, got {level!r}")
    return level


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ----------------------------------------------------------------------------- kernel sets
class KernelChoice:
    """The kernel set a whole model uses right now (one object shared by its components)."""

    def __init__(self):
        self.ops = TORCH_KERNELS


class Component(torch.nn.Module):
    """A building block whose math goes through `self.kernels.ops`. Standalone it has its own
    KernelChoice; inside a LevelledModel it shares the model's."""

    def __init__(self):
        super().__init__()
        self.kernels = KernelChoice()


# ----------------------------------------------------------------------------- levels
class _KernelSet:
    """`with _KernelSet(choice, ops):` the model's KernelChoice set to the kernel set `ops` inside the
    block and put back after: a level's call (LevelledModel.run) and a checkpointed layer's
    recomputation. A class, not a generator: it runs on every model call."""

    __slots__ = ("choice", "ops", "saved")

    def __init__(self, choice: KernelChoice, ops):
        self.choice, self.ops = choice, ops

    def __enter__(self):
        self.saved, self.choice.ops = self.choice.ops, self.ops

    def __exit__(self, *exc):
        self.choice.ops = self.saved


class _Method(torch.nn.Module):
    """One method of a model as a module's forward (what torch.jit.trace and torch.compile take);
    the model is a submodule, so the traced or compiled graph uses its parameters."""

    def __init__(self, model: torch.nn.Module, method: str):
        super().__init__()
        self.model = model
        self.method = method

    def forward(self, *inputs):
        return getattr(self.model, self.method)(*inputs)


def _signature(inputs) -> tuple:
    """Shapes, dtypes, devices and grad flags, nested tuples and lists (a KV cache) included."""
    return tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) if isinstance(t, torch.Tensor)
                 else _signature(t) if isinstance(t, (tuple, list)) else t for t in inputs)


COMPILED_LEVELS = ("compile", FASTEST)  # the levels that compile a model fully_shard made layer by layer


def _is_fsdp_module(module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing fully_shard made
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def _sharded_by_fsdp(model) -> bool:
    """Whether fully_shard made any of the model's modules (70 us at 150 modules: run() asks once a
    level; shard a model before its first call at a compiled level, or set its level again)."""
    return any(map(_is_fsdp_module, model.modules()))


class LevelledModel(Component):
    """A model that runs at one of LEVELS. Subclasses compute in methods named by `run`;
    `forward` runs `compute` at the model's level."""

    # Methods the compile level compiles as one whole graph in CUDA graphs on a GPU, as the fastest
    # level compiles every method: a decode step (static shapes, called once a token, launch-bound).
    WHOLE_GRAPH_METHODS: tuple = ()
    # Models whose layers run through layer_call: each layer keeps only its input for the backward
    # and runs again there (set per instance)
    activation_checkpointing: bool = False
    # Whether those whole graphs are captured in CUDA graphs on a GPU, with static shapes (the
    # callers bucket them). A model whose inputs change shape from call to call and whose calls are
    # long enough to hide their launches gains nothing from graphs and pays a capture a shape.
    CUDA_GRAPHS: bool = True

    def _init_level(self, level: str) -> None:
        """Call at the end of a subclass's __init__: shares one KernelChoice with every
        component and sets the level."""
        for module in self.modules():
            if isinstance(module, Component):
                module.kernels = self.kernels
        self._wrapped: dict = {}
        self.set_level(level)

    @property
    def level(self) -> str:
        return self._level

    def set_level(self, level: str) -> "LevelledModel":
        """Switch levels (same parameters). Raises LevelUnavailableError when the level cannot run
        on this machine at all; a level that cannot take the inputs' device raises at the call."""
        check_level(level)
        if level in ("triton", "cuda") and not torch.cuda.is_available():
            why = why_level_unavailable(level, torch.device("cpu"))
            if why is not None:
                raise LevelUnavailableError(f"{type(self).__name__}(level={level!r}): no CUDA GPU is visible; {why}")
        self._level = level
        self._wrapped = {}
        self._sharded = None  # _compiles_layerwise's answer, asked again at a new level
        return self

    def layer_call(self, layer, x):
        """layer(x); with activation_checkpointing, while a gradient is computed (not tracing), under
        non-reentrant torch.utils.checkpoint. The recomputation runs in the backward, after run()
        put torch's kernel set back: it runs with the kernel set of the forward (and the backend
        preference of the backward's kernel_scope), so the activations it makes again are the
        forward's. Under torch.compile the compiler plans the recomputation inside the graph. At
        the compile and fastest levels a layer fully_shard made runs compiled on its own, its hooks
        outside the graph (_compiles_layerwise)."""
        call = layer
        # is_compiling first: inside a whole-model graph Dynamo need not trace the rest
        if not torch.compiler.is_compiling() and self._level in COMPILED_LEVELS and _is_fsdp_module(layer):
            call = self._wrapped.get(layer)
            if call is None:  # as nn.Module.compile() would, without setting it on the layer
                call = self._wrapped[layer] = torch.compile(layer._call_impl, fullgraph=self._level == FASTEST)
        if not (self.activation_checkpointing and torch.is_grad_enabled() and not torch.jit.is_tracing()):
            return call(x)
        from torch.utils.checkpoint import checkpoint

        if torch.compiler.is_compiling():
            return checkpoint(call, x, use_reentrant=False)
        ops = self.kernels.ops
        return checkpoint(call, x, use_reentrant=False,
                          context_fn=lambda: (contextlib.nullcontext(), _KernelSet(self.kernels, ops)))

    def _compiles_layerwise(self) -> bool:
        """Whether fully_shard made modules of this model, which then compiles layer by layer at the
        compile and fastest levels (layer_call; the rest of a method eagerly, no CUDA graphs: the
        all-gathered parameters are new tensors every step). Why: one graph of a whole method
        breaks at fully_shard's hooks, which Dynamo does not trace, inside a layer's call, where
        it cannot resume, and runs the method uncompiled (FSDP2 at the fastest level: 0.25x one
        GPU on two H200s)."""
        if self._sharded is None:
            self._sharded = _sharded_by_fsdp(self)
        return self._sharded

    def kernel_scope(self):
        """The backend preference of a kernelforge level (a null context at the other levels: the
        fastest level's choices are made when its graphs are traced). Wrap the training step in it so
        autograd's backward ops follow the level too."""
        if self._level in KERNELFORGE_LEVELS:
            return backends.prefer_backend(self._level)
        return contextlib.nullcontext()

    def kernelforge_patch(self) -> Optional[str]:
        """kernelforge.patch's hook: run on kernelforge's ops from now on. On a GPU that is the
        triton level (Triton kernels exist for every op the models use); on a CPU, where
        kernelforge's ops run their reference implementations, the reference level. None when
        the model is on kernelforge's ops already."""
        if self._level in KERNELFORGE_LEVELS:
            return None
        device = next(self.parameters()).device
        level = "triton" if device.type == "cuda" else "reference"
        self.set_level(level)
        return f"level set to {level!r} (its parameters are on {device.type})"

    def _compiled(self, method: str, inputs: tuple, whole: bool = False):
        """The compiled method: torch.compile's defaults at the compile level; `whole` (the fastest
        level, WHOLE_GRAPH_METHODS at the compile level) the whole method as one graph with static
        shapes (the callers bucket them), captured in CUDA graphs when it runs on a GPU.

        The bound method is compiled, not a wrapper module's forward: Dynamo keeps its compiled
        graphs per code object, and one wrapper's forward shared by every model and method would
        pile them all on one code object, where shapes seen before turn dynamic (a decode step then
        compiled with dynamic shapes) and past the recompile limit run uncompiled."""
        compiled = self._wrapped.get(method)
        if compiled is None:
            options = {}
            if whole:
                device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
                options = self.whole_graph_options(device)
            compiled = self._wrapped[method] = torch.compile(getattr(self, method), **options)
        return compiled

    def whole_graph_options(self, device: torch.device) -> dict:
        """torch.compile's options for a whole-graph method on `device`: one graph, and with
        CUDA_GRAPHS static shapes and, on a GPU, CUDA graphs (mode="reduce-overhead")."""
        if not self.CUDA_GRAPHS:
            return {"fullgraph": True}
        return {"fullgraph": True, "dynamic": False, **({"mode": "reduce-overhead"} if device.type == "cuda" else {})}

    def __getstate__(self):
        # traces and compiled graphs hold the model itself: a copy starts without them
        return {**self.__dict__, "_wrapped": {}, "_sharded": None}

    def forward(self, *inputs):
        return self.run("compute", *inputs)

    def run(self, method: str, *inputs):
        """self.<method>(*inputs) at the model's level."""
        level = self._level
        if level in KERNELFORGE_LEVELS:
            device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), None)
            why = why_level_unavailable(level, device)
            if why is not None:
                raise LevelUnavailableError(f"{type(self).__name__} at level {level!r}: {why}")
            with _KernelSet(self.kernels, KERNELFORGE_KERNELS), backends.prefer_backend(level):
                return getattr(self, method)(*inputs)
        if level == FASTEST:
            with _KernelSet(self.kernels, FASTEST_KERNELS):
                if self._compiles_layerwise():
                    return getattr(self, method)(*inputs)
                compiled = self._compiled(method, inputs, whole=True)
                if self.CUDA_GRAPHS and any(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs):
                    # each call a new step of the CUDA graphs: the last call's outputs may be reused
                    torch.compiler.cudagraph_mark_step_begin()
                return compiled(*inputs)
        self.kernels.ops = TORCH_KERNELS
        if level == "native" or (level == "compile" and self._compiles_layerwise()):
            return getattr(self, method)(*inputs)
        if level == "compile":
            return self._compiled(method, inputs, whole=method in self.WHOLE_GRAPH_METHODS)(*inputs)
        # torchscript: one trace per input signature (shapes, dtypes, mode), since a trace
        # records the shapes it saw; the per-shape retrace makes its shape warnings moot. The
        # parameters' identities are in the key too: a trace holds the tensors it saw, so after
        # load_state_dict(assign=True) or a replaced parameter it would run the old weights.
        key = (method, _signature(inputs), self.training, torch.is_grad_enabled(), tuple(map(id, self.parameters())))
        traced = self._wrapped.get(key)
        if traced is None:
            if len(self._wrapped) >= MAX_TRACES:  # e.g. one per prompt length: keep the newest
                del self._wrapped[next(iter(self._wrapped))]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                traced = self._wrapped[key] = torch.jit.trace(_Method(self, method), inputs, check_trace=False)
        return traced(*inputs)


__all__ = ["EXTRA_LEVELS", "FASTEST", "KERNELFORGE_LEVELS", "LEVELS", "Component", "FastestKernels", "KernelforgeKernels",
           "LevelUnavailableError", "LevelledModel", "TorchKernels", "why_level_unavailable"]
