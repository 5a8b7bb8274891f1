"""The writing part of `HttpStore`: the same write methods as `lab.store.Store`, over HTTP.

Calls that return ids the caller needs (the experiment, arms, groups, the run claim) are
synchronous requests. Everything a run writes while it trains (the truncation of its rows
as it starts, metric steps, evals with predictions, checkpoint rows, histograms and images,
its end, callback errors, the experiment's end) is queued, in order, in the same bounded
buffer the local store uses, and posted by one background sender (`lab.store.http.sender`)
in idempotent batches; while the server is away they are spooled to the run folder and
replayed later. A run this client claimed starts without a request of its own: the claim
recorded it `running` under this process already.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from base64 import b64encode
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from lab._metrics import as_number, check_key
from lab.errors import MetricError, TokenRejected
from lab.media import Histogram, Image, image_bytes, stored_path
from lab.store.crashes import HEARTBEAT_S
from lab.store.http.client import HttpClient
from lab.store.http.reads import _times
from lab.store.http.sender import MAX_JSON_POINTS, Op, Sender, dumps
from lab.store.liveness import this_owner
from lab.store.writer import MetricWriter

if TYPE_CHECKING:
    from lab.records import EvalResult, ManifestRow
    from lab.store.records import CurrentRun, FinishedRun, PreviousRun


class HttpWrites(HttpClient):
    """The write methods of `HttpStore`: a `lab.store.http.client.HttpClient` that writes."""

    def __init__(
        self,
        url: str | None = None,
        *,
        heartbeat_s: float = HEARTBEAT_S,
        max_pending: int = 8192,
        **client: Any,
    ) -> None:
        """`heartbeat_s`: how often a quiet run tells the server it is alive. `max_pending`:
        how many steps the buffer holds before `log_metrics` waits (back-pressure). Other
        keywords go to `HttpClient` (token, timeout, retry_s)."""
        super().__init__(url, **client)
        #: This store's client id: every batch it sends carries it, with its sequence number.
        self.client_id = uuid.uuid4().hex
        self.heartbeat_s = heartbeat_s
        self._max_pending = max_pending
        self._folders: dict[int, str | None] = {}
        # run id -> (when, what) of each run claimed here and not started or released yet
        self._claimed: dict[int, tuple[float, dict[str, Any]]] = {}
        self._cwd = str(Path.cwd())
        self._sender = Sender(
            self,
            self.client_id,
            self._folder_of,
            heartbeat_s=heartbeat_s,
            json_points=MAX_JSON_POINTS if "metrics" in self.ops else 0,
        )
        self._writer: MetricWriter[dict[str, float]] | None = None
        self._writer_lock = threading.Lock()
        self._good_keys: set[str] = set()
        self._owner = this_owner()
        self._sender.driver = self._owner
        #: Histogram and image rows, queued with the metrics (as `Store.media`).
        self.media = _Media(self)

    # -- the queue -----------------------------------------------------------------------
    @property
    def writer(self) -> MetricWriter[dict[str, float]]:
        """The background sender's buffer and thread, started on first use."""
        if self._writer is None:
            with self._writer_lock:
                if self._writer is None:
                    self._writer = MetricWriter(
                        self._sender.send,
                        max_pending=self._max_pending,
                        idle_s=1.0,
                        give_up_s=self.retry_s,
                        window_env="LAB_HTTP_RETRY_S",
                    )
        return self._writer

    def _queue(self, name: str, args: dict[str, Any], run_id: int | None = None) -> None:
        self._need_write()
        self.writer._buffer.append(Op(name, args, run_id))

    def _need_write(self) -> None:
        if self.scope != "write":
            raise TokenRejected(
                f"the token for lab serve at {self.url.shown} is a read token; writing needs "
                "one made with: lab token create NAME --scope write"
            )

    def _folder_of(self, run_id: int | None) -> str | None:
        """Where a batch spools: its run's folder, else the last run's (an experiment's end
        follows its runs' batches there), else the working folder."""
        if run_id is not None and self._folders.get(run_id) is not None:
            return self._folders[run_id]
        known = [f for f in self._folders.values() if f is not None]
        return known[-1] if known else self._cwd

    @property
    def spooled(self) -> list[Path]:
        """The batches spooled to disk and not yet replayed."""
        return self._sender.spooled

    def flush(self) -> None:
        """Return once everything queued so far is acknowledged by the server, spooled, or
        dropped as bad data (with a warning line); raises `StoreError` when it could be
        neither sent nor spooled for the retry window. (A refused token fails the run at its
        next `log_metrics`; a flush spools, so that the run's end is kept with its rows.)"""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush, stop the sender, try once more to replay the spool, and release the
        connection; what stays spooled is named in one warning line with its ``lab sync``."""
        try:
            if self._writer is not None:
                writer, self._writer = self._writer, None
                writer.close()
        finally:
            try:
                self._sender.finish()
            finally:
                self._http.close()

    def _post(self, path: str, body: dict[str, Any], *, retry: bool = False) -> Any:
        self._need_write()
        answer = self._request(
            "POST",
            path,
            content=dumps(body),
            headers={"Content-Type": "application/json"},
            retry=retry,
        )
        return answer.json()

    # -- synchronous calls ---------------------------------------------------------------
    def begin_experiment(
        self,
        name: str,
        *,
        config: dict[str, Any],
        seed: int,
        repeats: int,
        tags: Sequence[str] = (),
        notes: str | None = None,
    ) -> int:
        """Create the experiment, or reopen the one of that name, driven by this process
        (see `Store.begin_experiment`); returns its id. Its heartbeat is sent until
        `finish_experiment`."""
        body = {"name": name, "config": config, "seed": seed, "repeats": repeats,
                "tags": list(tags), "notes": notes, "owner": self._owner}  # fmt: skip
        exp_id = self._post("/experiments", body, retry=True)["experiment_id"]
        self._sender.began(exp_id)
        _ = self.writer  # started now: it keeps the experiment's heartbeat
        return exp_id

    def add_arm(
        self, experiment_id: int, name: str, *, overrides: dict[str, Any], config: dict[str, Any]
    ) -> int:
        """Record an arm of an experiment; returns its id."""
        body = {"name": name, "overrides": overrides, "config": config}
        return self._post(f"/experiments/{experiment_id}/arms", body, retry=True)["arm_id"]

    def add_group(
        self, experiment_id: int, name: str, *, kind: str = "repeats", arm_id: int | None = None
    ) -> int:
        """Record a group of runs; returns its id."""
        body = {"name": name, "kind": kind, "arm_id": arm_id}
        return self._post(f"/experiments/{experiment_id}/groups", body, retry=True)["group_id"]

    def claim_run(
        self, experiment_id: int, group_id: int, **fields: Any
    ) -> tuple[int | None, FinishedRun | None]:
        """Claim a run before it starts (see `Store.claim_run`), under this process."""
        body = {"group_id": group_id, **fields, "owner": self._owner}
        answer = self._post(f"/experiments/{experiment_id}/claims", body)
        if answer["run_id"] is not None:
            what = {"experiment_id": experiment_id, "group_id": group_id, **fields}
            self._claimed[answer["run_id"]] = (time.monotonic(), what)
        return answer["run_id"], answer["finished"]

    def start_run(
        self,
        experiment_id: int,
        group_id: int,
        *,
        provenance: dict[str, Any] | None = None,
        claimed: int | None = None,
        **fields: Any,
    ) -> int:
        """Record a run as `running` under this process (see `Store.start_run`).

        A run this client claimed less than a heartbeat ago, with the same fields, is
        `running` under this process since its claim, and no other process may take it
        meanwhile: it starts without a request, its provenance queued with its writes.
        Any other start (a run another process claimed, a worker's) asks the server."""
        unclaimed = (-math.inf, None)
        when, what = unclaimed if claimed is None else self._claimed.pop(claimed, unclaimed)
        same = what == {"experiment_id": experiment_id, "group_id": group_id, **fields}
        if claimed is not None and same and time.monotonic() - when < self.heartbeat_s:
            run_id = claimed
            if provenance is not None:
                self._queue("set_provenance", {"run_id": run_id, "provenance": provenance}, run_id)
        else:
            body = {"group_id": group_id, **fields, "provenance": provenance,
                    "claimed": claimed, "owner": self._owner}  # fmt: skip
            run_id = self._post(f"/experiments/{experiment_id}/runs", body)["run_id"]
        self._folders[run_id] = fields.get("output_dir")
        self._sender.active.add(run_id)
        _ = self.writer  # started now: it keeps the heartbeat while the run is quiet
        return run_id

    def release_run(self, run_id: int, error: str) -> None:
        """Record a run claimed here and never started as `failed` with `error`."""
        self._claimed.pop(run_id, None)
        self._post(f"/runs/{run_id}/release", {"error": error, "owner": self._owner})

    def supersede_run(self, run_id: int, run_key: str, output_dir: str | None) -> None:
        """Set a run aside under a new key and folder (see `Store.supersede_run`)."""
        self._post(f"/runs/{run_id}/supersede", {"run_key": run_key, "output_dir": output_dir})

    def truncate_run(self, run_id: int, after_step: int | None = None) -> None:
        """Drop a run's rows after a step, or all of them (see `Store.truncate_run`), after
        what was queued before and before what is queued after: queued with the run's
        writes where the server takes it in a batch, else sent once the queue is."""
        if "truncate_run" in self.ops:
            self._queue("truncate_run", {"run_id": run_id, "after_step": after_step}, run_id)
            return
        self.flush()
        self._post(f"/runs/{run_id}/truncate", {"after_step": after_step}, retry=True)
        self._sender.last_steps.pop(run_id, None)
        if after_step is not None:
            self._sender.last_steps[run_id] = after_step

    # -- a sweep: synchronous, so a sampler's record is the server's before it asks on ------
    def add_trial(
        self,
        experiment_id: int,
        number: int,
        arm_id: int,
        params: dict[str, Any],
        asked_after: int,
    ) -> None:
        """Record sampled arm `number` as asked (see `Store.add_trial`); the same again
        stores nothing, so a lost answer is sent again."""
        body = {"number": number, "arm_id": arm_id, "params": params, "asked_after": asked_after}
        self._post(f"/experiments/{experiment_id}/sweep/trials", body, retry=True)

    def tell_trial(
        self, experiment_id: int, number: int, *, told: int, value: float | None, state: str
    ) -> None:
        """Record how trial `number` ended (see `Store.tell_trial`)."""
        body = {"told": told, "value": value, "state": state}
        self._post(
            f"/experiments/{experiment_id}/sweep/trials/{int(number)}/tell", body, retry=True
        )

    def add_elimination(
        self,
        experiment_id: int,
        arm_id: int,
        *,
        round: int,
        test: str,
        statistic: float,
        p_value: float,
        alpha: float,
        best: str,
    ) -> None:
        """Record that a race dropped an arm (see `Store.add_elimination`)."""
        body = {"arm_id": arm_id, "round": round, "test": test, "statistic": statistic,
                "p_value": p_value, "alpha": alpha, "best": best}  # fmt: skip
        self._post(f"/experiments/{experiment_id}/race/eliminations", body, retry=True)

    # -- the reads a recording client needs before it starts ------------------------------
    # (each sends what this client queued first, so that it reads what it wrote: a run's
    # end queued by the experiment before, say)
    def mark_crashed(self) -> list[str]:
        """Mark the runs whose process is gone `crashed` (at the server); their keys."""
        self.flush()
        return self._post("/records/mark_crashed", {}, retry=True)["run_keys"]

    def previous_runs(self, experiment: str) -> dict[str, PreviousRun]:
        """The current runs of `experiment`, by run key (see `Store.previous_runs`), their
        times as `datetime`, as `Store` gives them."""
        runs = self._get(f"/records/experiments/{_quote(experiment)}/previous_runs")
        return {key: cast("PreviousRun", _times(row)) for key, row in runs.items()}

    def current_runs(self, experiment: str) -> list[CurrentRun]:
        """The current runs of `experiment`, as `Store.current_runs` gives them."""
        rows = self._get(f"/records/experiments/{_quote(experiment)}/current_runs")
        return [cast("CurrentRun", _times(row)) for row in rows]

    def supersede_trials(self, experiment: str) -> int:
        """Set an experiment's trials aside (see `Store.supersede_trials`)."""
        answer = self._post(f"/records/experiments/{_quote(experiment)}/supersede_trials", {})
        return int(answer["superseded"])

    def run_keys(self, experiment: str) -> list[str]:
        """Every run key `experiment` has recorded, superseded ones included."""
        return self._get(f"/records/experiments/{_quote(experiment)}/run_keys")

    def find_run(self, experiment_id: int, run_key: str) -> int | None:
        """The id of an experiment's run by key, or None."""
        params = {"experiment_id": experiment_id, "run_key": run_key}
        return self._get("/records/runs", params)["run_id"]

    def last_step(self, run_id: int) -> int | None:
        """A run's last metric step, or None (what is queued here counts, sent or not)."""
        self.flush()
        queued = self._sender.last_steps.get(run_id)
        if queued is not None:
            return queued
        return self._get(f"/records/runs/{run_id}/last_step")["last_step"]

    def _get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        self.flush()
        return self._request("GET", path, params=params).json()

    # -- queued writes -------------------------------------------------------------------
    def log_metrics(
        self,
        run_id: int,
        step: int,
        metrics: dict[str, Any],
        *,
        floats: bool = False,
        keys: bool = False,
    ) -> None:
        """Queue one step's metrics (see `Store.log_metrics`; `floats` and `keys` change
        nothing here: the one pass checks each key and value); waits only while the buffer is
        full, never on the network. Raises `TokenRejected` once the server refused the
        token: the run stops there, its batches spooled."""
        if self._sender.refused is not None:
            raise self._sender.refused
        row = {}
        good = self._good_keys
        for key, value in metrics.items():
            if key not in good:
                check_key(key, step)
                good.add(key)
            row[key] = value if type(value) is float else as_number(key, step, value)
        self.writer.put(run_id, step, row, time.time())

    def write_eval(
        self, run_id: int, result: EvalResult, predictions: list[dict[str, Any]] | None = None
    ) -> None:
        """Queue an eval and its predictions (see `Store.write_eval`)."""
        fields = {k: v for k, v in asdict(result).items() if k != "predictions"}
        self._queue(
            "write_eval", {"run_id": run_id, "result": fields, "predictions": predictions}, run_id
        )

    def write_checkpoint(self, run_id: int, row: ManifestRow) -> None:
        """Queue one manifest row (a save or a removal)."""
        self._queue("write_checkpoint", {"run_id": run_id, "row": asdict(row)}, run_id)

    def finish_run(self, run_id: int, *, tags: Sequence[str] = (), **fields: Any) -> None:
        """Queue a run's end: status, error, final metrics (see `Store.finish_run`)."""
        self._sender.active.discard(run_id)
        self._queue("finish_run", {"run_id": run_id, "tags": list(tags), **fields}, run_id)

    def set_provenance(self, run_id: int, provenance: dict[str, Any]) -> None:
        """Queue a run's provenance, read after its start (see `Store.set_provenance`)."""
        self._queue("set_provenance", {"run_id": run_id, "provenance": provenance}, run_id)

    def set_callback_errors(self, run_id: int, callback_errors: list[dict[str, Any]]) -> None:
        """Queue the callback failures of a run."""
        self._queue(
            "set_callback_errors", {"run_id": run_id, "callback_errors": callback_errors}, run_id
        )

    def finish_experiment(
        self,
        experiment_id: int,
        *,
        status: str,
        callback_errors: list[dict[str, Any]] | None = None,
    ) -> None:
        """Queue an experiment's end; sent after everything its runs queued."""
        self._sender.driving.discard(experiment_id)
        self._queue(
            "finish_experiment",
            {"experiment_id": experiment_id, "status": status, "callback_errors": callback_errors},
        )


def _quote(name: str) -> str:
    from urllib.parse import quote

    return quote(name, safe="")


class _Media:
    """`HttpStore.media`: histogram and image rows, queued in order with the metrics."""

    def __init__(self, store: HttpWrites) -> None:
        self._store = store
        self._good_keys: set[str] = set()

    def put(
        self,
        run_id: int,
        step: int,
        media: Mapping[str, Histogram | Image],
        folder: Path | None = None,
    ) -> None:
        """Queue one step's histograms and images (see `lab.store.media.MediaRows.put`); an
        image travels as its PNG's bytes (base64), which the server keeps."""
        rows = []
        wall = time.time()
        for key, record in media.items():
            if key not in self._good_keys:
                check_key(key, step)
                self._good_keys.add(key)
            ids = {"run_id": run_id, "key": key, "step": step, "wall_time": wall}
            if isinstance(record, Histogram):
                rows.append({"table": "histograms", **ids, "edges": list(record.edges),
                             "counts": list(record.counts), "nan": record.nan,
                             "posinf": record.posinf, "neginf": record.neginf})  # fmt: skip
            elif isinstance(record, Image):
                data = image_bytes(record)  # the server keeps the bytes; it opens no path
                encoded = None if data is None else b64encode(data).decode()
                rows.append({"table": "images", **ids, "path": stored_path(record.path, folder),
                             "width": int(record.width), "height": int(record.height),
                             "data": encoded})  # fmt: skip
            else:
                raise MetricError(
                    f"media {key!r} at step {step} is a {type(record).__name__}; log a "
                    "lab.media.Histogram or lab.media.Image (lab.media.histogram, "
                    "lab.media.write_image make them)"
                )
        if rows:
            self._store._queue("media", {"rows": rows}, run_id)

    def flush(self) -> None:
        """Send (or spool) everything queued so far."""
        self._store.flush()

    def close(self) -> None:
        """Nothing of its own to close: the store's sender carries the rows."""
