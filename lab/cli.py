"""The `lab` command: a few lines over public functions each, library errors as one line."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from sqlalchemy.engine import make_url

from lab._table import render
from lab.errors import LabError

app = typer.Typer(
    help="Run torch experiments as arms x repeats, and read back what they recorded.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Inspect and migrate the store's schema.", no_args_is_help=True)
app.add_typer(db_app, name="db")

StoreOption = Annotated[
    str | None,
    typer.Option("--store", help="Store URL [default: $LAB_STORE_URL, else sqlite:///lab.db]"),
]
F = TypeVar("F", bound=Callable[..., Any])


def _clean_errors(fn: F) -> F:
    """Turn a `LabError` into one line on stderr and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except LabError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


@app.command()
@_clean_errors
def quickstart(
    store: StoreOption = None,
    output_dir: Annotated[str, typer.Option(help="Where run folders go")] = "runs",
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps per run")] = 300,
) -> None:
    """Run the demo experiment (2 arms x 3 repeats) into a store and print its summary."""
    from lab.demo import quickstart as run_demo
    from lab.store import resolve_url

    url = resolve_url(store)
    result = run_demo(url, output_dir=output_dir, steps=steps)
    keys = ("loss", "val/loss", "holdout/acc")
    typer.echo(str(result.summary("val/loss", "min", keys=keys)))
    shown = make_url(url).render_as_string(hide_password=True)
    typer.echo(f"\nRecorded in {shown}. Next: lab ls, lab show quickstart, or in Python:")
    typer.echo('  import lab.inspect; lab.inspect.connect("' + shown + '").sql(')
    typer.echo("      \"select arm, avg(value) from final_metrics where key = 'val/loss' "
               "group by arm\").df()")  # fmt: skip
    query = "select * from predictions limit 5"
    typer.echo("Per-example predictions of the holdout benchmark:")
    typer.echo(f'  lab.inspect.connect("{shown}").sql("{query}").df()')
    typer.echo("A walk-through of arms, curves and predictions: notebooks/quickstart.ipynb")


@app.command("run")
@_clean_errors
def run_file(
    file: Annotated[Path, typer.Argument(help="Experiment file: .yaml, .yml or .json")],
    store: StoreOption = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Check the file and show what would run; run nothing")
    ] = False,
) -> None:
    """Run the experiment an experiment file describes and print its summary.

    Exits 1 when the file is wrong (one line, nothing runs) and when any run failed (after
    the summary, one line naming the failures); 0 when every run completed or stopped.
    """
    from lab.experiment_file import plan, read_experiment_file
    from lab.store import resolve_url

    spec = read_experiment_file(file)
    exp = spec.build(store=store)
    if dry_run:
        typer.echo(f"{plan(exp)}\n\ndry run: nothing ran; to run it: lab run {file}")
        return
    result = exp.run()
    typer.echo(str(spec.summarize(result)))
    failed = [r for r in result.runs if r.status == "failed"]
    if failed:
        first = (failed[0].error or "failed").splitlines()[0]
        hint = ""
        if isinstance(exp.store, str):  # recorded: say where to look
            hint = f"; details: lab show {exp.name}"
            if exp.store != resolve_url(None):
                hint += f" --store {make_url(exp.store).render_as_string(hide_password=True)}"
        typer.echo(f"error: {len(failed)} of {len(result.runs)} runs failed "
                   f"({failed[0].run_key}: {first}){hint}", err=True)  # fmt: skip
        raise typer.Exit(1)


@app.command("ls")
@_clean_errors
def list_experiments(store: StoreOption = None) -> None:
    """List experiments with their status and run counts."""
    from lab.store import Store

    s = Store(store)
    try:
        rows = s.list_experiments()
    finally:
        s.close()
    if not rows:
        typer.echo("no experiments yet; try: lab quickstart")
        return
    typer.echo(
        render(
            (
                "experiment",
                "status",
                "arms",
                "repeats",
                "runs",
                "by status",
                "points",
                "created (UTC)",
                "tags",
            ),
            [
                (
                    r["name"],
                    r["status"],
                    r["arms"],
                    r["repeats"],
                    r["runs"],
                    ", ".join(f"{n} {k}" for k, n in sorted(r["runs_by_status"].items())),
                    r["points"],
                    r["created_at"].strftime("%Y-%m-%d %H:%M:%S"),
                    " ".join(r["tags"]),
                )
                for r in rows
            ],
        )
    )


@app.command()
@_clean_errors
def show(
    name: Annotated[str, typer.Argument(help="Experiment name")],
    store: StoreOption = None,
    metrics: Annotated[
        str, typer.Option(help="Comma-separated final metrics to show")
    ] = "loss,val/loss",
) -> None:
    """Show an experiment's arms, runs, statuses, newest steps and last metric values."""
    from lab.store import Store

    s = Store(store)
    try:
        exp = s.get_experiment(name)
    finally:
        s.close()
    keys = [k for k in metrics.split(",") if k]
    typer.echo(f"{exp['name']}: {exp['status']}, {len(exp['runs'])} runs, seed {exp['seed']}")
    if exp["tags"]:
        typer.echo(f"tags: {' '.join(exp['tags'])}")
    if exp["notes"]:
        typer.echo(f"notes: {exp['notes']}")
    typer.echo("\narms")
    typer.echo(
        render(("arm", "overrides"), [(a["name"], json.dumps(a["overrides"])) for a in exp["arms"]])
    )
    typer.echo("\nruns")
    typer.echo(
        render(
            ("run", "arm", "repeat", "seed", "status", "step", *keys, "tags", "error"),
            [
                (
                    r["run_key"],
                    r["arm"],
                    r["repeat"],
                    r["seed"],
                    r["status"],
                    r["step"],
                    *(r["summary"].get(k) for k in keys),
                    " ".join(r["tags"]),
                    r["error"] or "",
                )
                for r in exp["runs"]
            ],
        )
    )
    notes = [(r["run_key"], r["notes"]) for r in exp["runs"] if r["notes"]]
    if notes:
        typer.echo("\nrun notes")
        typer.echo(render(("run", "notes"), notes))
    _show_provenance(exp["runs"])
    failures = [(r["run_key"], f) for r in exp["runs"] for f in r["callback_errors"] or []]
    if failures:
        typer.echo("\ncallback errors (the runs went on)")
        typer.echo(
            render(
                ("run", "callback", "hook", "error"),
                [(key, f["callback"], f["hook"], f["error"]) for key, f in failures],
            )
        )


def _show_provenance(runs: list[dict[str, Any]]) -> None:
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
    typer.echo("\nprovenance (full record: lab.inspect.provenance; diff: <run folder>/git.diff)")
    rows = [
        (*key, ", ".join(keys) if len(groups) > 1 else f"all {len(keys)}")
        for key, keys in groups.items()
    ]
    typer.echo(render(("commit", "dirty", "python", "torch", "host", "command", "runs"), rows))


@app.command(context_settings={"ignore_unknown_options": True})
@_clean_errors
def tag(
    experiment: Annotated[str, typer.Argument(help="Experiment name")],
    changes: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[RUN_KEY] [+TAG | -TAG]...",
            help="A run of the experiment (else the experiment itself), then +TAG to add a "
            "tag and -TAG to remove one",
        ),
    ] = None,
    note: Annotated[
        str | None, typer.Option("--note", help="Set the notes ('' clears them)")
    ] = None,
    store: StoreOption = None,
) -> None:
    """Add or remove tags of an experiment or a run, set its notes, and print them.

    lab tag lr-sweep +baseline -draft --note "first sweep"; lab tag lr-sweep small-r0 +best
    """
    from lab.errors import ConfigError
    from lab.store import Store

    items = list(changes or [])
    run_key = items.pop(0) if items and items[0][:1] not in ("+", "-") else None
    bad = [item for item in items if item[:1] not in ("+", "-")]
    if bad:
        raise ConfigError(
            f"{bad[0]!r}: after the run key, write +TAG to add a tag and -TAG to remove one"
        )
    add = [item[1:] for item in items if item.startswith("+")]
    remove = [item[1:] for item in items if item.startswith("-")]
    s = Store(store)
    try:
        now = s.tag(experiment, run_key, add=add, remove=remove, notes=note)
    finally:
        s.close()
    what = experiment if run_key is None else f"{experiment} {run_key}"
    typer.echo(f"{what}: tags: {' '.join(now['tags']) or '-'}; notes: {now['notes'] or '-'}")


@app.command("export")
@_clean_errors
def export_experiment(
    name: Annotated[str, typer.Argument(help="Experiment name")],
    to: Annotated[str, typer.Option("--to", help="Folder for the Parquet files")],
    store: StoreOption = None,
) -> None:
    """Write one experiment's rows as Parquet files, one per table, into a folder."""
    from lab.export import export

    counts = export(name, to, store=store)
    typer.echo(render(("table", "rows"), list(counts.items())))
    typer.echo(f'\nWrote {to}/<table>.parquet. Read it back: lab.inspect.connect("{to}")')


@db_app.command("upgrade")
@_clean_errors
def db_upgrade(store: StoreOption = None) -> None:
    """Migrate the store's schema to the newest revision this lab knows."""
    from lab.store import Store
    from lab.store.migrations import upgrade

    s = Store(store, migrate=False)
    try:
        before, after = upgrade(s.engine)
    finally:
        s.close()
    where = s.engine.url.render_as_string(hide_password=True)
    if before == after:
        typer.echo(f"{where} is already at {after} (head)")
    else:
        typer.echo(f"upgraded {where} from {before or 'empty'} to {after}")


@db_app.command("current")
@_clean_errors
def db_current(store: StoreOption = None) -> None:
    """Print the store's schema revision, and whether it is the newest this lab knows."""
    from lab.store import Store
    from lab.store.migrations import current_revision, head_revision, is_known

    s = Store(store, migrate=False)
    try:
        current = current_revision(s.engine)
    finally:
        s.close()
    head = head_revision()
    if current is None:
        typer.echo(f"empty (no schema yet; head is {head}; run: lab db upgrade)")
    elif current == head:
        typer.echo(f"{current} (head)")
    elif not is_known(current):
        typer.echo(f"{current} (newer than this lab's {head}; run: pip install -U lab)")
    else:
        typer.echo(f"{current} (head is {head}; run: lab db upgrade)")


def main() -> None:
    """Entry point of the `lab` console script."""
    app(prog_name="lab")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
