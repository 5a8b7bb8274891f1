"""Writes to the store: what a run records as it trains: metrics (through the buffered
writer), evals with their predictions, checkpoint rows. One part of `lab.store.Store` (see
`lab.store.store`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from lab._metrics import all_floats, as_number, check_key
from lab._names import MAX_KEY, check_name
from lab.store._values import _free_text, _now, _text
from lab.store.engine import dumps_json, transaction
from lab.store.metric_rows import MetricRows
from lab.store.schema import (
    SqlCheckpoint,
    SqlEval,
)

if TYPE_CHECKING:
    from lab.records import EvalResult, ManifestRow
    from lab.store.writer import MetricWriter


_PREDICTION_FIELDS = ("example_id", "input", "output", "target", "score")


_PREDICTION_INSERT = (
    "INSERT INTO predictions (eval_id, idx, example_id, input, output, target, score, extras) "
    "VALUES ({m}, {m}, {m}, {m}, {m}, {m}, {m}, {m})"
)


class RecordWrites:
    """The part of `lab.store.Store` that writes a run's metrics, evals and checkpoint rows
    into the store behind `engine` (of `dialect`): metrics queued to the background writer
    that `writer` gives (started on first use), or written now through `metric_rows`."""

    def __init__(
        self,
        engine: Engine,
        dialect: str,
        metric_rows: MetricRows,
        writer: Callable[[], MetricWriter],
    ) -> None:
        self.engine = engine
        self.metric_rows = metric_rows
        self.writer = writer
        self._good_keys: set[str] = set()  # metric keys checked already
        mark = "%s" if dialect == "postgresql" else "?"
        self._prediction_insert = _PREDICTION_INSERT.format(m=mark)

    def log_metrics(
        self,
        run_id: int,
        step: int,
        metrics: dict[str, Any],
        *,
        floats: bool = False,
        keys: bool = False,
    ) -> None:
        """Queue one step's metrics; waits only while the buffer is full.

        Values must be numbers: ints, floats, numpy scalars and one-element tensors are
        taken (NaN and inf included); anything else raises `MetricError` naming the key and
        the step, and nothing of that step is queued. A copy is queued, so changing the dict
        afterwards changes nothing written. `floats=True` says the caller checked that every
        value is exactly a float (the loop's, through `SqlLogger.on_step_end_floats`): the
        pass over the types is skipped then. `keys=True` says the caller checked every key
        with `lab._metrics.check_key` (the loop's, for a step that logs the keys it logged
        before: `SqlLogger.on_step_end_checked`): the pass over the keys is skipped then.
        """
        row = dict(metrics)
        good = self._good_keys
        if not ((keys or good.issuperset(row)) and (floats or all_floats(row.values()))):
            for key, value in row.items():
                if key not in good:
                    self._check_key(key, step)
                if type(value) is not float:
                    row[key] = as_number(key, step, value)
        self.writer().put(run_id, step, row, time.time())

    def _check_key(self, key: Any, step: int) -> None:
        check_key(key, step)
        self._good_keys.add(key)

    def write_metric_columns(
        self,
        run_ids: Sequence[int],
        steps: Sequence[int],
        keys: Sequence[str],
        values: Sequence[float],
        wall_times: Sequence[float],
    ) -> None:
        """Write metric rows given as columns, now, in one transaction (with their
        summaries): what `lab serve` does with a batch a client sent, whose keys and values
        it has checked. The buffered `log_metrics` is the way for a training loop."""
        self.metric_rows.write_columns(run_ids, steps, keys, values, wall_times)

    def write_eval(
        self, run_id: int, result: EvalResult, predictions: list[dict[str, Any]] | None = None
    ) -> int:
        """Record an eval and its predictions, replacing an earlier one at the same step.

        An eval is keyed by (run, name, step), step None meaning after training: writing one
        again (a re-run, a resumed run scoring the same step) deletes the earlier row and,
        by cascade, its predictions, in the same transaction, so readers never see both.
        The predictions go in as one batched insert, `idx` in list order. The name is checked
        like an `Evaluator`'s; NUL in the error text is stored as U+FFFD.
        """
        check_name("eval", result.name, MAX_KEY)
        same = sa.and_(
            SqlEval.run_id == run_id,
            SqlEval.name == result.name,
            SqlEval.step.is_(None) if result.step is None else SqlEval.step == result.step,
        )
        with transaction(self.engine) as conn:
            conn.execute(sa.delete(SqlEval).where(same))
            eval_id = conn.execute(
                sa.insert(SqlEval)
                .values(
                    run_id=run_id,
                    name=result.name,
                    step=result.step,
                    metrics=result.metrics,
                    breakdowns=result.breakdowns,
                    tags=result.tags,
                    seconds=result.seconds,
                    error=_free_text(result.error),
                    created_at=_now(),
                )
                .returning(SqlEval.eval_id)
            ).scalar_one()
            if predictions:  # plain tuples through the driver: no per-row dict to compile
                conn.exec_driver_sql(
                    self._prediction_insert,
                    [_prediction_row(eval_id, i, p) for i, p in enumerate(predictions)],
                )
        return eval_id

    def write_checkpoint(self, run_id: int, row: ManifestRow) -> None:
        """Record one manifest row (a save or a removal)."""
        with transaction(self.engine) as conn:
            conn.execute(
                sa.insert(SqlCheckpoint).values(
                    run_id=run_id,
                    step=row.step,
                    path=row.path,
                    event=row.event,
                    metrics=row.metrics,
                    reason=row.reason,
                    created_at=datetime.fromtimestamp(row.time, UTC).replace(tzinfo=None),
                )
            )


def _prediction_row(eval_id: int, idx: int, pred: dict[str, Any]) -> tuple[Any, ...]:
    """One prediction as the driver's parameters: the known fields, the rest as JSON.

    A NaN score is stored as NULL (no score) on both backends. SQLite cannot keep a NaN
    apart from NULL, and a score column that held NaN on PostgreSQL only would make the
    same eval average to NaN there and to a number on SQLite. ±inf is kept.
    """
    get = pred.get
    extras = {k: v for k, v in pred.items() if k not in _PREDICTION_FIELDS}
    example_id = get("example_id")
    score = get("score")
    if score is not None:
        score = float(score)
        if score != score:  # NaN
            score = None
    return (
        eval_id,
        idx,
        None if example_id is None else _text(str(example_id)),
        _text(get("input")),
        _text(get("output")),
        _text(get("target")),
        score,
        dumps_json(extras) if extras else None,
    )
