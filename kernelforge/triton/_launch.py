"""Launch helpers shared by the Triton op modules: the launch itself (`launch`), warps per
program, the device guard, the SM count that sizes persistent grids, and the device's compute
capability."""
from __future__ import annotations

import functools

import torch

from kernelforge._eager_plans import recording


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host integers, as triton.cdiv computes it. Triton 3.6 makes triton.cdiv
    and triton.next_power_of_2 ConstexprFunctions: ~2 us a call on the host (argument
    unwrapping), nine of them were a fifth of a decode call's host time."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0), as triton.next_power_of_2 gives it, in
    plain Python (see cdiv)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def warps_for(elements: int) -> int:
    """Warps for a program that holds `elements` values: about 32 a thread. The H200
    softmax sweep's best (or within noise of it) at 1024, 4096 and 16384 columns;
    32768 elements take 32 warps, the most a program may have."""
    for warps in (4, 8, 16):
        if elements <= warps * 32 * 32:
            return warps
    return 32


@functools.lru_cache(maxsize=None)
def gluon_module(module: str):
    """kernelforge.triton.<module> (a Gluon kernel's module: attention_gluon, gemm_gluon, ...), or
    None where this Triton has no Gluon for Hopper; looked up once (import_module costs ~1 us a
    call)."""
    import importlib
    try:
        return importlib.import_module(f"kernelforge.triton.{module}")
    except ImportError:
        return None


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def device_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device, cached: torch.cuda.get_device_capability costs ~9 us
    of host time a call, a tenth of a small GEMM's."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; on the CPU (Triton's interpreter runs one
    program at a time) a small stand-in, so persistent grids still cover several programs."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# Zeroed int32 counters, one buffer per (device, stream): the split-K kernels set every count they
# use back to zero before they end, so launches in one stream (which run one after another)
# share a buffer without a memset, and streams never share one.
_COUNTERS: dict = {}


def zeroed_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` int32 zeros on `device` for the current stream, to be left zero by the
    kernel that uses them (split-K's arrival counts)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # a buffer of this graph's own, zeroed on each replay: torch.cuda.graph captures every graph
        # on one stream, and graphs replay on any stream, so a cached one could be shared or stale
        return torch.zeros(count, device=device, dtype=torch.int32)
    # the raw stream, as launch reads it: torch.cuda.current_stream costs ~7 us
    key = (device, torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0)
    counts = _COUNTERS.get(key)
    if counts is None or counts.numel() < count:
        counts = torch.zeros(max(count, 4096), device=device, dtype=torch.int32)
        _COUNTERS[key] = counts
    return counts


@functools.lru_cache(maxsize=None)
def _several_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 1


class on_device:
    """Make x's device current for the launch when it is not (Triton launches on the
    current device); costs nothing in the common case. With one GPU (the device count is read
    once) every CUDA tensor is on the current device: no check at all."""

    def __init__(self, x: torch.Tensor):
        self.guard = None
        if _several_gpus() and x.is_cuda and x.get_device() != torch.cuda.current_device():
            self.guard = torch.cuda.device(x.device)

    def __enter__(self):
        if self.guard is not None:
            self.guard.__enter__()

    def __exit__(self, *exc):
        if self.guard is not None:
            self.guard.__exit__(*exc)


# ----------------------------------------------------------------------------- launch
class _NotDirect(Exception):
    """An argument whose specialization `_spec` does not know: launch through Triton."""


def _spec(arg):
    """What Triton specializes a kernel on for one non-constexpr argument, or finer: an int's
    == 1 (a constant), % 16 == 0 and width class; a tensor's dtype and 16-byte alignment; a
    float's or bool's type; a host TMA descriptor's dtype, block shape and padding. Anything
    else is not keyed here."""
    if type(arg) is int:
        return arg == 1, arg % 16 == 0, -0x80000000 <= arg <= 0x7FFFFFFF, arg > 0x7FFFFFFFFFFFFFFF
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if arg is None or type(arg) is float or type(arg) is bool:
        return type(arg)
    if type(arg).__name__ == "TensorDescriptor" and isinstance(getattr(arg, "base", None), torch.Tensor):
        # a Gluon descriptor also carries its shared-memory layout, part of the kernel's type
        return "tensordesc", arg.base.dtype, tuple(arg.block_shape), arg.padding, getattr(arg, "layout", None)
    raise _NotDirect


# (kernel, device, keyword arguments, _spec of each positional argument) -> (the compiled
# kernel's launcher, its CUfunction, packed metadata, the values of the parameters after the
# positional ones, in signature order): one entry per specialization.
_COMPILED: dict = {}
# The same entries by _key (ints by value): what a call looks up first, as forming that key costs
# one append an argument where _spec's costs a tuple of four tests an int. Cleared when it reaches
# _MAX_BY_VALUE keys (a kernel called at ever new sizes would grow it without end); _COMPILED stays.
_BY_VALUE: dict = {}
_MAX_BY_VALUE = 1 << 16

# Tensors launch() passes to Triton as they are; any other tensor type is a tracer's (below).
_REAL_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _first_tensor(args):
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg
    return None


def _key(kernel, device: int, args: tuple, kwargs: dict) -> tuple:
    """The _BY_VALUE key of one launch: ints as themselves, None and bools as (type, value) (finer than
    Triton's specialization), a tensor's dtype and 16-byte alignment, anything else by _spec. Raises
    _NotDirect for what _spec does not know, and for a tracer's tensor."""
    key = [kernel, device, tuple(kwargs.items())]
    add = key.append
    for arg in args:
        kind = type(arg)
        if kind in _REAL_TENSORS:
            add(arg.dtype)
            add(arg.data_ptr() & 15 == 0)
        elif kind is int:
            add(arg)
        elif kind is bool or arg is None:
            add((kind, arg))
        elif isinstance(arg, torch.Tensor):
            raise _NotDirect
        else:
            add(_spec(arg))
    return tuple(key)


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs) on the current CUDA stream, at a fraction of the host cost.

    Under torch.compile's tracing (an op decomposed by kernelforge.ops._opdef: the tensors are
    FunctionalTensors or FakeTensors) the launch is recorded instead, through
    torch.library.wrap_triton: Inductor then launches the kernel from its generated code.

    Triton's JITFunction.run binds and specializes every argument, reads its environment knobs
    and looks the kernel up on every call: 14 us for a kernel of 31 arguments against 6 us for
    the compiled launcher alone, and 27 us for the GEMM kernel (H200 host; measured by
    benchmarks/results/nvidia-h200/0.1.0/host/). Here the first call at a specialization goes through Triton
    (compiling if needed); later calls with the same keyword arguments and the same
    specialization of every positional argument (`_spec`, which separates at least whatever
    Triton separates; `_key`) call the compiled launcher directly, as Inductor's generated
    launchers do. Triton's path is kept for the interpreter, for arguments `_spec` does not know,
    and while launch hooks (a profiler's) are installed. Keyword arguments must be hashable."""
    first = _first_tensor(args)
    if first is not None and type(first) not in _REAL_TENSORS:
        from torch.library import wrap_triton

        wrap_triton(kernel)[grid](*args, **kwargs)
        return
    jit_function, runtime = _triton_runtime()
    recorder = recording()  # an eager plan being recorded (kernelforge._eager_plans) is told of the launch
    # Gluon kernels are a JITFunction subclass with the same compiled launcher
    if not isinstance(kernel, jit_function) or runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls:
        _through_triton(recorder, kernel, grid, args, kwargs)
        return
    # the tensors' device is current (on_device): the tensor says which it is, at a fraction of the cost
    device = first.get_device() if first is not None else torch.cuda.current_device()
    try:
        by_value = _key(kernel, device, args, kwargs)
        entry = _BY_VALUE.get(by_value)
    except (_NotDirect, TypeError):  # TypeError: an unhashable keyword value
        _through_triton(recorder, kernel, grid, args, kwargs)
        return
    if entry is None:
        key = (kernel, device, by_value[2], tuple(map(_spec, args)))
        entry = _COMPILED.get(key)
        if entry is None:
            if any(p.is_constexpr for p in kernel.params[:len(args)]):
                raise TypeError(f"launch({kernel.fn.__name__}): pass constexpr parameters by keyword (a positional "
                                "one would be keyed by its specialization, not its value)")
            if recorder is None:
                compiled = kernel[grid](*args, **kwargs)
            else:
                with recorder.unwatched():
                    compiled = kernel[grid](*args, **kwargs)
            if hasattr(compiled, "result"):  # Triton's asynchronous compile mode
                compiled = compiled.result()
            tail = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in kernel.params[len(args):])
            entry = _COMPILED[key] = (_direct_launcher(compiled.run), compiled.function, compiled.packed_metadata,
                                      tail)
            if recorder is not None:
                recorder.direct_launch(entry, device, grid, args, kwargs)
            return
        if len(_BY_VALUE) >= _MAX_BY_VALUE:
            _BY_VALUE.clear()
        _BY_VALUE[by_value] = entry
    if recorder is not None:
        recorder.direct_launch(entry, device, grid, args, kwargs)
    run, function, metadata, tail = entry
    grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
    run(grid_x, grid_y, grid_z, torch._C._cuda_getCurrentRawStream(device), function, metadata, None, None, None,
        *args, *tail)


def _through_triton(recorder, kernel, grid, args: tuple, kwargs: dict) -> None:
    """kernel[grid](*args, **kwargs), Triton's own launch path, told to an eager plan's recording."""
    if recorder is None:
        kernel[grid](*args, **kwargs)
        return
    recorder.triton_launch(kernel, grid, args, kwargs)
    with recorder.unwatched():  # the torch ops Triton runs inside (the interpreter's copies) are its own
        kernel[grid](*args, **kwargs)


def _direct_launcher(run):
    """The compiled kernel's launcher, without the Python wrapper where the wrapper has nothing to
    do: Triton's CudaLauncher.__call__ makes a closure and allocates global and profiler scratch
    buffers on every call, and a kernel that needs neither (ours) can call its C launch function
    with the same arguments and no scratch (~2 us a launch)."""
    c_launch = getattr(run, "launch", None)
    if (c_launch is None or getattr(run, "global_scratch_size", 1) != 0 or getattr(run, "profile_scratch_size", 1) != 0
            or getattr(run, "launch_cooperative_grid", None) is None):
        return run
    cooperative, pdl = run.launch_cooperative_grid, getattr(run, "launch_pdl", False)

    def direct(grid_x, grid_y, grid_z, stream, function, *args):
        c_launch(grid_x, grid_y, grid_z, stream, function, cooperative, pdl, None, None, *args)

    return direct


@functools.lru_cache(maxsize=None)
def _triton_runtime():
    """(Triton's JITFunction class, its runtime knobs). Under TRITON_INTERPRET=1 kernels are
    InterpretedFunctions, which take Triton's path."""
    from triton import knobs
    from triton.runtime.jit import JITFunction
    return JITFunction, knobs.runtime
