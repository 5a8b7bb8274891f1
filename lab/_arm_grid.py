"""Grids of arms in an experiment file: ``{grid: {lr: [0.01, 0.1], wd: [0, 0.1]}}`` is one arm
per combination, named by its values (``lr=0.01,wd=0``), as a sweep tool would enumerate
them, so a file states a sweep in one line instead of one arm per point.

An entry of ``arms`` that has a ``grid`` key expands in place, between the arms written
out; ``arms: {grid: ...}`` (a mapping, not a list) is the same as a list of that one entry.
The entry's other keys (overrides, ``stages``, ``carry``) are shared by every arm it makes.
Combinations vary the last key fastest, in the order the keys are written.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

__all__ = ["expand_arms", "grid_name"]


def grid_name(point: dict[str, Any]) -> str:
    """The arm name of one combination: ``key=value`` pairs joined by commas, the values
    as YAML would write them (``lr=0.01,wd=0,opt=adam,nesterov=true``)."""
    return ",".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in point.items())


def expand_arms(arms: Any) -> Any:
    """The ``arms`` of a file with every grid entry replaced by the arms it makes; anything
    else is returned as it is, for the file's model to check. A grid that is not a mapping of
    non-empty lists raises ValueError naming the entry and the key (the model's one line)."""
    if isinstance(arms, dict) and "grid" in arms:
        arms = [arms]
    if not isinstance(arms, list):
        return arms
    out: list[Any] = []
    for i, entry in enumerate(arms):
        if not isinstance(entry, dict) or "grid" not in entry:
            out.append(entry)
            continue
        shared = {k: v for k, v in entry.items() if k != "grid"}
        if "name" in shared:
            raise ValueError(
                f"entry {i} has a grid and a name; a grid names its arms by their values "
                "(lr=0.01,wd=0): drop name"
            )
        grid = entry["grid"]
        if not isinstance(grid, dict) or not grid:
            raise ValueError(
                f"grid of entry {i} is {grid!r}; write a mapping of override: [values], "
                "e.g. grid: {lr: [0.01, 0.1]}"
            )
        for key, values in grid.items():
            if not isinstance(values, list) or not values:
                raise ValueError(
                    f"grid.{key} of entry {i} is {values!r}; give a non-empty list of values, "
                    f"e.g. {key}: [{values!r}]"
                    if not isinstance(values, list)
                    else f"grid.{key} of entry {i} is empty; give at least one value"
                )
        keys = list(grid)
        for combo in itertools.product(*(grid[k] for k in keys)):
            point = dict(zip(keys, combo, strict=True))
            out.append({"name": grid_name(point), **shared, **point})
    return out
