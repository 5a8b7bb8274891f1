"""`Sweep`: the arms of an experiment drawn from a space by a sampler, instead of written out.

``Experiment(sweep=Sweep(space, sampler="tpe", arms=16, seed=0))`` asks the sampler for its
arms in batches, runs them, and tells the sampler each arm's value of `metric`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lab._arm_grid import grid_name
from lab._imports import require
from lab.errors import ConfigError
from lab.sweeps.samplers import SAMPLERS, Sampler, make_sampler
from lab.sweeps.space import Space, check_space

__all__ = ["Sweep"]


def _count(value: Any, name: str, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r}; give an int >= 1, e.g. {name}={example}")


@dataclass(frozen=True)
class Sweep:
    """Sampled arms: `arms` points of `space` drawn by `sampler` ("grid", "random",
    "sobol", "tpe", "cmaes", or an Optuna sampler instance), seeded with `seed`, judged by
    `metric` in `mode` (the model-based samplers learn from it), asked `batch` at a time
    (None: as many as there are free workers)."""

    space: Mapping[str, Any]
    sampler: Any = "random"
    arms: int = 16
    seed: int = 0
    metric: str | None = None
    mode: Literal["min", "max"] | None = None
    batch: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "space", check_space(self.space))
        if isinstance(self.sampler, str):
            if self.sampler not in SAMPLERS:
                raise ConfigError(
                    f"Sweep(sampler={self.sampler!r}): write one of {', '.join(SAMPLERS)}, "
                    "or pass an Optuna sampler"
                )
            if self.sampler in ("tpe", "cmaes"):
                require("optuna", "sweeps", f"Sweep(sampler={self.sampler!r})")
        _count(self.arms, "arms", "16")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"Sweep(seed={self.seed!r}): give an int, e.g. seed=0")
        if self.metric is not None and (not isinstance(self.metric, str) or not self.metric):
            raise ConfigError(
                f"Sweep(metric={self.metric!r}): name the metric the arms are judged by, "
                "e.g. metric='val/loss'"
            )
        if self.mode not in (None, "min", "max"):
            raise ConfigError(f"Sweep(mode={self.mode!r}): write mode='min' or mode='max'")
        if self.batch is not None:
            _count(self.batch, "batch", "4")
        self.make_sampler()  # a grid refuses a Float now; an Optuna sampler is checked

    def make_sampler(self, mode: Literal["min", "max"] | None = None) -> Sampler:
        """A new sampler for this sweep (a sweep run again rebuilds it from its trials);
        `mode` where the sweep names none (a race's or a pruner's), else ``"min"``."""
        space: Space = dict(self.space)
        return make_sampler(self.sampler, space, seed=self.seed, mode=self.mode or mode or "min")

    def arm_name(self, number: int, params: Mapping[str, Any]) -> str:
        """Trial `number`'s arm name: the grid's ``lr=0.01,wd=0``, else ``s000``, ``s001``...
        (zero-padded to 3 digits, more when `arms` > 1000)."""
        if self.sampler == "grid":
            return grid_name(dict(params))
        return f"s{number:0{max(3, len(str(self.arms - 1)))}d}"
