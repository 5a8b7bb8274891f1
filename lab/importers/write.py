"""How a `Source` that was read whole becomes a `lab` experiment, through the store's public
methods: an experiment, an arm and a group per arm, and per source run a run with its
config, its metric columns (step, value, wall time as the source recorded them), its
status, tags and final values. Importing again adds only what is new."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from lab.errors import ConfigError
from lab.importers.core import (
    ImportResult,
    Source,
    SourceRun,
    check_source,
    iso,
    plan,
    run_key,
)


@contextmanager
def opened(store: Any) -> Iterator[Any]:
    """The store to import into: `store` itself when it is one (left open), else the SQL
    store at that URL (None: ``LAB_STORE_URL``, else ``sqlite:///lab.db``), closed after."""
    if store is not None and not isinstance(store, str):
        yield _writable(store)
        return
    from lab.store import open_store

    s = open_store(store)
    try:
        yield _writable(s)
    finally:
        s.close()


def _writable(store: Any) -> Any:
    if not hasattr(store, "write_metric_columns"):
        raise ConfigError(
            "lab import writes into a SQL store (sqlite:// or postgresql://), not through a "
            "lab serve server: give --store the server's database URL"
        )
    return store


def write_source(
    source: Source, store: Any, *, name: str | None = None, arm_by: Sequence[str] = ()
) -> ImportResult:
    """Write `source` into `store` as the experiment `name` (default: the source's) and
    say what was added; nothing is written when nothing is new."""
    experiment = name or source.name
    check_source(source)
    existing = _existing(store, experiment, source.kind, list(arm_by))
    where = plan(source.runs, arm_by)
    added: list[SourceRun] = []
    grown: dict[str, tuple[SourceRun, dict[str, list[tuple[int, float, float]]]]] = {}
    unchanged: list[str] = []
    for run in source.runs:
        key = run_key(source.kind, run.source_id)
        before = existing.get(key)
        if before is None:
            added.append(run)
            continue
        new = _new_points(store, before["run_id"], run)
        if new or before["status"] != run.status:
            grown[key] = (run, new)
        else:
            unchanged.append(key)
    result = ImportResult(
        experiment=experiment,
        kind=source.kind,
        added=[run_key(source.kind, r.source_id) for r in added],
        grown={k: sum(map(len, new.values())) for k, (_r, new) in grown.items()},
        unchanged=unchanged,
        points=sum(len(p) for r in added for p in r.metrics.values()),
    )
    result.points += sum(result.grown.values())
    if not added and not grown:
        return result
    exp_id = store.begin_experiment(
        experiment,
        config={"imported_from": source.kind, "location": source.location, "arm_by": list(arm_by)},
        seed=0,
        repeats=max([*where.repeat.values(), 0]) + 1,
    )
    _renumber(added, where, existing)
    for run in added:
        _add_run(store, exp_id, source, run, where)
    for run, new in grown.values():
        run_id = existing[run_key(source.kind, run.source_id)]["run_id"]
        _write_points(store, run_id, new)
        _finish(store, run_id, run)
    store.finish_experiment(exp_id, status="completed")
    return result


def _existing(store: Any, experiment: str, kind: str, arm_by: list[str]) -> dict[str, Any]:
    """The runs of `experiment` by key, if it exists and was imported from `kind` with the
    same arms; any other experiment of that name is refused, untouched."""
    if experiment not in {e["name"] for e in store.list_experiments()}:
        return {}
    exp = store.get_experiment(experiment)
    config = exp.get("config") or {}
    if config.get("imported_from") != kind:
        raise ConfigError(
            f"experiment {experiment!r} exists and was not imported from {kind}; import into "
            "another experiment with --name NAME"
        )
    if list(config.get("arm_by") or []) != arm_by:
        was = ",".join(config.get("arm_by") or []) or "none (a run per arm)"
        raise ConfigError(
            f"experiment {experiment!r} was imported with --arm-by {was}; import again with "
            "the same --arm-by, or into another experiment with --name NAME"
        )
    return {r["run_key"]: r for r in exp["runs"]}


def _new_points(
    store: Any, run_id: int, run: SourceRun
) -> dict[str, list[tuple[int, float, float]]]:
    """The points of `run` at steps the store does not hold for their key."""
    new = {}
    for key, points in run.metrics.items():
        have = {step for step, _value in store.metric_values(run_id, key)}
        more = [p for p in points if p[0] not in have]
        if more:
            new[key] = more
    return new


def _renumber(added: list[SourceRun], where: Any, existing: dict[str, Any]) -> None:
    """New runs of an arm that holds imported runs already take the repeats after theirs."""
    last: dict[str, int] = {}
    for r in existing.values():
        if r.get("arm") is not None:
            last[r["arm"]] = max(last.get(r["arm"], -1), r["repeat"])
    for run in sorted(added, key=lambda r: where.repeat[r.source_id]):
        arm = where.arm[run.source_id]
        if arm in last:
            last[arm] += 1
            where.repeat[run.source_id] = last[arm]


def _add_run(store: Any, exp_id: int, source: Source, run: SourceRun, where: Any) -> None:
    sid = run.source_id
    arm = where.arm[sid]
    arm_id = store.add_arm(exp_id, arm, overrides=where.overrides[sid], config=where.overrides[sid])
    group_id = store.add_group(exp_id, arm, kind="repeats", arm_id=arm_id)
    provenance = {
        "imported_from": {
            "source": source.kind,
            "location": source.location,
            "run_id": sid,
            "name": run.name,
            "started_at": iso(run.started_at),
            "ended_at": iso(run.ended_at),
            **run.extra,
        }
    }
    run_id = store.start_run(
        exp_id, group_id, run_key=run_key(source.kind, sid), arm_id=arm_id,
        repeat=where.repeat[sid], stage=0, seed=where.seed[sid], config=run.config,
        output_dir=None, provenance=provenance,
    )  # fmt: skip
    _write_points(store, run_id, run.metrics)
    _finish(store, run_id, run)


def _write_points(store: Any, run_id: int, metrics: dict[str, list[tuple[int, float, float]]]):
    """One run's points as columns, in one transaction."""
    keys = [k for k, points in metrics.items() for _ in points]
    points = [p for ps in metrics.values() for p in ps]
    if points:
        steps, values, walls = (list(c) for c in zip(*points, strict=True))
        store.write_metric_columns([run_id] * len(points), steps, keys, values, walls)


def _finish(store: Any, run_id: int, run: SourceRun) -> None:
    final = {k: max(points)[1] for k, points in run.metrics.items() if points}
    store.finish_run(run_id, status=run.status, error=run.error, summary=final, tags=run.tags)
