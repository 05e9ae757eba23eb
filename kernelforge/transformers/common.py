"""What the per-family patches of kernelforge.transformers share: setting a module's forward on
the instance (and saying so in the report), the version check, the LayerNorm forward."""
from __future__ import annotations

import functools
import types
from typing import Callable

import torch

from kernelforge._replacements import Replacement, Replacements, Skipped
from kernelforge.ops.norms import layer_norm

MARK = "_kernelforge_patched"  # an instance attribute: the module's forward is kernelforge's
# a GELU activation module of transformers.activations -> kf.gelu's approximate
GELU_APPROXIMATIONS = {"GELUActivation": "none", "NewGELUActivation": "tanh", "GELUTanh": "tanh",
                       "PytorchGELUTanh": "tanh"}


def _as_function(forward: Callable) -> Callable:
    """forward as a plain Python function: torch 2.11's Dynamo cannot trace a method whose function
    is a functools.partial ("can't handle functions not implemented in python"), so
    torch.compile(fullgraph=True) of a patched model failed there; 2.13's can."""
    if not isinstance(forward, functools.partial):
        return forward
    fn, fixed = forward.func, forward.keywords
    if forward.args:
        raise TypeError(f"kernelforge.transformers: a patched forward takes its fixed arguments by keyword, got "
                        f"{forward.args!r} by position for {fn.__name__}")

    @functools.wraps(fn)
    def bound(self, *args, **kwargs):
        return fn(self, *args, **kwargs, **fixed)

    return bound


def patched_function(module: torch.nn.Module):
    """The function Patcher.take bound as the module's forward (for a partial, its function; the
    closure _as_function makes keeps it under __wrapped__), or None: not patched, or replaced since
    (a tensor-parallel plan's forward, a user's)."""
    forward = getattr(module.__dict__.get("forward"), "__func__", None)
    return getattr(forward, "__wrapped__", forward)


class Patcher:
    """Collects what one patch replaced and skipped."""

    def __init__(self):
        self.replaced: list = []
        self.skipped: list = []

    def take(self, name: str, module: torch.nn.Module, forward: Callable, note: str, method: str = "forward") -> None:
        """module.<method> = forward (bound to the instance), unless it was patched before or has hooks."""
        if module.__dict__.get(MARK):
            return
        if module._forward_hooks or module._forward_pre_hooks:
            self.skip(name, module, "has hooks")
            return
        setattr(module, method, types.MethodType(_as_function(forward), module))
        module.__dict__[MARK] = note
        self.replaced.append(Replacement(name, type(module).__qualname__, type(module).__qualname__, note))

    def skip(self, name: str, module: torch.nn.Module, why: str) -> None:
        self.skipped.append(Skipped(name, type(module).__qualname__, why))

    def report(self) -> Replacements:
        return Replacements(self.replaced, self.skipped)


def untested_version() -> str | None:
    """Why forwards that follow transformers' code are not replaced (None: they are)."""
    from kernelforge.transformers import transformers_version_tested

    tested, version = transformers_version_tested()
    return None if tested else f"installed {version} was not"


def layer_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """torch.nn.LayerNorm's forward by kf.layer_norm."""
    if x.dtype != self.weight.dtype:  # torch's mixed-dtype promotion, as it was
        return type(self).forward(self, x)
    return layer_norm(x, self.weight, self.bias, self.eps, normalized_shape=self.normalized_shape)


def plain_linears(module: torch.nn.Module, names, bias: bool = False) -> bool:
    """The named submodules are nn.Linear without hooks (and without a bias unless `bias`): a
    fused forward reads their weights."""
    for name in names:
        linear = getattr(module, name, None)
        if (type(linear) is not torch.nn.Linear or (linear.bias is not None and not bias) or linear._forward_hooks
                or linear._forward_pre_hooks):
            return False
    return True


__all__ = ["GELU_APPROXIMATIONS", "MARK", "Patcher", "layer_norm_forward", "patched_function", "plain_linears",
           "untested_version"]
