"""What a benchmark suite is made of: `Suite` (one op's shapes, inputs, cost and the
implementations to race), `Unavailable` (an implementation that cannot take a case here) and
the shape labels the rows carry.

Every suite module (kernelforge.bench.suites and the *_suites modules it collects into SUITES)
and the runner import these from here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from kernelforge.bench.roofline import Cost

Shape = tuple
Fn = Callable[..., torch.Tensor]


class Unavailable(Exception):
    """Raised by an implementation that cannot take a case here (a CUDA-only baseline on the
    CPU, say): the runner leaves its row out and notes the reason."""


def shape_label(shape: Shape) -> str:
    return "x".join(str(s) for s in shape)


@dataclass
class Suite:
    op: str
    shapes: list[Shape]  # the GPU grid: large shapes first, then latency shapes
    quick_shapes: list[Shape]  # --quick, and every CPU run
    make_inputs: Callable[[Shape, torch.dtype, torch.device], tuple]
    cost: Callable[[Shape, torch.dtype, str], Cost]  # direction: "fwd" | "fwd+bwd"
    kernelforge: Fn  # the public function (runs on the default or a forced backend)
    baselines: Callable[[], dict[str, Fn]]  # built lazily: torch.compile and peers are costly
    peers: dict[str, str] = field(default_factory=dict)  # name -> module that must import
    directions: tuple[str, ...] = ("fwd", "fwd+bwd")
    # Forward-only diagnostics on a GPU, e.g. the raw kernel launchers without the op layer,
    # so the cost of dispatch shows as the difference.
    kernel_only: Callable[[], dict[str, Fn]] = dict
    registry_op: str = ""  # the op's name in kernelforge.backends, when it differs from `op`
    # Options the registry's support predicates take besides the inputs (an activation's
    # kind), so a backend is offered only for what it implements.
    support_options: dict = field(default_factory=dict)
    # What the support predicates are called with for one case, as a function of (inputs,
    # direction) giving (args, kwargs); None: (inputs[0],) and support_options. Attention's
    # take (q, k, v, vis=..., backward=...).
    support_args: Optional[Callable[[tuple, str], tuple[tuple, dict]]] = None
    # More rows of the public function called another way (a window as a BlockMask).
    variants: Callable[[], dict[str, Fn]] = dict
    label: Callable[[Shape], str] = shape_label  # a shape as the rows name it
    # The suite's own dtypes (names of kernelforge.bench.runner.DTYPES), run whatever --dtype
    # asks: a precision suite (tf32, fp8) is defined by them. Empty: --dtype.
    dtypes: tuple[str, ...] = ()
    # At most this many timed runs (and 3 warm-ups) a case, when some implementation takes
    # a large fraction of a second a call (the ConvRNN loops); 0: the run's own count.
    max_repeat: int = 0
