"""MLflow runs, read with MLflow's own `MlflowClient`: each run's params (text, parsed as
JSON where they parse), every metric's history with its steps and timestamps
(``get_metric_history``), its tags, status and times. Any tracking URI MLflow opens: a
database (``sqlite:///mlflow.db``), a server, or an old ``./mlruns`` file store (read with
``MLFLOW_ALLOW_FILE_STORE=true``, which MLflow 3 asks for)."""

from __future__ import annotations

import os
from typing import Any

from lab.importers.core import Source, SourceError, SourceRun, config_value, status_of, valid_tags

#: MLflow's own tags, which say where a run came from: kept in the provenance, not as tags.
_SYSTEM = "mlflow."


def read_mlflow(uri: str, experiment: str | None = None) -> Source:
    """Every run of one MLflow experiment at `uri`: the one named `experiment`, else the
    only experiment that has runs."""
    from lab._imports import require

    require("mlflow", "import", "lab import mlflow")
    from mlflow import MlflowClient

    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = allowed or "true"  # for an old ./mlruns folder
    try:
        client = MlflowClient(tracking_uri=uri)
        exp = _experiment(client, uri, experiment)
        runs = client.search_runs(
            [exp.experiment_id], max_results=50000, order_by=["attributes.start_time ASC"]
        )
        read = [_run(client, r) for r in runs]
    except SourceError:
        raise
    except Exception as exc:  # what MLflow raises for a URI it cannot open is its own
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SourceError(f"MLflow cannot read {uri}: {first}") from None
    finally:
        if allowed is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
    return Source("mlflow", exp.name, uri, read)


def _experiment(client: Any, uri: str, name: str | None) -> Any:
    if name is not None:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            known = sorted(e.name for e in client.search_experiments())
            raise SourceError(
                f"no MLflow experiment named {name!r} at {uri}; known: {', '.join(known) or 'none'}"
            )
        return exp
    with_runs = [
        e
        for e in client.search_experiments()
        if client.search_runs([e.experiment_id], max_results=1)
    ]
    if len(with_runs) != 1:
        names = ", ".join(sorted(e.name for e in with_runs)) or "none"
        raise SourceError(
            f"{uri} holds {len(with_runs)} MLflow experiments with runs ({names}): choose one "
            "with --experiment NAME"
        )
    return with_runs[0]


def _run(client: Any, run: Any) -> SourceRun:
    info, data = run.info, run.data
    metrics = {}
    for key in sorted(data.metrics):
        history = client.get_metric_history(info.run_id, key)
        by_step = {m.step: (m.step, float(m.value), m.timestamp / 1000) for m in history}
        metrics[key] = [by_step[s] for s in sorted(by_step)]  # the last logged value of a step
    user_tags = {k: v for k, v in data.tags.items() if not k.startswith(_SYSTEM)}
    tags = [f"{k}={v}" if v else k for k, v in sorted(user_tags.items())]
    status, error = status_of(str(info.status), "MLflow")
    return SourceRun(
        source_id=info.run_id,
        name=info.run_name or info.run_id,
        config={k: config_value(v) for k, v in sorted(data.params.items())},
        metrics=metrics,
        status=status,
        error=error,
        tags=valid_tags(tags),
        started_at=info.start_time / 1000 if info.start_time else None,
        ended_at=info.end_time / 1000 if info.end_time else None,
        extra={"tags": dict(sorted(data.tags.items())), "experiment_id": info.experiment_id},
    )
