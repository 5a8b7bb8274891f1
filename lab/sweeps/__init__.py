"""Sweeps: samplers, pruning and races over arms and repeats.

>>> from lab.sweeps import Sweep, Float, Int, Choice, Race, Prune

The names are imported on first use (PEP 562), as `lab`'s own: ``import lab.sweeps`` imports
neither Optuna, scipy nor numpy; the samplers that need them import them when they are made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lab._lazy import lazy_names

#: Where each name lives; ``lab.sweeps.<name>`` imports its module on first access.
_WHERE: dict[str, str] = {
    "Choice": "lab.sweeps.space",
    "Elimination": "lab.sweeps.racing",
    "Float": "lab.sweeps.space",
    "Int": "lab.sweeps.space",
    "Prune": "lab.sweeps.pruning",
    "Race": "lab.sweeps.racing",
    "RaceState": "lab.sweeps.racing",
    "SAMPLERS": "lab.sweeps.samplers",
    "Sampler": "lab.sweeps.samplers",
    "Sweep": "lab.sweeps.sweep",
    "Trial": "lab.sweeps.samplers",
    "check_space": "lab.sweeps.space",
    "grid_size": "lab.sweeps.samplers",
    "make_sampler": "lab.sweeps.samplers",
    "parse_space": "lab.sweeps.space",
}

__all__ = [
    "SAMPLERS",
    "Choice",
    "Elimination",
    "Float",
    "Int",
    "Prune",
    "Race",
    "RaceState",
    "Sampler",
    "Sweep",
    "Trial",
    "check_space",
    "grid_size",
    "make_sampler",
    "parse_space",
]

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from lab.sweeps.pruning import Prune
    from lab.sweeps.racing import Elimination, Race, RaceState
    from lab.sweeps.samplers import SAMPLERS, Sampler, Trial, grid_size, make_sampler
    from lab.sweeps.space import Choice, Float, Int, check_space, parse_space
    from lab.sweeps.sweep import Sweep

__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals(), __all__)
