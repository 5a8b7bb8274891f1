"""Bring runs recorded by MLflow, wandb or TensorBoard into a `lab` store, as an experiment
whose arms `lab.inspect.summary` and the dashboard compare at once.

Each reads its format with the source's own library (the ``import`` extra), and each can be
run again: the runs imported before are found by the source's run id, and only what is new
is added (docs/importing.md).

>>> from lab.importers import import_mlflow                                # doctest: +SKIP
>>> import_mlflow("sqlite:///mlflow.db", experiment="sweep", arm_by="lr").line()
"imported 6 new runs (600 points) from mlflow into experiment 'sweep'"
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab.importers.core import ImportResult, SourceError, parse_arm_by
from lab.importers.write import opened, write_source

__all__ = ["ImportResult", "SourceError", "import_mlflow", "import_tensorboard", "import_wandb"]


def import_mlflow(
    uri: str,
    *,
    experiment: str | None = None,
    name: str | None = None,
    store: Any = None,
    arm_by: str | Sequence[str] | None = None,
) -> ImportResult:
    """Import the runs of the MLflow `experiment` at tracking `uri` (default: the only
    experiment there with runs) as the `lab` experiment `name` (default: the MLflow
    experiment's name), into `store` (a store, or its URL; default ``LAB_STORE_URL``, else
    ``sqlite:///lab.db``). `arm_by`: config fields whose values make an arm (``"lr,opt"``);
    without it each run is its own arm."""
    from lab.importers.mlflow import read_mlflow

    fields = parse_arm_by(arm_by)
    source = read_mlflow(uri, experiment)
    with opened(store) as s:
        return write_source(source, s, name=name, arm_by=fields)


def import_wandb(
    run_dirs: Sequence[str | Path],
    *,
    name: str | None = None,
    store: Any = None,
    arm_by: str | Sequence[str] | None = None,
) -> ImportResult:
    """Import wandb run folders (``wandb/offline-run-*``, ``wandb/run-*``, or the ``wandb``
    folder that holds them) as the `lab` experiment `name` (default: the runs' project);
    `store` and `arm_by` as in `import_mlflow`."""
    from lab.importers.wandb import read_wandb

    fields = parse_arm_by(arm_by)
    source = read_wandb(list(run_dirs))
    with opened(store) as s:
        return write_source(source, s, name=name, arm_by=fields)


def import_tensorboard(
    logdir: str | Path,
    *,
    name: str | None = None,
    store: Any = None,
    arm_by: str | Sequence[str] | None = None,
) -> ImportResult:
    """Import the TensorBoard runs under `logdir` (each folder of event files a run) as the
    `lab` experiment `name` (default: the folder's name); `store` and `arm_by` as in
    `import_mlflow` (the config of a run is what ``add_hparams`` wrote)."""
    from lab.importers.tensorboard import read_tensorboard

    fields = parse_arm_by(arm_by)
    source = read_tensorboard(logdir)
    with opened(store) as s:
        return write_source(source, s, name=name, arm_by=fields)
