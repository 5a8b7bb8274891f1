"""The background sender: posts what a run writes, in order, in idempotent batches.

The training thread hands metric steps and other writes to the same bounded buffer the
local store uses (`lab.store.writer.MetricWriter`), so `log_metrics` costs it the same: an
append. The writer thread calls `Sender.send` with whatever piled up; the sender cuts it into
batches in order (runs of other writes become one JSON list, runs of metric steps one Arrow
IPC body, or, when they are few and the server takes them there, a metrics op among the
JSON list's writes, so that a short run's writes make one request), numbers each batch 1,
2, 3... under its client id as it first sends it, and posts it, retrying with a capped
exponential backoff for up to the retry window.

What the server answers decides what happens to a batch:

- **Taken** (2xx): done.
- **An outage**: no answer, or an answer that says it cannot take writes now (a 5xx: 503
  while its store is down, a 500) for longer than the retry window. The batch goes to the
  spool (`lab.store.http.spool`) and one warning line says so; every later batch follows it
  there, so the order holds. The run goes on. On each later call (at least every `probe_s`)
  the sender tries the server again and, once it answers, replays the spool in sequence
  order before anything new.
- **The token refused** (401, 403: wrong, revoked, or not allowed to write): the batch and
  every later one are spooled, nothing is dropped, and the run fails at its next step or
  flush with the `TokenRejected` line, which says how to send them (``lab sync``) with a
  token the server takes.
- **Too large** (413): the batch is cut in two halves, sent as two batches, down to one
  step or one write.
- **Bad data** (any other 4xx: the server says the rows themselves are wrong): the batch is
  dropped, with one warning line naming what it held (how many rows or writes, of which
  run), the status and the server's reason. The run goes on. This is the only way a batch
  is ever dropped.

A batch that can be neither sent nor spooled (the run folder's disk is full) is not taken:
`send` raises `PartlyWritten`, and the writer keeps that batch and everything after it in its
buffer, in order, and tries again (the batches before it are not sent twice). The buffer then
fills and back-pressure holds the training thread, and past the retry window a flush fails
with the count, naming ``LAB_HTTP_RETRY_S``. `flush` therefore returns once everything queued
is acknowledged, spooled, or dropped as bad data with a line.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab._secrets import logger, mask
from lab._table import plural
from lab.errors import LabError, StoreError, TokenRejected
from lab.store.http.spool import Spooled, describe, set_aside, spool_folder
from lab.store.http.spool import write as write_spool
from lab.store.writer import PartlyWritten

if TYPE_CHECKING:
    import httpx

    from lab.store.http.client import HttpClient

log = logger("lab.store.http")

#: The most metric points in one Arrow batch (about 10 MB), well under a server's body limit
#: and half the rows a server takes in one (`lab.server.bodies.MAX_BATCH_ROWS`).
MAX_POINTS = 250_000
#: The most operations in one JSON batch: a tenth of what a server takes in one
#: (`lab.server.bodies.MAX_BATCH_OPS`).
MAX_OPS = 1_000
#: The most bytes of operations in one JSON batch (an image travels in one, as base64),
#: an eighth of a server's default body limit.
MAX_OPS_BYTES = 8 * 1024 * 1024
#: The most metric points a run of steps may hold to travel in a JSON batch, with the writes
#: around it (a server that takes the metrics op); a larger one is an Arrow batch.
MAX_JSON_POINTS = 5_000
# What a step and each of its points add to a JSON batch, about: for MAX_OPS_BYTES.
_STEP_BYTES, _POINT_BYTES = 48, 32
#: The answers that refuse a batch as it is (bad data, or too large: 413), rather than say the
#: server cannot take it now (408, 429, 5xx) or that the token may not (401, 403).
REFUSED = tuple(s for s in range(400, 500) if s not in (401, 403, 408, 429))


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


def _ops(items: list[Any]) -> list[dict[str, Any]]:
    """The operations of a JSON batch: each `Op` as itself, and each run of metric steps
    between them as one metrics op, a step each (`lab.server.ops.MetricStep`)."""
    ops: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] | None = None
    for item in items:
        if type(item) is not tuple:
            ops.append({"op": item.name, "args": item.args})
            steps = None
            continue
        if steps is None:
            steps = []
            ops.append({"op": "metrics", "args": {"steps": steps}})
        run_id, step, metrics, wall = item
        steps.append({"run_id": run_id, "step": step, "wall_time": wall, "values": metrics})
    return ops


def _plain(value: Any) -> Any:
    for attr in ("item", "tolist"):  # numpy scalars and arrays, tensors
        fn = getattr(value, attr, None)
        if callable(fn):
            try:
                return fn()
            except (TypeError, ValueError, RuntimeError):
                pass
    return str(value)


class _Batch:
    """A batch cut from the queue: its kind, its items, the run its first item belongs to
    (where it spools), and, once it is first posted or spooled, its sequence number and
    body."""

    __slots__ = ("body", "items", "kind", "run_id", "seq")

    def __init__(self, kind: str, items: list[Any], run_id: int | None) -> None:
        self.kind, self.items, self.run_id = kind, items, run_id
        self.seq: int | None = None
        self.body = b""


class _Cut:
    """The batches `Sender._batches` cuts as it walks the queue, into `out`: the open run of
    other writes (JSON) and the open run of metric steps (Arrow, or JSON when it is small)."""

    def __init__(self, json_points: int, out: list[_Batch]) -> None:
        self.json_points = json_points
        self.out = out
        self.steps: list[tuple[int, int, dict[str, float], float]] = []
        self.points = 0
        self.ops: list[Any] = []
        self.ops_bytes = 0

    def close_ops(self) -> None:
        if self.ops:
            first = self.ops[0]
            run_id = first[0] if type(first) is tuple else first.run_id
            self.out.append(_Batch("json", self.ops, run_id))
            self.ops, self.ops_bytes = [], 0

    def add_op(self, item: Any, size: int) -> None:
        if self.ops and (len(self.ops) >= MAX_OPS or self.ops_bytes + size > MAX_OPS_BYTES):
            self.close_ops()
        self.ops.append(item)
        self.ops_bytes += size

    def add_step(self, item: tuple[int, int, dict[str, float], float]) -> None:
        if self.steps and self.points + len(item[2]) > MAX_POINTS:
            self.close_steps()
        self.steps.append(item)
        self.points += len(item[2])

    def close_steps(self) -> None:
        if not self.steps:
            return
        if self.json_points and self.points <= self.json_points:
            for step in self.steps:
                self.add_op(step, _STEP_BYTES + _POINT_BYTES * len(step[2]))
        else:
            self.close_ops()
            self.out.append(_Batch("arrow", self.steps, self.steps[0][0]))
        self.steps, self.points = [], 0


class Sender:
    """Posts batches for one `HttpStore` (`client`), spooling them when it cannot.

    `folder_of(run_id)` gives a run's folder (where its batches spool). `json_points`: the
    most points a run of metric steps may hold to travel in a JSON batch, among the other
    writes (`MAX_JSON_POINTS` for a server that takes the metrics op; 0, never, for one
    that does not).
    """

    def __init__(
        self,
        client: HttpClient,
        client_id: str,
        folder_of: Callable[[int | None], str | None],
        *,
        heartbeat_s: float,
        probe_s: float = 1.0,
        json_points: int = 0,
    ) -> None:
        self.client = client
        self.json_points = json_points
        self.client_id = client_id
        self._folder_of = folder_of
        self._seq = 0
        self._spooled: list[Spooled] = []  # in seq order, not yet replayed
        # The batch that was posted and then could not be spooled, kept numbered: its items
        # come back first, and are sent as the same (client, seq), stored once at most.
        self._unsent: _Batch | None = None
        self._warned = False
        self._next_probe = 0.0
        self._probe_s = probe_s
        self._heartbeat_s = heartbeat_s
        self._last_sent = time.monotonic()
        self._why: str | None = None  # why the spool is not replayed yet: the last refusal
        self.active: set[int] = set()  # runs started and not finished: heartbeats
        self.driving: set[int] = set()  # experiments begun and not finished: heartbeats
        self.driver: dict[str, Any] = {}  # this process, as the driver of those
        self._driven_at = -math.inf
        self.last_steps: dict[int, int] = {}  # the highest step queued per run
        self.sent_batches = 0
        #: Set while the server refuses the token: the run fails with it (`HttpWrites`).
        self.refused: TokenRejected | None = None

    def began(self, experiment_id: int) -> None:
        """Keep the heartbeat of an experiment this process began: its begin recorded the
        driver and the heartbeat, so the first beat is due half a heartbeat later (or
        with the beat of the experiments it drives already)."""
        if not self.driving:
            self._driven_at = time.monotonic()
        self.driving.add(experiment_id)

    @property
    def spooled(self) -> list[Path]:
        """The files spooled and not replayed yet."""
        return [s.path for s in self._spooled]

    # -- called by the writer thread -----------------------------------------------------
    def send(self, items: list[Any]) -> None:
        """Deliver `items` (metric steps and `Op`s, in order): send, spool or drop each
        batch as the server's answer says. Raises `PartlyWritten` with how many items are
        done when a batch can be neither sent nor spooled: that one and the rest stay with
        the writer."""
        if self._spooled:  # (at once when a batch is back because it could not be spooled)
            self._replay(force=self._unsent is not None)
        if not items:
            self._beat()
            return
        queue = deque(self._batches(items))
        done = 0
        while queue:
            batch = queue.popleft()
            try:
                halves = self._deliver(batch)
            except OSError as exc:
                self._unsent = batch if batch.seq is not None else None
                raise PartlyWritten(done, self._unspoolable(batch, exc)) from exc
            queue.extendleft(reversed(halves))
            if not halves:
                done += len(batch.items)
        self._beat()

    def _batches(self, items: list[Any]) -> list[_Batch]:
        """Cut `items` into consecutive batches, in order: runs of other writes (up to
        `MAX_OPS` items and about `MAX_OPS_BYTES`) as JSON, and runs of metric steps (up to
        `MAX_POINTS` points; a step is never split) as Arrow, except that a run of at most
        `json_points` points joins the JSON batch around it: what a flush sends is then
        one request. The batch that could not be
        spooled last time, which comes back first, is cut as it was."""
        out: list[_Batch] = []
        unsent, self._unsent = self._unsent, None
        n = len(unsent.items) if unsent is not None else 0
        if unsent is not None and len(items) >= n and items[n - 1] is unsent.items[-1]:
            out.append(unsent)
            items = items[n:]
        cut = _Cut(self.json_points, out)
        last = self.last_steps
        for item in items:
            if type(item) is tuple:
                run_id, step = item[0], item[1]
                if step > last.get(run_id, -1):
                    last[run_id] = step
                cut.add_step(item)
            else:
                cut.close_steps()
                if item.name == "truncate_run":  # what is queued after it counts from there
                    after = item.args["after_step"]
                    if after is None:
                        last.pop(item.run_id, None)
                    else:
                        last[item.run_id] = after
                cut.add_op(item, len(dumps({"op": item.name, "args": item.args})))
        cut.close_steps()
        cut.close_ops()
        return out

    def _number(self, batch: _Batch) -> _Batch:
        """Give `batch` the next sequence number and its body, the first time it leaves."""
        if batch.seq is None:
            self._seq += 1
            batch.seq = self._seq
            if batch.kind == "arrow":
                batch.body = self._arrow(batch.items)
            else:
                ops = _ops(batch.items)
                batch.body = dumps({"client_id": self.client_id, "seq": batch.seq, "ops": ops})
        return batch

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
    def _deliver(self, batch: _Batch) -> list[_Batch]:
        """Post `batch`, spool it, or drop it as bad data; returns the two halves to send
        instead when the server found it too large. Raises `OSError` when it must be spooled
        and cannot be."""
        if self._spooled or self.refused is not None:
            self._spool(self._number(batch), None)
            return []
        self._number(batch)
        assert batch.seq is not None
        try:
            answer = post(self.client, self.client_id, batch.seq, batch.kind, batch.body)
        except StoreError as exc:  # no answer, one that says "not now", a refused token
            self._spool(batch, exc)
            return []
        if answer.status_code < 300:
            self._last_sent = time.monotonic()
            self.sent_batches += 1
        elif answer.status_code == 413 and len(batch.items) > 1:
            middle = len(batch.items) // 2
            halves = (batch.items[:middle], batch.items[middle:])
            return [_Batch(batch.kind, half, batch.run_id) for half in halves]
        else:
            line = refusal(self.client, batch.kind, batch.body, f"batch {batch.seq}", answer)
            log.warning("lab: %s; it is dropped, the run goes on", line)
        return []

    def _spool(self, batch: _Batch, why: BaseException | None) -> None:
        assert batch.seq is not None
        folder = spool_folder(self._folder_of(batch.run_id))
        self._spooled.append(write_spool(folder, self.client_id, batch.seq, batch.kind, batch.body))
        if isinstance(why, TokenRejected):
            self._token_refused(why, folder)
        elif why is not None and not self._warned:
            self._warned = True
            log.warning(
                "lab: %s; batches are spooled to %s from batch %d on, the run goes on, and "
                "they are replayed when the server answers (or: lab sync RUN_DIR)",
                mask(str(why)),
                folder,
                batch.seq,
            )
        if why is not None:
            self._why = _answered(why)
        self._next_probe = time.monotonic() + self._probe_s

    def _token_refused(self, why: TokenRejected, folder: Path) -> None:
        """The server refused the token: from now on every batch is spooled, and the run
        fails with this line (what was refused, where the batches are, how to send them)."""
        if self.refused is None:
            self.refused = TokenRejected(
                f"{why}; the run stops, and its batches are kept in {folder}: "
                f"send them with a token the server takes: lab sync {folder.parent} --store "
                f"{self.client.url.shown}"
            )

    def _unspoolable(self, batch: _Batch, exc: OSError) -> OSError:
        """The error for a batch that can be neither sent nor spooled: what it holds, where
        it was to go, and why it cannot."""
        points = sum(len(item[2]) for item in batch.items if type(item) is tuple)
        writes = sum(1 for item in batch.items if type(item) is not tuple)
        what = " and ".join(
            [plural(points, "metric row")] * bool(points or not writes)
            + [plural(writes, "write")] * bool(writes)
        )
        folder = spool_folder(self._folder_of(batch.run_id))
        return OSError(
            f"a batch of {what} can be neither sent to {self.client.url.shown} nor spooled "
            f"to {folder}: {exc.strerror or exc}"
        )

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
                refused = replay(self.client, item)
            except StoreError as exc:  # not now, or not with this token: it stays
                self._why = _answered(exc)
                if isinstance(exc, TokenRejected):
                    self._token_refused(exc, item.path.parent)
                return
            self._spooled.pop(0)
            if refused is not None:
                log.warning("lab: %s", refused)
            sent += 1
        self.refused = None  # (the server takes the token again, if it did not)
        if sent:
            self._warned = False
            self._last_sent = time.monotonic()
            shown = self.client.url.shown
            log.warning("lab: %s answers again; %d spooled batches replayed", shown, sent)

    def finish(self) -> None:
        """At close: replay the spool if the server answers; else say, in one line, what is
        left and what to do."""
        if self._spooled:
            self._replay(force=True)
        folders = sorted({str(s.path.parent.parent) for s in self._spooled})
        if folders:
            shown = self.client.url.shown
            log.warning(
                "lab: %d batches stay spooled (%s); send them when it is back with: %s",
                len(self._spooled),
                self._why or f"the server at {shown} does not answer",
                "; ".join(f"lab sync {f} --store {shown}" for f in folders),
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


def _answered(exc: BaseException) -> str | None:
    """What the server answered, as `exc` says it (a 503, a refused token), or None when it
    did not answer at all."""
    return None if getattr(exc, "status", None) is None else mask(str(exc))


def replay(client: HttpClient, item: Spooled, window_s: float | None = 0.0) -> str | None:
    """Send one spooled batch again and remove its file once the server took it (None).
    A batch the server refuses as bad data is set aside (``.rejected``), and the line that
    says so is returned. One it cannot take now stays, and this raises
    (`StoreUnreachable`, `TokenRejected`, `StoreError`)."""
    body = item.path.read_bytes()
    answer = post(client, item.client_id, item.seq, item.kind, body, window_s)
    if answer.status_code < 300:
        item.path.unlink(missing_ok=True)
        return None
    aside = set_aside(item)
    return refusal(client, item.kind, body, f"spooled batch {item.path.name}", answer) + (
        f"; it is set aside as {aside}"
    )


def refusal(client: HttpClient, kind: str, body: bytes, name: str, answer: Any) -> str:
    """The line for a batch the server refused as it is (bad data, or too large even alone):
    what it held (how many rows or writes, of which run), the status and the server's
    reason."""
    try:
        held = describe(kind, body)
    except ValueError as exc:
        held = f"a damaged body: {exc}"
    why = mask(str(client._refused(answer)))
    status = answer.status_code
    how = "as too large" if status == 413 else "as bad data"
    return f"{client.url.shown} refused {name} ({held}) {how} ({status}: {why})"


def post(
    client: HttpClient,
    client_id: str,
    seq: int,
    kind: str,
    body: bytes,
    window_s: float | None = None,
) -> httpx.Response:
    """Post one batch (again: the server stores it once) and return the server's answer:
    taken (2xx), or refused as it is (`REFUSED`: bad data, too large). Raises when the
    server does not take it now (no answer or 5xx past the window: `StoreUnreachable`,
    `StoreError`) or refuses the token (`TokenRejected`)."""
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
    return client._request(
        "POST", path, content=body, headers=headers, retry=True, window_s=window_s, allow=REFUSED
    )
