"""What a patch reports: the Replacement made, the modules Skipped and why, as one Replacements
list (kernelforge.patching for torch.nn layers, kernelforge.transformers for transformers models)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Replacement:
    """One change patch() made: the module at `name` (qualified, "" for the model itself) was of
    type `old` and is now `new` (equal when the module was changed in place); `note` says how."""
    name: str
    old: str
    new: str
    note: str


@dataclass(frozen=True)
class Skipped:
    """A module patch() found but left as it was, and why."""
    name: str
    type: str
    reason: str


class Replacements(list):
    """patch()'s result: a list of Replacement, with `skipped`, a list of Skipped."""

    def __init__(self, replaced=(), skipped=()):
        super().__init__(replaced)
        self.skipped: list[Skipped] = list(skipped)

    def __repr__(self) -> str:
        return f"Replacements({list(self)!r}, skipped={self.skipped!r})"


__all__ = ["Replacement", "Replacements", "Skipped"]
