"""Eager plans: an op's calls at one signature replayed from a recording of an earlier call.

A plain eager call of a kernelforge op runs Python on every call: the checks, the backend choice,
the row views, the allocation of the output, the Triton launch's argument binding. For a small
input that Python is the call's cost (silu at 16 x 4096 took 50 us of host time on an H200 host,
torch.nn.functional.silu 10). All of it depends only on the call's signature: the inputs' dtypes,
shapes, strides, devices and 16-byte alignment, the other arguments' values, and a little global
state (the forced and preferred backend, what ops register with add_state). So each op keeps, per
signature, what its implementation did:

- the first call at a signature runs as it always does (it may compile, autotune or build);
- the second is recorded: a TorchDispatchMode sees every torch op the implementation runs, and
  kernelforge.triton._launch.launch reports every Triton launch with its arguments;
- from the third on, the recording is replayed: the same allocations (the outputs in their final
  shapes and strides), zero-fills and launches, with the pointers of this call's tensors, through
  the compiled kernels' C launchers. Nothing else runs.

A recording becomes a plan only when the implementation did nothing a replay would miss: every
torch op it ran was an allocation (empty, zeros), a fill of what it allocated, or a view; every
kernel was a Triton launch whose tensor arguments lie in an input or in an allocation of the call
(pointers are re-derived as input pointer + offset); it called no CUDA C++ extension (their
launches are invisible to both probes; every call of one looks its module up through
kernelforge.cuda.compiler's load, which tells the recording); every output is (a view of) something it allocated. Anything else -- a copy, a
cuBLAS matmul, an .item(), an input's memory reached through two inputs that share it -- leaves
the signature without a plan (`why`), and its calls run the implementation as before. The
reference backend's torch ops are not replayed (it is the CPU path, where torch's own dispatch is
the cost anyway).

What the implementation checks holds on a replay because the checks see only the signature: a
check that reads values (an index range) needs an .item() or a device assertion, and the first
is not replayable. Plans are kept per op and dropped when an op has _MAX_PLANS signatures (a model
fed ever new shapes), and all at once when backends forget their choices.

Replayed launches go through the C launcher directly (kernelforge.triton._launch's entries), host
TMA descriptors re-made at the call's addresses; under Triton's interpreter (the CPU test suite) and
for kernels the direct path does not take (autotuned ones), kernel[grid](...) is called with views
rebuilt on this call's memory. With several GPUs a replay makes its launches' device current.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

_TENSORS = (torch.Tensor, torch.nn.Parameter)
# Launch arguments a replay passes as they were: values, fixed by the signature.
_CONSTANTS = (int, float, bool, str, type(None), torch.dtype)
MAX_PLANS = 4096  # signatures kept per op before its plans are dropped

_aten = torch.ops.aten
# Allocations a replay repeats (their outputs are uninitialized, or zeros: value below).
_EMPTY = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default, _aten.new_empty.default,
          _aten.new_empty_strided.default}
_FILLED = {_aten.zeros.default: lambda args: 0, _aten.zeros_like.default: lambda args: 0,
           _aten.new_zeros.default: lambda args: 0, _aten.ones.default: lambda args: 1,
           _aten.ones_like.default: lambda args: 1, _aten.new_ones.default: lambda args: 1,
           _aten.full.default: lambda args: args[1], _aten.full_like.default: lambda args: args[1],
           _aten.new_full.default: lambda args: args[2]}
_FILLS = {_aten.zero_.default: lambda args: 0, _aten.fill_.Scalar: lambda args: args[1]}
# Ops that change no memory and are not views by their schema (set_ points a tensor at a storage).
_METADATA = {_aten.set_.source_Storage_storage_offset, _aten.set_.source_Storage}

# Global state implementations read (besides the backend selection): readers added by add_state.
_state_readers: list[Callable[[], object]] = []
# Recordings in progress anywhere (a plain list read keeps the no-recording check cheap), and the
# one of this thread.
_active = [0]
_active_lock = threading.Lock()
_enabled = [True]  # disabled() turns replays off
_local = threading.local()


def enabled() -> bool:
    """Whether ops replay their plans (not inside disabled(), not while any thread records)."""
    return _enabled[0] and not _active[0]


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Inside the block every op call runs its implementation (nothing is recorded or replayed):
    for code that watches or swaps an implementation's Python (a test's spy, a profiler's
    wrapper), which a replay does not run. Process-wide, like kernelforge.use_backend."""
    previous = _enabled[0]
    _enabled[0] = False
    try:
        yield
    finally:
        _enabled[0] = previous


def add_state(reader: Callable[[], object]) -> None:
    """Register global state an op's implementation reads (its value becomes part of every plan's
    signature): a precision policy, torch.backends flags, torch.are_deterministic_algorithms_enabled."""
    if reader not in _state_readers:
        _state_readers.append(reader)


def remove_state(reader: Callable[[], object]) -> None:
    """Undo add_state(reader)."""
    _state_readers.remove(reader)


def state() -> tuple:
    return tuple([read() for read in _state_readers])


def recording():
    """The recording in progress on this thread, or None."""
    return getattr(_local, "recording", None) if _active[0] else None


def signature(args, global_state, tensors: list) -> tuple:
    """What fixes everything an implementation does on the host: tensors by dtype, shape, strides,
    device and address mod 16 (kernels are specialized on 16-byte alignment, and an offset view's
    alignment follows its base's), lists elementwise, anything else by value. The tensors are
    appended to `tensors`, in order: a plan's inputs."""
    key = [global_state]
    append = key.append
    for arg in args:
        kind = type(arg)
        if kind in _TENSORS:
            append((arg.dtype, arg.shape, arg.stride(), arg.get_device(), arg.data_ptr() & 15))
            tensors.append(arg)
        elif kind is list or kind is tuple:
            append(signature(arg, None, tensors))
        else:
            append(arg)
    return tuple(key)


class NoPlan:
    """A signature whose calls run the implementation: why it was not made a plan."""

    def __init__(self, why: str):
        self.why = why

    def __repr__(self) -> str:
        return f"NoPlan({self.why!r})"


SEEN_ONCE = NoPlan("seen once: the next call at this signature is recorded")


def _extent_bytes(shape, stride, itemsize: int) -> int:
    """Bytes from a tensor's first element to the end of its last (0 when empty)."""
    if 0 in shape:
        return 0
    return (sum((size - 1) * step for size, step in zip(shape, stride)) + 1) * itemsize


class _Recording(TorchDispatchMode):
    """Watches one implementation call: its torch ops, allocations and launches (module docstring)."""

    def __init__(self, inputs: list):
        super().__init__()
        self.inputs = inputs
        self.allocs: list[torch.Tensor] = []
        self.steps: list[tuple] = []
        self.why_not: Optional[str] = None

    def fail(self, why: str) -> None:
        if self.why_not is None:
            self.why_not = why
            # Nothing of this call will be replayed: its allocations are let go now, not at the end
            # of the call, which would keep the implementation's transient buffers alive until then
            # (the fused linear cross-entropy's logits chunks, 0.5 GiB each at a 128k vocabulary,
            # lifted a Llama-3.2-1B step's peak by 1 GiB at its second call), and no more are kept.
            self.allocs.clear()
            self.steps.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.why_not is not None:  # failed: watched no further
            return out
        if func in _EMPTY:
            if out.untyped_storage().nbytes():  # no_view's new_empty(0), set_ on an allocation next
                self.allocs.append(out)
        elif func in _FILLED:
            if out.untyped_storage().nbytes():
                self.allocs.append(out)
                self.steps.append(("fill", self._place(out), _FILLED[func](args)))
        elif func in _FILLS:
            self.steps.append(("fill", self._place(args[0]), _FILLS[func](args)))
        elif not (func.is_view or func in _METADATA):
            self.fail(f"it runs {func} (a replay repeats allocations, fills, views and Triton launches only)")
        return out

    # where a tensor lives: (source index, byte offset from the source's pointer); sources are the
    # inputs, then the allocations
    def _source(self, t: torch.Tensor) -> Optional[tuple[int, int]]:
        storage, ptr = t.untyped_storage().data_ptr(), t.data_ptr()
        for j, alloc in enumerate(self.allocs):
            if alloc.untyped_storage().data_ptr() == storage:
                return len(self.inputs) + j, ptr - storage
        end = ptr + _extent_bytes(t.shape, t.stride(), t.element_size())
        sharing = [i for i, x in enumerate(self.inputs) if x.untyped_storage().data_ptr() == storage]
        def holds(x):  # t's bytes lie inside input x's
            start = x.data_ptr()
            return start <= ptr and end <= start + _extent_bytes(x.shape, x.stride(), x.element_size())

        within = [i for i in sharing if holds(self.inputs[i])]
        if len(sharing) == 1 or len(within) == 1:
            i = sharing[0] if len(sharing) == 1 else within[0]
            return i, ptr - self.inputs[i].data_ptr()
        self.fail("a launch argument lies in no input or allocation of the call, or in inputs that share memory"
                  if not within else "a launch argument lies in two inputs that share memory")
        return None

    def _place(self, t: torch.Tensor):
        """((source, byte offset), dtype, shape, strides) of a tensor the call allocated, for a fill."""
        source = self._source(t)
        if source is not None and source[0] < len(self.inputs):
            self.fail("it writes into an input")
        return source, t.dtype, tuple(t.shape), t.stride()

    def unwatched(self):
        """A block whose torch ops are not the implementation's (Triton's own, inside a launch)."""
        return _disable_current_modes()

    # ------------------------------------------------------------------ launches (from triton._launch)
    def direct_launch(self, entry: tuple, device: int, grid: tuple, args: tuple, kwargs: dict) -> None:
        """A launch through the compiled kernel's launcher on CUDA device `device`: entry = (run,
        function, metadata, tail) of kernelforge.triton._launch (tail: the keyword arguments' values)."""
        if self.why_not is not None or not self._constant_keywords(kwargs):
            return
        spec, descriptors = [], []
        for position, arg in enumerate(args):
            if type(arg) in _TENSORS:
                source = self._source(arg)
                if source is None:
                    return
                spec.append((source[0], source[1], None))
            elif type(arg) in _CONSTANTS:
                spec.append((-1, 0, arg))
            elif type(arg).__name__ == "TensorDescriptor" and type(getattr(arg, "base", None)) in _TENSORS:
                # a host TMA descriptor: the launcher encodes it from base's address, shape, strides and
                # padding on every launch, so a replay passes the same fields at this call's address
                source = self._source(arg.base)
                if source is None:
                    return
                spec.append((-1, 0, None))
                descriptors.append((position, source[0], source[1], _Descriptor(arg)))
            else:
                return self.fail(f"a launch argument is a {type(arg).__name__}")
        grid3 = (*grid, 1, 1)[:3]
        self.steps.append(("direct", entry, grid3, tuple(spec), tuple(descriptors), device))

    def triton_launch(self, kernel, grid, args: tuple, kwargs: dict) -> None:
        """A launch through kernel[grid](...) (the interpreter, an autotuner): replayed the same way,
        on views rebuilt on the call's memory."""
        if self.why_not is not None or not self._constant_keywords(kwargs):
            return
        spec = []
        for arg in args:
            if type(arg) in _TENSORS:
                source = self._source(arg)
                if source is None:
                    return
                if source[1] % arg.element_size():
                    return self.fail("a launch argument is not aligned to its element size within its source")
                spec.append((source[0], (source[1], arg.dtype, tuple(arg.shape), arg.stride()), None))
            elif type(arg) in _CONSTANTS:
                spec.append((-1, None, arg))
            else:
                return self.fail(f"a launch argument is a {type(arg).__name__}")
        self.steps.append(("triton", kernel, grid, tuple(spec), dict(kwargs)))

    def _constant_keywords(self, kwargs: dict) -> bool:
        for name, value in kwargs.items():
            if type(value) not in _CONSTANTS:
                self.fail(f"a launch's keyword argument {name} is a {type(value).__name__}")
                return False
        return True

    # ------------------------------------------------------------------ the plan
    def plan(self, outputs) -> "Plan | NoPlan":
        if self.why_not is not None:
            return NoPlan(self.why_not)
        flat = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        if not all(type(o) in _TENSORS for o in flat):
            return NoPlan("an output is not a tensor")
        out_specs = []
        for o in flat:
            if o.numel() == 0:  # no memory: made anew, of its dtype, shape and strides
                out_specs.append((None, 0, o.dtype, tuple(o.shape), o.stride(), o.device))
                continue
            source = self._source(o)
            if source is None or source[0] < len(self.inputs):
                return NoPlan("an output is not memory the call allocated")
            out_specs.append((source[0] - len(self.inputs), source[1], o.dtype, tuple(o.shape), o.stride(), o.device))
        if len({step[-1] for step in self.steps if step[0] == "direct"}) > 1:
            self.fail("it launches on two devices")
        if self.why_not is not None:
            return NoPlan(self.why_not)
        return Plan(self, out_specs, type(outputs) if isinstance(outputs, (tuple, list)) else None)


class _Address:
    """A device address where Triton's launcher asks a tensor for one (data_ptr())."""
    __slots__ = ("address",)

    def __init__(self, address: int):
        self.address = address

    def data_ptr(self) -> int:
        return self.address


class _Descriptor:
    """A host TMA descriptor's fields (Triton's or Gluon's TensorDescriptor) without its tensor:
    at(address) is the same descriptor on the memory at `address`."""
    __slots__ = ("base", "shape", "strides", "block_shape", "padding", "layout")

    def __init__(self, descriptor):
        self.base = None
        self.shape, self.strides = list(descriptor.shape), list(descriptor.strides)
        self.block_shape, self.padding = list(descriptor.block_shape), descriptor.padding
        self.layout = getattr(descriptor, "layout", None)

    def at(self, address: int) -> "_Descriptor":
        placed = object.__new__(_Descriptor)
        placed.shape, placed.strides, placed.block_shape = self.shape, self.strides, self.block_shape
        placed.padding, placed.layout, placed.base = self.padding, self.layout, _Address(address)
        return placed


def _view(base: torch.Tensor, byte_offset: int, dtype, shape, stride) -> torch.Tensor:
    """A tensor of (dtype, shape, stride) at byte_offset from base's pointer, on base's memory (not a
    view as autograd sees one)."""
    offset = base.storage_offset() * base.element_size() + byte_offset
    return base.new_empty(0, dtype=dtype).set_(base.untyped_storage(), offset // dtype.itemsize, shape, stride)


class Plan:
    """A recorded call, replayed by run(inputs) with this call's tensors (module docstring)."""

    def __init__(self, recording: _Recording, out_specs: list, container):
        n_inputs = len(recording.inputs)
        self.container = container
        # An allocation an output covers exactly (the common case) is made in the output's shape
        # and strides and returned as it is; others are made flat and outputs viewed on them.
        self.makers, self.outputs = [], []
        exact = {}
        for k, (j, byte_offset, dtype, shape, stride, _) in enumerate(out_specs):
            if j is None:
                continue
            alloc = recording.allocs[j]
            if (j not in exact and byte_offset == 0 and dtype == alloc.dtype
                    and _extent_bytes(shape, stride, dtype.itemsize) == alloc.untyped_storage().nbytes()):
                exact[j] = k
        for j, alloc in enumerate(recording.allocs):
            device = alloc.device
            if j in exact:
                _, _, dtype, shape, stride, _ = out_specs[exact[j]]
                self.makers.append((torch.empty_strided, (shape, stride), {"dtype": dtype, "device": device}))
            else:
                elements = alloc.untyped_storage().nbytes() // alloc.element_size()
                self.makers.append((torch.empty, (elements,), {"dtype": alloc.dtype, "device": device}))
        for k, (j, byte_offset, dtype, shape, stride, device) in enumerate(out_specs):
            if j is None:  # an empty output: made as it was, on no memory of the call
                self.makers.append((torch.empty_strided, (shape, stride), {"dtype": dtype, "device": device}))
                self.outputs.append((n_inputs + len(self.makers) - 1, None))
            else:
                self.outputs.append((n_inputs + j, None) if exact.get(j) == k else
                                    (n_inputs + j, (byte_offset, dtype, shape, stride)))
        self.steps = [self._step(step) for step in recording.steps]
        self.needs_pointers = any(step[0] == "direct" for step in recording.steps)
        self._replay = self._one_launch(recording.steps, n_inputs) or self._replay_any
        # Triton launches on the current device: with several GPUs a replay makes the launches' own
        # device current where it is not (the implementation did, through on_device)
        devices = {step[-1] for step in recording.steps if step[0] == "direct"}
        self.device = devices.pop() if len(devices) == 1 and torch.cuda.device_count() > 1 else None

    @staticmethod
    def _step(step: tuple) -> Callable:
        kind = step[0]
        if kind == "fill":
            (source, byte_offset), dtype, shape, stride = step[1]
            value = step[2]

            def fill(tensors, pointers):
                _view(tensors[source], byte_offset, dtype, shape, stride).fill_(value)
            return fill
        if kind == "direct":
            (run, function, metadata, tail), (grid_x, grid_y, grid_z), spec, descriptors, device = step[1:]
            raw_stream = torch._C._cuda_getCurrentRawStream
            if not descriptors:
                def direct(tensors, pointers):
                    run(grid_x, grid_y, grid_z, raw_stream(device), function, metadata, None, None, None,
                        *[pointers[i] + d if i >= 0 else v for i, d, v in spec], *tail)
                return direct

            def direct_with_descriptors(tensors, pointers):
                args = [pointers[i] + d if i >= 0 else v for i, d, v in spec]
                for position, i, d, descriptor in descriptors:
                    args[position] = descriptor.at(pointers[i] + d)
                run(grid_x, grid_y, grid_z, raw_stream(device), function, metadata, None, None, None, *args, *tail)
            return direct_with_descriptors
        kernel, grid, spec, kwargs = step[1:]

        def triton(tensors, pointers):
            kernel[grid](*[_view(tensors[i], *where) if i >= 0 else v for i, where, v in spec], **kwargs)
        return triton

    def __repr__(self) -> str:
        return f"Plan({len(self.makers)} allocations, {len(self.steps)} steps, {len(self.outputs)} outputs)"

    def _one_launch(self, steps: list, n_inputs: int) -> Optional[Callable]:
        """The replay of the common plan, one output allocated in its shape and one direct launch (an
        elementwise op, a norm's forward): no list of tensors or outputs built around them."""
        if (len(self.makers) != 1 or self.outputs != [(n_inputs, None)] or self.container is not None
                or len(steps) != 1 or steps[0][0] != "direct"):
            return None
        (make, make_args, make_kwargs), launch = self.makers[0], self.steps[0]

        def replay(inputs):
            out = make(*make_args, **make_kwargs)
            pointers = [t.data_ptr() for t in inputs]
            pointers.append(out.data_ptr())
            launch(None, pointers)
            return out
        return replay

    def run(self, inputs: list):
        if self.device is not None and torch.cuda.current_device() != self.device:
            with torch.cuda.device(self.device):
                return self._replay(inputs)
        return self._replay(inputs)

    def _replay_any(self, inputs: list):
        tensors = inputs + [make(*a, **kw) for make, a, kw in self.makers]
        pointers = [t.data_ptr() for t in tensors] if self.needs_pointers else None
        for step in self.steps:
            step(tensors, pointers)
        outputs = [tensors[j] if where is None else _view(tensors[j], *where) for j, where in self.outputs]
        return outputs[0] if self.container is None else self.container(outputs)


NOTHING_TO_REPLAY = NoPlan("no Triton kernel can run on these tensors (CUDA, or CPU under Triton's interpreter): "
                           "the implementation runs torch ops, which a plan does not replay")


def _triton_can_run(inputs: list) -> bool:
    from kernelforge.triton import interpreter_enabled

    return any(t.is_cuda for t in inputs) or (interpreter_enabled() and any(t.device.type == "cpu" for t in inputs))


def record(impl: Callable, args: tuple, inputs: list):
    """(impl(*args), its Plan or NoPlan): the call, run under a recording. Not where no launch can
    happen (a CPU without Triton's interpreter, MPS): a recording would find nothing to replay,
    and entering its dispatch mode the first time imports torch._dynamo (about a second on a CPU,
    at an op's second call)."""
    if not _triton_can_run(inputs):
        return impl(*args), NOTHING_TO_REPLAY
    rec = _Recording(inputs)
    with _active_lock:
        _active[0] += 1
    _local.recording = rec
    try:
        with rec:
            outputs = impl(*args)
    finally:
        _local.recording = None
        with _active_lock:
            _active[0] -= 1
    return outputs, rec.plan(outputs)


__all__ = ["MAX_PLANS", "NOTHING_TO_REPLAY", "NoPlan", "Plan", "SEEN_ONCE", "add_state", "disabled", "enabled", "record", "recording",
           "remove_state", "signature", "state"]
