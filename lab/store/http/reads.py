"""The reading part of `HttpStore`: the read API of a `lab serve` server (`lab.server.read`)
behind the same methods as `lab.store.Store`'s reads, plus what only a server answers fast
(a downsampled series, predictions by the page, a table as Arrow).

Answers come back as `Store` gives them: timestamps as naive UTC `datetime`, NaN and ±inf
as floats (the wire carries them as strings), so ``lab ls``, ``lab show`` and
`lab.inspect.connect` print and compute the same over HTTP as over the database.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, cast

import httpx

from lab._json import NON_FINITE, floats_back

if TYPE_CHECKING:  # pyarrow is imported by the reads that answer Arrow: lab ls needs none
    import pyarrow as pa

    from lab.store.records import (
        EliminationRecord,
        ExperimentRecord,
        ExperimentSummary,
        TrialRecord,
    )

_TIMES = ("created_at", "ended_at", "started_at")


class HttpReads:
    """Reads of a `lab serve` server; `HttpStore` includes it (its `_request` does the work)."""

    if TYPE_CHECKING:  # HttpStore's client (lab.store.http.client) gives it

        def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response: ...

    def _read(self, path: str, **params: Any) -> Any:
        given = {k: v for k, v in params.items() if v is not None}
        return self._request("GET", path, params=given or None).json()

    # -- what Store reads too ----------------------------------------------------------------
    def list_experiments(self) -> list[ExperimentSummary]:
        """Every experiment with its status and run counts, newest first (as
        `Store.list_experiments`)."""
        # (the server answers `Store.list_experiments`'s records as JSON)
        return [cast("ExperimentSummary", _times(row)) for row in self._read("/experiments")]

    def get_experiment(self, name: str) -> ExperimentRecord:
        """An experiment with its arms and runs, as `Store.get_experiment` gives it (what
        ``lab show`` prints); `NoExperiment` names the known ones."""
        exp = _times(self._read(f"/experiments/{_part(name)}"))
        exp["runs"] = [_run(r) for r in exp["runs"]]
        return cast("ExperimentRecord", exp)  # (`Store.get_experiment`'s record, as JSON)

    def metric_values(self, run_id: int, key: str) -> list[tuple[int, float]]:
        """One run's (step, value) pairs for `key`, in step order, NaN restored."""
        got = self.series(run_id, key)
        return list(zip(got["step_min"], got["last"], strict=True))

    def trials(self, experiment: str) -> list[TrialRecord]:
        """An experiment's sampled arms by number, as `Store.trials` gives them."""
        rows = self._read(f"/experiments/{_part(experiment)}/trials")
        for row in rows:
            row["value"] = _float(row["value"])
            row["intermediate"] = {int(k): _float(v) for k, v in row["intermediate"].items()}
        return cast("list[TrialRecord]", rows)

    def eliminations(self, experiment: str) -> list[EliminationRecord]:
        """The arms an experiment's race dropped, as `Store.eliminations` gives them."""
        rows = [_times(r) for r in self._read(f"/experiments/{_part(experiment)}/eliminations")]
        for row in rows:
            _numbers(row, ("statistic", "p_value", "alpha"))
        return cast("list[EliminationRecord]", rows)

    def metric_points(self, experiment: str, metric: str) -> dict[str, list[tuple[int, float]]]:
        """Each current run's points of `metric` by run key, NaN restored (as
        `Store.metric_points`)."""
        got = self._read(f"/experiments/{_part(experiment)}/metric_points", metric=metric)
        return {key: [(step, _float(v)) for step, v in points] for key, points in got.items()}

    # -- what the read API adds ---------------------------------------------------------------
    def runs(self, experiment: str, *, status: str | None = None, **config: Any) -> list[dict]:
        """An experiment's current runs, each with its config and last metric values, of one
        `status` and with config fields equal to `config` if asked (a nested field as
        ``**{"model.width": 64}``)."""
        import json

        params = {f"config.{k}": json.dumps(v) for k, v in config.items()}
        if status is not None:
            params["status"] = status
        rows = self._request("GET", f"/experiments/{_part(experiment)}/runs", params=params)
        return [_run(r) for r in rows.json()]

    def summaries(self, experiment: str, key: str | None = None) -> list[dict[str, Any]]:
        """One row per current run and metric key: count, first and last step, last value,
        min and max (the ``final_metrics`` view's numbers, read without a scan)."""
        rows = self._read(f"/experiments/{_part(experiment)}/summaries", key=key)
        return [_numbers(r, ("last_value", "min_value", "max_value")) for r in rows]

    def series(self, run_id: int, key: str, buckets: int | None = None) -> dict[str, Any]:
        """One run's series of `key`, cut into at most `buckets` ranges of steps (all points
        when left out): lists ``step_min``, ``step_max``, ``min``, ``max`` (NaN left out;
        None when a bucket holds only NaN) and ``last``, and ``points`` (how many the series
        holds)."""
        got = self._read(f"/runs/{int(run_id)}/series", key=key, buckets=buckets)
        for name in ("min", "max", "last"):
            got[name] = [_float(v) for v in got[name]]
        return got

    def predictions(
        self,
        run_id: int,
        *,
        eval: str | None = None,  # the read API's name for it
        step: int | Literal["final"] | None = None,
        page: int = 1000,
    ) -> Iterator[dict[str, Any]]:
        """A run's prediction rows (of one eval name and step if asked; ``step="final"``:
        after training), in (eval, idx) order, fetched `page` rows at a time."""
        after = None
        while True:
            got = self._read(
                f"/runs/{int(run_id)}/predictions", eval=eval, step=step, limit=page, after=after
            )
            for row in got["predictions"]:
                yield _numbers(row, ("score",))
            after = got["next"]
            if after is None:
                return

    def evals(self, run_id: int) -> list[dict[str, Any]]:
        """A run's evaluations: name, step, metrics, breakdowns, tags, seconds, error."""
        rows = [_times(r) for r in self._read(f"/runs/{int(run_id)}/evals")]
        for row in rows:
            row["metrics"] = floats_back(row["metrics"] or {})
        return rows

    def checkpoints(self, run_id: int) -> list[dict[str, Any]]:
        """A run's checkpoint manifest rows (saves and removals), in the order written."""
        rows = [_times(r) for r in self._read(f"/runs/{int(run_id)}/checkpoints")]
        for row in rows:
            row["metrics"] = floats_back(row["metrics"] or {})
        return rows

    def table(self, name: str, experiment: str | None = None) -> pa.Table:
        """Store table `name` (every row, or one `experiment`'s) as Arrow: JSON columns as
        their text, NaN as NaN. What `lab.inspect.connect` builds its views over."""
        params = {"experiment": experiment} if experiment is not None else None
        answer = self._request("GET", f"/tables/{_part(name)}", params=params)
        import pyarrow as pa

        return pa.ipc.open_stream(answer.content).read_all()

    def export(
        self, experiment: str, table: str = "metrics", *, format: str = "arrow"
    ) -> pa.Table | bytes:
        """One table of an experiment's rows: Arrow (``format="arrow"``) or the bytes of a
        Parquet file (``format="parquet"``), superseded runs left out."""
        answer = self._request(
            "GET",
            f"/experiments/{_part(experiment)}/export",
            params={"format": format, "table": table},
        )
        if format == "parquet":
            return answer.content
        import pyarrow as pa

        return pa.ipc.open_stream(answer.content).read_all()


def _part(name: str) -> str:
    """`name` as one path segment: every character that means something in a URL escaped."""
    from urllib.parse import quote

    return quote(name, safe="")


def _float(value: Any) -> Any:
    return NON_FINITE.get(value, value) if isinstance(value, str) else value


def _numbers(row: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    for name in names:
        row[name] = _float(row.get(name))
    return row


def _times(row: dict[str, Any]) -> dict[str, Any]:
    for name in _TIMES:
        if isinstance(row.get(name), str):
            row[name] = datetime.fromisoformat(row[name])
    return row


def _run(row: dict[str, Any]) -> dict[str, Any]:
    row = _times(row)
    row["summary"] = {k: _float(v) for k, v in (row.get("summary") or {}).items()}
    return row


__all__ = ["HttpReads"]
