"""Samplers, pruning and races over arms and repeats.

>>> from lab.sweeps import Sweep, Float, Int, Choice

The names are imported on first use (PEP 562): ``import lab.sweeps`` imports neither Optuna,
scipy nor numpy; the samplers that need them import them when they are made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lab._lazy import lazy_names

_WHERE: dict[str, str] = {
    "Choice": "lab.sweeps.space",
    "Float": "lab.sweeps.space",
    "Int": "lab.sweeps.space",
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
    "Float",
    "Int",
    "Sampler",
    "Sweep",
    "Trial",
    "check_space",
    "grid_size",
    "make_sampler",
    "parse_space",
]

if TYPE_CHECKING:
    from lab.sweeps.samplers import SAMPLERS, Sampler, Trial, grid_size, make_sampler
    from lab.sweeps.space import Choice, Float, Int, check_space, parse_space
    from lab.sweeps.sweep import Sweep

__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals(), __all__)
