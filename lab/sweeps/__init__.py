"""Sweeps: samplers, pruning and races over arms and repeats.

The names are imported on first use (PEP 562), as `lab`'s own: a module that needs optuna or
scipy is imported only by the names that use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lab._lazy import lazy_names

#: Where each name lives; ``lab.sweeps.<name>`` imports its module on first access.
_WHERE: dict[str, str] = {
    "Elimination": "lab.sweeps.racing",
    "Race": "lab.sweeps.racing",
    "RaceState": "lab.sweeps.racing",
}

__all__ = [
    "Elimination",
    "Race",
    "RaceState",
]

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from lab.sweeps.racing import Elimination, Race, RaceState


__getattr__, __dir__ = lazy_names("lab.sweeps", _WHERE, globals(), __all__)
