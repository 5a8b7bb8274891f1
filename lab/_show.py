"""What `lab show` prints: an experiment as text (its arms, runs, arm summary, notes,
provenance and callback errors) or one run (where and how long it ran, its error and
traceback), from the record a store's `get_experiment` returns."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from lab._table import plural, render
from lab.errors import ConfigError


def experiment_text(
    exp: dict[str, Any], keys: list[str], rank: str | None, mode: str | None
) -> Iterator[str]:
    """The text of ``lab show NAME``, part by part, each printed as it is made: an error in
    the arm summary (an unknown ``--mode``) comes after the tables before it. `keys`: the
    final metrics the runs table shows; `rank` and `mode`: what the arm summary ranks by."""
    yield f"{exp['name']}: {exp['status']}, {plural(len(exp['runs']), 'run')}, seed {exp['seed']}"
    if exp["tags"]:
        yield f"tags: {' '.join(exp['tags'])}"
    if exp["notes"]:
        yield f"notes: {exp['notes']}"
    yield "\narms"
    yield render(
        ("arm", "overrides"), [(a["name"], json.dumps(a["overrides"])) for a in exp["arms"]]
    )
    yield "\nruns"
    yield _runs_table(exp["runs"], keys)
    summary = _arm_summary(exp, rank, mode)
    if summary:
        yield f"\nsummary\n{summary}"
    notes = [(r["run_key"], r["notes"]) for r in exp["runs"] if r["notes"]]
    if notes:
        yield "\nrun notes"
        yield render(("run", "notes"), notes)
    yield from _provenance(exp["runs"])
    if exp["superseded"]:
        kept = plural(exp["superseded"], "superseded run")
        verb = "is" if exp["superseded"] == 1 else "are"
        yield f"\n{kept} {verb} kept (fresh starts); lab.inspect's all_runs view lists them"
    failures = [(r["run_key"], f) for r in exp["runs"] for f in r["callback_errors"] or []]
    if failures:
        yield "\ncallback errors (the runs went on)"
        yield render(
            ("run", "callback", "hook", "error"),
            [(key, f["callback"], f["hook"], f["error"]) for key, f in failures],
        )


def _runs_table(runs: list[dict[str, Any]], keys: list[str]) -> str:
    """The runs of an experiment, one row each, with their final values of `keys`."""
    columns = ("run", "arm", "repeat", "seed", "status", "step", *keys, "duration", "host",
               "tags", "error")  # fmt: skip
    rows = [
        (r["run_key"], r["arm"], r["repeat"], r["seed"], r["status"], r["step"],
         *(r["summary"].get(k) for k in keys), _duration(r), r["host"], " ".join(r["tags"]),
         r["error"] or "")
        for r in runs
    ]  # fmt: skip
    return render(columns, rows)


def _arm_summary(exp: dict[str, Any], metric: str | None, mode: str | None) -> str | None:
    """The arm summary of a recorded experiment, as `ExperimentResult.summary` gives it for
    one metric (`ExperimentResult.from_record`); None when no metric can rank it."""
    from lab.records import ExperimentResult

    result = ExperimentResult.from_record(exp)
    chosen = result.summary(metric, mode, keys=[])  # type: ignore[arg-type]  # checked there
    if chosen.metric is None:
        return None
    return str(result.summary(chosen.metric, chosen.mode, keys=[chosen.metric]))


def _provenance(runs: list[dict[str, Any]]) -> Iterator[str]:
    """One line per distinct provenance (commit, dirty, python, torch, host, command), with
    the runs that share it: most experiments print one line."""
    from lab.provenance import compact

    groups: dict[tuple[Any, ...], list[str]] = {}
    for run in runs:
        p = compact(run["provenance"])
        if not p:
            continue
        commit = p["commit"][:12] if p["commit"] else f"none ({p['note'] or 'unknown'})"
        dirty = {True: "yes", False: "no"}.get(p["dirty"], "-")
        key = (commit, dirty, p["python"], p["torch"], p["host"], p["command"])
        groups.setdefault(key, []).append(run["run_key"])
    if not groups:
        return
    yield "\nprovenance (full record: lab.inspect.provenance; diff: <run folder>/git.diff)"
    rows = [
        (*key, ", ".join(keys) if len(groups) > 1 else f"all {len(keys)}")
        for key, keys in groups.items()
    ]
    yield render(("commit", "dirty", "python", "torch", "host", "command", "runs"), rows)


def _duration(run: dict[str, Any]) -> str | None:
    """How long a run ran, from its start to its end (None while it runs)."""
    if run["started_at"] is None or run["ended_at"] is None:
        return None
    seconds = max((run["ended_at"] - run["started_at"]).total_seconds(), 0.0)
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    if hours:
        return f"{hours}:{minutes:02d}:{int(secs):02d}"
    return f"{minutes}:{int(secs):02d}" if minutes else f"{secs:.1f}s"


def run_text(exp: dict[str, Any], run_key: str) -> str:
    """One run as text: identity, status, where and how long it ran, error and traceback."""
    runs = {r["run_key"]: r for r in exp["runs"]}
    r = runs.get(run_key)
    if r is None:
        known = ", ".join(runs) or "none"
        raise ConfigError(f"no run {run_key!r} in experiment {exp['name']!r}; runs: {known}")
    when = "-" if r["started_at"] is None else r["started_at"].strftime("%Y-%m-%d %H:%M:%S")
    lines = [
        f"{exp['name']} / {r['run_key']}: {r['status']}",
        f"arm {r['arm']}, repeat {r['repeat']}, stage {r['stage']}, seed {r['seed']}, "
        f"step {r['step'] if r['step'] is not None else '-'}",
        f"host {r['host'] or '-'}, pid {r['pid'] or '-'}, started {when} UTC, "
        f"duration {_duration(r) or '- (not ended)'}",
    ]
    if r["error"]:
        lines.append(f"error: {r['error']}")
    if r["traceback"]:
        lines += ["", r["traceback"].rstrip()]
    elif r["status"] == "failed":
        lines.append("no traceback was recorded")
    return "\n".join(lines)
