"""What an import left in a store, read back through the store's public reads and DuckDB:
shared by the importers' tests."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

import lab.inspect


def nan_safe(value: float) -> Any:
    """A value that compares equal to itself: NaN as the text ``nan``."""
    return "nan" if isinstance(value, float) and math.isnan(value) else value


def imported(url: str, experiment: str) -> dict[str, dict[str, Any]]:
    """The runs of `experiment` by key: arm, repeat, seed, status, error, config, tags,
    provenance and their points (key -> [(step, value, wall_time)])."""
    con = lab.inspect.connect(url)
    runs = con.execute(
        "select r.run_id, r.run_key, a.name, r.repeat, r.seed, r.status, r.error, r.config, "
        "r.tags, r.provenance from runs r join experiments e using (experiment_id) "
        "left join arms a on a.arm_id = r.arm_id where e.name = ? order by r.run_id",
        [experiment],
    ).fetchall()
    points: dict[int, dict[str, list[tuple[int, Any, float]]]] = {}
    for run_id, key, step, value, wall in con.sql(
        "select run_id, key, step, value, wall_time from metrics order by run_id, key, step"
    ).fetchall():
        value = math.nan if value is None else value
        points.setdefault(run_id, {}).setdefault(key, []).append((step, nan_safe(value), wall))
    con.close()
    keep = ("arm", "repeat", "seed", "status", "error", "config", "tags", "provenance")
    out = {}
    for run_id, key, *fields in runs:
        row = dict(zip(keep, fields, strict=True))
        for name in ("config", "tags", "provenance"):
            row[name] = json.loads(row[name]) if isinstance(row[name], str) else row[name]
        out[key] = {**row, "points": points.get(run_id, {})}
    return out


def lab_import(*args: str) -> subprocess.CompletedProcess[str]:
    """``lab import ...`` in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "lab.cli", "import", *args],
        capture_output=True, text=True, timeout=300, env={**os.environ, "WANDB_SILENT": "true"},
    )  # fmt: skip
