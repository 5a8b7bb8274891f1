"""What `lab show` prints: an experiment as text (its arms, runs, arm summary, notes,
provenance and callback errors) or one run (where and how long it ran, its error and
traceback), from the record a store's `get_experiment` returns."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lab._table import fmt, plural, render
from lab.errors import ConfigError

if TYPE_CHECKING:
    from lab.sweeps.report import RaceTable, TrialRow


def experiment_text(
    exp: dict[str, Any],
    keys: list[str],
    rank: str | None,
    mode: str | None,
    race: RaceTable | None = None,
    trials: list[TrialRow] | None = None,
) -> Iterator[str]:
    """The text of ``lab show NAME``, part by part, each printed as it is made: an error in
    the arm summary (an unknown ``--mode``) comes after the tables before it. `keys`: the
    final metrics the runs table shows; `rank` and `mode`: what the arm summary ranks by;
    `race` and `trials`: the experiment's race and sampled arms (`lab.sweeps.report`)."""
    pruned = sum(1 for r in exp["runs"] if r["status"] == "pruned")
    counted = plural(len(exp["runs"]), "run") + (f" ({pruned} pruned)" if pruned else "")
    yield f"{exp['name']}: {exp['status']}, {counted}, seed {exp['seed']}"
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
    summary = _arm_summary(exp, rank, mode, race)
    if summary:
        yield f"\nsummary\n{summary}"
    if race is not None:
        yield f"\n{race_text(race)}"
    if trials:
        yield f"\n{trials_text(trials)}"
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


def race_text(table: RaceTable) -> str:
    """A race as text: a head line (metric, test, rounds, survivors, winner), each arm's mean
    and 95% interval after each closed round, and each elimination with its test, statistic
    and corrected p-value."""
    race, rounds = table["race"], table["rounds"]
    left = f"{len(table['survivors'])} of {plural(len(table['arms']), 'arm')} left"
    if table["over"]:
        state = f"over, winner {table['winner']}" if table["winner"] else "over"
    else:
        state = "running"
    lines = [
        f"race by {race['metric']} ({race['mode']}), {race['test']} test at alpha "
        f"{fmt(race['alpha'])}: {rounds} of {plural(race['max_repeats'], 'round')} closed, "
        f"{left}, {state}"
    ]
    cells: dict[str, list[str]] = {arm: ["-"] * rounds for arm in table["arms"]}
    for row in table["rows"]:
        cell = fmt(row["mean"])
        if row["ci_low"] is not None:
            cell += f" [{fmt(row['ci_low'])}, {fmt(row['ci_high'])}]"
        cells[row["arm"]][row["round"]] = cell + (" x" if row["eliminated"] else "")
    out = {e["arm"]: e["round"] for e in table["eliminations"]}
    lines.append(
        render(
            ("arm", "status", *(f"round {r}" for r in range(rounds))),
            [(arm, _race_status(arm, out, table), *cells[arm]) for arm in table["arms"]],
        )
    )
    if table["eliminations"]:
        lines.append("\neliminated (x: after that round; p: Holm-corrected, against alpha)")
        lines.append(
            render(
                ("arm", "round", "test", "statistic", "p", "alpha", "against"),
                [
                    (e["arm"], e["round"], e["test"], e["statistic"], e["p_value"], e["alpha"],
                     e["best"])
                    for e in table["eliminations"]
                ],
            )
        )  # fmt: skip
    return "\n".join(lines)


def _race_status(arm: str, out: dict[str, int], table: RaceTable) -> str:
    if arm in out:
        return f"out after round {out[arm]}"
    if arm == table["winner"]:
        return "winner"
    return "survived" if table["over"] else "racing"


def trials_text(rows: list[TrialRow]) -> str:
    """A sweep's sampled arms as text, in ask order: arm, parameters, value and state."""
    return "sampled arms\n" + render(
        ("trial", "arm", "params", "value", "state"),
        [(t["number"], t["arm"], json.dumps(t["params"]), t["value"], t["state"]) for t in rows],
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


def _arm_summary(
    exp: dict[str, Any], metric: str | None, mode: str | None, race: RaceTable | None
) -> str | None:
    """The arm summary of a recorded experiment, as `ExperimentResult.summary` gives it for
    one metric (`ExperimentResult.from_record`), the arms its `race` dropped marked and never
    ranked; None when no metric can rank it."""
    from lab.records import ExperimentResult
    from lab.sweeps.report import race_result

    result = ExperimentResult.from_record(exp)
    result.race = race_result(race) if race is not None else None
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
