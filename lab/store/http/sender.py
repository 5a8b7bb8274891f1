"""The background sender: posts what a run writes, in order, in idempotent batches.

The training thread hands metric steps and other writes to the same bounded buffer the
local store uses (`lab.store.writer.MetricWriter`), so `log_metrics` costs it the same: an
append. The writer thread calls `Sender.send` with whatever piled up; the sender cuts it into
batches in order (runs of metric steps become one Arrow IPC body, runs of other writes one
JSON list), numbers each batch 1, 2, 3... under its client id, and posts it, retrying with a
capped exponential backoff for up to the retry window.

When the server stays away longer than that, the batch goes to the spool
(`lab.store.http.spool`) and one warning line says so; every later batch follows it there, so
the order holds. The run goes on. On each later call (at least every `probe_s`) the sender
tries the server again and, once it answers, replays the spool in sequence order before
anything new. `flush` therefore returns once everything queued is acknowledged or spooled.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab._secrets import logger, mask
from lab.errors import LabError, StoreUnreachable, TokenRejected
from lab.store.http.spool import Spooled, spool_folder
from lab.store.http.spool import write as write_spool

if TYPE_CHECKING:
    from lab.store.http.client import HttpClient

log = logger("lab.store.http")

#: The most metric points in one Arrow batch (about 10 MB), well under a server's body limit.
MAX_POINTS = 250_000


class Op:
    """One write other than metric rows (an eval, a checkpoint row, a run's end...), queued
    in order with the metric steps."""

    __slots__ = ("args", "name", "run_id")

    def __init__(self, name: str, args: dict[str, Any], run_id: int | None = None) -> None:
        self.name = name
        self.args = args
        self.run_id = run_id


def dumps(value: Any) -> bytes:
    """JSON for the server, NaN and ±inf as JSON's NaN/Infinity (read back as floats)."""
    return json.dumps(value, default=_plain, allow_nan=True).encode()


def _plain(value: Any) -> Any:
    for attr in ("item", "tolist"):  # numpy scalars and arrays, tensors
        fn = getattr(value, attr, None)
        if callable(fn):
            try:
                return fn()
            except (TypeError, ValueError, RuntimeError):
                pass
    return str(value)


class Sender:
    """Posts batches for one `HttpStore` (`client`), spooling them when it cannot.

    `folder_of(run_id)` gives a run's folder (where its batches spool).
    """

    def __init__(
        self,
        client: HttpClient,
        client_id: str,
        folder_of: Callable[[int | None], str | None],
        *,
        heartbeat_s: float,
        probe_s: float = 1.0,
    ) -> None:
        self.client = client
        self.client_id = client_id
        self._folder_of = folder_of
        self._seq = 0
        self._spooled: list[Spooled] = []  # in seq order, not yet replayed
        self._warned = False
        self._next_probe = 0.0
        self._probe_s = probe_s
        self._heartbeat_s = heartbeat_s
        self._last_sent = time.monotonic()
        self.active: set[int] = set()  # runs started and not finished: heartbeats
        self.driving: set[int] = set()  # experiments begun and not finished: heartbeats
        self.driver: dict[str, Any] = {}  # this process, as the driver of those
        self._driven_at = -math.inf
        self.last_steps: dict[int, int] = {}  # the highest step queued per run
        self.sent_batches = 0

    @property
    def spooled(self) -> list[Path]:
        """The files spooled and not replayed yet."""
        return [s.path for s in self._spooled]

    # -- called by the writer thread -----------------------------------------------------
    def send(self, items: list[Any]) -> None:
        """Deliver `items` (metric steps and `Op`s, in order), or spool them; raises only
        when the server refused a batch as malformed (`ServerRejected`)."""
        if self._spooled:
            self._replay(force=False)
        for kind, seq, body, run_id in self._batches(items):
            self._deliver(kind, seq, body, run_id)
        self._beat()

    def _batches(self, items: list[Any]) -> list[tuple[str, int, bytes, int | None]]:
        """Cut `items` into consecutive batches (kind, seq, body, first run id), numbered."""
        out: list[tuple[str, int, bytes, int | None]] = []
        steps: list[tuple[int, int, dict[str, float], float]] = []
        ops: list[Op] = []
        points = 0

        def close_steps() -> None:
            nonlocal points
            if steps:
                self._seq += 1
                out.append(("arrow", self._seq, self._arrow(steps), steps[0][0]))
                steps.clear()
                points = 0

        def close_ops() -> None:
            if ops:
                self._seq += 1
                body = {
                    "client_id": self.client_id,
                    "seq": self._seq,
                    "ops": [{"op": op.name, "args": op.args} for op in ops],
                }
                out.append(("json", self._seq, dumps(body), ops[0].run_id))
                ops.clear()

        last = self.last_steps
        for item in items:
            if type(item) is tuple:
                close_ops()
                run_id, step = item[0], item[1]
                if step > last.get(run_id, -1):
                    last[run_id] = step
                steps.append(item)
                points += len(item[2])
                if points >= MAX_POINTS:
                    close_steps()
            else:
                close_steps()
                ops.append(item)
        close_steps()
        close_ops()
        return out

    def _arrow(self, steps: list[tuple[int, int, dict[str, float], float]]) -> bytes:
        import pyarrow as pa

        run_ids: list[int] = []
        step_ids: list[int] = []
        keys: list[str] = []
        values: list[float] = []
        walls: list[float] = []
        for run_id, step, metrics, wall in steps:
            n = len(metrics)
            run_ids += [run_id] * n
            step_ids += [step] * n
            keys += metrics.keys()
            values += metrics.values()
            walls += [wall] * n
        table = pa.table(
            {
                "run_id": pa.array(run_ids, pa.int64()),
                "step": pa.array(step_ids, pa.int64()),
                "key": pa.array(keys, pa.string()).dictionary_encode(),
                "value": pa.array(values, pa.float64()),
                "wall_time": pa.array(walls, pa.float64()),
            }
        )
        sink = io.BytesIO()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return sink.getvalue()

    # -- delivery ------------------------------------------------------------------------
    def _deliver(self, kind: str, seq: int, body: bytes, run_id: int | None) -> None:
        if not self._spooled:
            try:
                post(self.client, self.client_id, seq, kind, body)
            except (StoreUnreachable, TokenRejected) as exc:
                self._spool(kind, seq, body, run_id, exc)
                return
            self._last_sent = time.monotonic()
            self.sent_batches += 1
            return
        self._spool(kind, seq, body, run_id, None)

    def _spool(
        self, kind: str, seq: int, body: bytes, run_id: int | None, why: BaseException | None
    ) -> None:
        folder = spool_folder(self._folder_of(run_id))
        self._spooled.append(write_spool(folder, self.client_id, seq, kind, body))
        if why is not None and not self._warned:
            self._warned = True
            log.warning(
                "lab: %s; batches are spooled to %s from batch %d on, the run goes on, and "
                "they are replayed when the server answers (or: lab sync RUN_DIR)",
                mask(str(why)),
                folder,
                seq,
            )
        self._next_probe = time.monotonic() + self._probe_s

    def _replay(self, *, force: bool) -> None:
        """Send the spooled batches in order, once the server answers again."""
        now = time.monotonic()
        if not force and now < self._next_probe:
            return
        self._next_probe = now + self._probe_s
        sent = 0
        while self._spooled:
            item = self._spooled[0]
            try:
                post(self.client, item.client_id, item.seq, item.kind, item.path.read_bytes(), 0.0)
            except (StoreUnreachable, TokenRejected):
                return
            item.path.unlink(missing_ok=True)
            self._spooled.pop(0)
            sent += 1
        if sent:
            self._warned = False
            self._last_sent = time.monotonic()
            shown = self.client.url.shown
            log.warning("lab: %s answers again; %d spooled batches replayed", shown, sent)

    def finish(self) -> None:
        """At close: replay the spool if the server answers; else say what is left."""
        if not self._spooled:
            return
        self._replay(force=True)
        folders = sorted({str(s.path.parent.parent) for s in self._spooled})
        if folders:
            log.warning(
                "lab: %d batches stay spooled (the server at %s does not answer); send them "
                "when it is back with: %s",
                len(self._spooled),
                self.client.url.shown,
                "; ".join(f"lab sync {f} --store {self.client.url.shown}" for f in folders),
            )

    def _beat(self) -> None:
        """Keep the heartbeat of the runs started here while nothing else is sent (a batch
        of metrics keeps theirs), and of the experiments driven here every half
        `heartbeat_s`, whatever else is sent, naming this process as their driver."""
        if self._spooled:
            return
        now = time.monotonic()
        args: dict[str, Any] = {}
        if self.active and now - self._last_sent >= self._heartbeat_s:
            args["run_ids"] = sorted(self.active)
        if self.driving and now - self._driven_at >= self._heartbeat_s / 2:
            args.update(experiment_ids=sorted(self.driving), owner=self.driver)
            self._driven_at = now
        if not args:
            return
        self._seq += 1
        body = {
            "client_id": self.client_id,
            "seq": self._seq,
            "ops": [{"op": "heartbeat", "args": args}],
        }
        with contextlib.suppress(LabError):  # not data: never spooled, never fails a run
            post(self.client, self.client_id, self._seq, "json", dumps(body), 0.0)
        if "run_ids" in args:
            self._last_sent = time.monotonic()


def post(
    client: HttpClient,
    client_id: str,
    seq: int,
    kind: str,
    body: bytes,
    window_s: float | None = None,
) -> dict[str, Any]:
    """Post one batch (again: the server stores it once) and return its answer."""
    if kind == "arrow":
        headers = {
            "Content-Type": "application/vnd.apache.arrow.stream",
            "X-Lab-Client": client_id,
            "X-Lab-Seq": str(seq),
        }
        path = "/batches/metrics"
    else:
        headers = {"Content-Type": "application/json"}
        path = "/batches/ops"
    answer = client._request(
        "POST", path, content=body, headers=headers, retry=True, window_s=window_s
    )
    return answer.json()
