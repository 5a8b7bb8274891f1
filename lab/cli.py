"""The `lab` command: a few lines over public functions each, library errors as one line."""

from __future__ import annotations

import functools
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ParamSpec, TypeVar, cast

import typer

from lab._secrets import mask
from lab._table import plural, render
from lab.errors import ConfigError, LabError, NoStore, Terminated

if TYPE_CHECKING:  # imported inside the commands: `lab --help` and `lab ls` load no torch,
    # numpy nor SQLAlchemy (tests/test_cli_startup.py)
    from lab.experiment import Experiment
    from lab.records import ExperimentResult, Summary
    from lab.server.auth import Scope
    from lab.store.urls import StoreURL

# Plain help text: Rich markup would swallow "[default: ...]" and give flags a "<bool>".
app = typer.Typer(
    help="Run torch experiments as arms x repeats, and read back what they recorded.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
db_app = typer.Typer(
    help="Inspect and migrate the store's schema.", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(db_app, name="db")
token_app = typer.Typer(
    help=(
        "Make, list and revoke the tokens a lab serve server accepts.\n\n"
        "Scopes: read reads every experiment; write reads, and writes the experiments it "
        "created through the server; admin reads and writes every experiment. A token made "
        "with --experiment EXP reads and writes only EXP, whoever created it: how an operator "
        "grants an experiment another token made, or one recorded by a local process (which "
        "only such a token or an admin token may write through the server). Writing an "
        "experiment the token may not is answered 403; docs/serve.md, 'Who may write what'."
    ),
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(token_app, name="token")
import_app = typer.Typer(
    help=(
        "Bring runs recorded by MLflow, wandb or TensorBoard into the store, as an "
        "experiment (docs/importing.md). Importing the same runs again adds only what is new."
    ),
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(import_app, name="import")

StoreOption = Annotated[
    str | None,
    typer.Option(
        "--store",
        metavar="URL",
        help="Store URL [default: $LAB_STORE_URL, else sqlite:///lab.db]",
    ),
]
AllMetricsOption = Annotated[
    bool,
    typer.Option(
        "--all-metrics", help="Show every final metric in the summary, lr and step_time too"
    ),
]
FreshOption = Annotated[
    bool,
    typer.Option(
        "--fresh",
        help="Train every run afresh; the runs recorded before are kept, marked superseded",
    ),
]
FileArgument = Annotated[
    Path, typer.Argument(metavar="FILE", help="Experiment file: .yaml, .yml or .json")
]
OverridesArgument = Annotated[
    list[str] | None,
    typer.Argument(help="key=value overrides of the file: repeats=5 base_config.lr=0.1"),
]
DryRunOption = Annotated[
    bool, typer.Option("--dry-run", help="Check the file and show what would run; run nothing")
]
P = ParamSpec("P")
R = TypeVar("R")
#: The exit status after Ctrl-C, as a shell reports a process that SIGINT ended.
INTERRUPTED = 130


def _shown(url: str) -> str:
    """A store URL as it may be printed: its password hidden."""
    from lab.store.engine import shown

    return shown(url)


def _clean_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn a `LabError` into one line on stderr and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except LabError as exc:
            typer.echo(f"error: {mask(str(exc))}", err=True)
            raise typer.Exit(1) from None

    return wrapper


#: What `lab quickstart` prints to try in Python; each runs as printed (a test runs them).
FINAL_LOSS_QUERY = (
    "select arm, count(*) as n, avg(value) as val_loss from final_metrics "
    "where experiment = 'quickstart' and key = 'val/loss' group by arm order by val_loss"
)
PREDICTIONS_QUERY = (
    "select run_key, example_id, output, target, score from predictions "
    "join evals using (eval_id) join runs using (run_id) limit 5"
)
NOTEBOOK = "quickstart.ipynb"


@app.command()
@_clean_errors
def quickstart(
    store: StoreOption = None,
    output_dir: Annotated[str, typer.Option(metavar="DIR", help="Where run folders go")] = "runs",
    steps: Annotated[int, typer.Option(min=1, metavar="N", help="Optimizer steps per run")] = 300,
    notebook: Annotated[
        bool,
        typer.Option(
            "--notebook",
            help=f"Also write the analysis notebook, as ./{NOTEBOOK} (open it from this folder)",
        ),
    ] = False,
    notebook_to: Annotated[
        Path | None,
        typer.Option("--notebook-to", metavar="PATH", help="Write the notebook there instead"),
    ] = None,
    all_metrics: AllMetricsOption = False,
    fresh: FreshOption = False,
) -> None:
    """Run the demo experiment (2 arms x 3 repeats) into a store and print its summary.

    Running it again continues it: finished runs are kept, the others run.
    """
    from lab.store import open_store, resolve_url

    open_store(url := resolve_url(store)).close()  # a bad store is refused before torch loads
    from lab.demo import quickstart_experiment, write_notebook

    if notebook_to is not None or notebook:
        written = write_notebook(notebook_to or Path(NOTEBOOK))  # before a run that takes a while
    again = ["lab", "quickstart", *(["--store", _shown(url)] if store is not None else [])]
    again += ["--output-dir", output_dir] if output_dir != "runs" else []
    again += ["--steps", str(steps)] if steps != 300 else []
    again += ["--all-metrics"] if all_metrics else []
    result = _run(
        quickstart_experiment(url, output_dir=output_dir, steps=steps, fresh=fresh),
        # holdout/acc is a fraction of examples: its interval stays inside [0, 1]
        lambda r: r.summary(
            "val/loss", "min", all_metrics=all_metrics, bounds={"holdout/acc": (0, 1)}
        ),
        shlex.join(again),
    )
    shown = _shown(url)
    option = f" --store {shlex.quote(shown)}" if store is not None else ""
    typer.echo(f"\n{result.name}: recorded in {shown}. Next:")
    typer.echo(f"  lab ls{option}")
    typer.echo(f"  lab show quickstart{option}")
    typer.echo("The final validation loss per arm, and the holdout benchmark's predictions:")
    typer.echo("  import lab.inspect")
    typer.echo(f"  con = lab.inspect.connect({json.dumps(shown)})")
    typer.echo(f"  con.sql({json.dumps(FINAL_LOSS_QUERY)}).show()")
    typer.echo(f"  con.sql({json.dumps(PREDICTIONS_QUERY)}).show()")
    env = f"LAB_STORE_URL={shlex.quote(shown)} " if store is not None else ""
    if notebook_to is not None or notebook:
        typer.echo("The walk-through of arms, curves and predictions, in Jupyter:")
        typer.echo(f"  {env}jupyter lab {shlex.quote(str(written))}")
    elif Path(NOTEBOOK).exists():
        typer.echo(f"The walk-through of arms, curves and predictions: ./{NOTEBOOK}")
    else:
        typer.echo(f"The walk-through of arms, curves and predictions, as ./{NOTEBOOK}:")
        typer.echo(f"  {shlex.join([*again, '--notebook'])}")  # the same settings: reused


def _run(
    exp: Experiment, summarize: Callable[[ExperimentResult], Summary], again: str
) -> ExperimentResult:
    """Run an experiment for a command and print its summary once, ranked as asked.

    On a terminal a `ConsoleLogger` shows progress (one is attached when none is), and it
    leaves the summary to this function. Ctrl-C (or SIGTERM) prints what finished, without
    ranking arms that did not (no table when no run finished), and `again`, the command
    that continues it; the exit status is 130.
    """
    from lab.loggers.console import ConsoleLogger

    consoles = [cb for cb in exp.callbacks if isinstance(cb, ConsoleLogger)]
    if not consoles and sys.stdout.isatty():
        consoles.append(ConsoleLogger(every_s=5.0))
        exp.callbacks.append(consoles[-1])
    for console in consoles:
        console.summary = False  # printed below, once
    try:
        result = exp.run()
    except (KeyboardInterrupt, Terminated):
        partial = exp.result
        finished = 0
        if partial is not None:
            finished = sum(1 for r in partial.runs if r.status in ("completed", "stopped"))
            if finished:  # else no table: one line below says so
                typer.echo(_summary_text(partial, summarize))
        what = f"{finished or 'none'} of {plural(exp.n_runs, 'run')} finished"
        typer.echo(
            f"interrupted: {what}; the same command continues it (finished runs are kept, "
            f"the others run again): {again}",
            err=True,
        )
        raise typer.Exit(INTERRUPTED) from None
    typer.echo(_summary_text(result, summarize))
    return result


def _summary_text(
    result: ExperimentResult, summarize: Callable[[ExperimentResult], Summary]
) -> str:
    """The summary as the command asked for it; when its metric is missing (no run got as
    far as logging it), the summary ranked by what there is."""
    try:
        return str(summarize(result))
    except LabError:
        return str(result.summary())


@app.command("run")
@_clean_errors
def run_file(
    ctx: typer.Context,
    file: FileArgument,
    overrides: OverridesArgument = None,
    store: StoreOption = None,
    dry_run: DryRunOption = False,
    all_metrics: AllMetricsOption = False,
    fresh: FreshOption = False,
) -> None:
    """Run the experiment an experiment file describes and print its summary.

    Overrides after the file change its values first, as dotted keys with YAML values:
    ``lab run sweep.yaml repeats=5 base_config.lr=0.1 arms.small.lr=1e-3``.

    Exits 1 when the file is wrong (one line, nothing runs) and when any run failed (after
    the summary, one line naming the failures); 0 when every run completed or stopped; 130
    when interrupted (after what finished, and the command that continues it).
    """
    command = ctx.info_name if ctx.info_name == "sweep" else "run"
    _run_file(command, file, overrides or [], store, dry_run, all_metrics, fresh)


SWEEP_HELP = """Run a file's sweep:, race: or prune: section as lab run would (the same
    arguments and exit statuses), with a line as each sampled arm starts (arms asked, runs
    done) and as each race round closes (arms left and dropped, with p-values), then the
    summary, race table and best sampled arms as lab show prints them. Else refused."""
app.command("sweep", help=SWEEP_HELP)(run_file)


def _run_file(
    command: str,
    file: Path,
    overrides: list[str],
    store: str | None,
    dry_run: bool,
    all_metrics: bool,
    fresh: bool,
) -> None:
    """``lab run`` and ``lab sweep``: build the file's experiment, run it with progress and
    print its summary; ``lab sweep`` needs a ``sweep:``, ``race:`` or ``prune:`` section, and
    shows each arm and round as they go, then the race table and best arms as ``lab show``."""
    from lab.experiment_file import plan, read_experiment_file
    from lab.records import FAILED
    from lab.store import resolve_url

    spec = read_experiment_file(file, overrides)
    searched = spec.sweep is not None or spec.race is not None or spec.prune is not None
    if command == "sweep" and not searched:
        raise ConfigError(
            f"{file}: no sweep:, race: or prune: section, so there is nothing to search, race "
            f"or prune; run it with: lab run {file}"
        )
    exp = spec.build(store=store, fresh=fresh)
    if command == "sweep":
        from lab._sweep_text import RoundsShown

        exp.callbacks.append(RoundsShown(exp, typer.echo))
    # the command as given (the store's password hidden); --fresh only until it has run
    again = ["lab", command, str(file), *overrides]
    again += ["--store", _shown(store)] if store is not None else []
    again += ["--all-metrics"] if all_metrics else []
    if dry_run:
        to_run = shlex.join([*again, *(["--fresh"] if fresh else [])])
        typer.echo(f"{plan(exp)}\n\ndry run: nothing ran; to run it: {to_run}")
        return
    result = _run(exp, lambda r: spec.summarize(r, all_metrics=all_metrics), shlex.join(again))
    failed = [r for r in result.runs if r.status in FAILED]
    if failed:
        first = mask((failed[0].error or "failed").splitlines()[0])
        hint = ""
        if isinstance(exp.store, str):  # recorded: say where to look
            hint = f"; details: lab show {exp.name}"
            if exp.store != resolve_url(None):
                hint += f" --store {_shown(exp.store)}"
        typer.echo(f"error: {len(failed)} of {plural(len(result.runs), 'run')} failed "
                   f"({failed[0].run_key}: {first}){hint}", err=True)  # fmt: skip
    if command == "sweep" and isinstance(exp.store, str):
        from lab._sweep_text import searched_text

        typer.echo(searched_text(_reading(exp.store), exp.name))
    if failed:
        raise typer.Exit(1)


def _reading(store: str | None) -> Any:
    """The store a command that only reads opens: a `Reader` (a SQL store read as a
    read-only `Store` reads it, without SQLAlchemy), or for a `lab serve` URL an
    `HttpStore` (token from LAB_TOKEN), which reads through the server."""
    from lab.store.urls import HTTP_SCHEMES, resolve_url

    url = resolve_url(store)
    if url.backend in HTTP_SCHEMES:
        from lab.store.http import HttpStore

        return HttpStore(url)
    from lab.store.reader import Reader

    return Reader(url)


@app.command("ls")
@_clean_errors
def list_experiments(store: StoreOption = None) -> None:
    """List experiments with their status and run counts."""
    s = _reading(store)
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
                    ", ".join(
                        [f"{n} {k}" for k, n in sorted(r["runs_by_status"].items())]
                        + ([f"{r['superseded']} superseded"] if r["superseded"] else [])
                    ),
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
    name: Annotated[str, typer.Argument(metavar="NAME", help="Experiment name")],
    store: StoreOption = None,
    metrics: Annotated[
        str, typer.Option(metavar="KEYS", help="Comma-separated final metrics to show")
    ] = "loss,val/loss",
    run: Annotated[
        str | None,
        typer.Option(
            "--run", metavar="KEY", help="Show one run instead: its error and whole traceback"
        ),
    ] = None,
    rank: Annotated[
        str | None,
        typer.Option(
            "--rank",
            metavar="KEY",
            help="The metric the arm summary ranks by (default: the experiment's, else "
            "val/loss or loss)",
        ),
    ] = None,
    mode: Annotated[
        str | None,
        typer.Option(
            "--mode",
            metavar="min|max",
            help="Whether lower or higher ranks first (default: "
            "the experiment's for its metric, else min)",
        ),
    ] = None,
) -> None:
    """Show an experiment's arms, runs, statuses, newest steps and last metric values, and
    the arm summary: each arm's n, mean, std and 95% CI of one final metric, and the best
    arm (the numbers of ``result.summary()``, ``lab.inspect.summary`` and the dashboard).
    A race adds its table (docs/sweeps.md), a sweep its sampled arms; pruned runs count.

    With --run KEY, one run: where and how long it ran, its error and its traceback.
    """
    from lab._show import experiment_text, run_text
    from lab.sweeps.report import sweep_tables

    s = _reading(store)
    try:
        exp = s.get_experiment(name)
        race, trials = sweep_tables(s, exp) if run is None else (None, [])
    finally:
        s.close()
    if run is not None:
        typer.echo(run_text(exp, run))
        return
    keys = [k for k in metrics.split(",") if k]
    for part in experiment_text(exp, keys, rank, mode, race, trials):
        typer.echo(part)


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

    lab tag lr-sweep +baseline -draft --note "first sweep"; lab tag lr-sweep small-r0 +best.
    The changes apply in order: +x -x leaves no x, -x +x puts x last.
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
    add, remove = _in_order(items)
    s = Store(store, create=False)  # a mistyped --store is refused, not created empty
    try:
        now = s.tag(experiment, run_key, add=add, remove=remove, notes=note)
    finally:
        s.close()
    what = experiment if run_key is None else f"{experiment} {run_key}"
    typer.echo(f"{what}: tags: {' '.join(now['tags']) or '-'}; notes: {now['notes'] or '-'}")


def _in_order(changes: list[str]) -> tuple[list[str], list[str]]:
    """``+TAG`` and ``-TAG`` changes, applied one after the other, as the one change
    `Store.tag` makes (it removes, then appends what it adds that is not there): a tag
    removed at any point is in `remove`, and a tag whose last change adds it is in `add`,
    in the order of the ``+`` that put it at the end. So ``+x -x`` leaves no x, ``-x +x``
    moves x last, and ``+x +x`` adds it once, as applying them in turn would."""
    add: dict[str, None] = {}
    remove: dict[str, None] = {}
    for change in changes:
        tag = change[1:]
        if change.startswith("-"):
            remove[tag] = None
            add.pop(tag, None)
        elif tag not in add:
            add[tag] = None
    return list(add), list(remove)


@app.command("rm")
@_clean_errors
def remove_experiment(
    name: Annotated[str, typer.Argument(help="Experiment name")],
    store: StoreOption = None,
    yes: Annotated[bool, typer.Option("--yes", help="Delete without asking")] = False,
) -> None:
    """Delete an experiment's rows from the store (its runs, metrics, evals, checkpoints).

    Run folders are left where they are; the command says where.
    """
    from lab.store import Store

    s = Store(store)
    try:
        exp = s.get_experiment(name)  # an unknown name fails here, before the question
        runs = plural(len(exp["runs"]) + exp["superseded"], "run")
        if not yes:
            typer.confirm(f"delete experiment {name!r} and its {runs} from the store?",
                          abort=True)  # fmt: skip
        gone = s.delete_experiment(name)
    finally:
        s.close()
    typer.echo(f"deleted experiment {name!r} ({plural(gone['runs'], 'run')})")
    folders = sorted({str(Path(f).parent) for f in gone["folders"]})
    if folders:
        typer.echo(f"its run folders are kept; remove them yourself if you wish: "
                   f"{', '.join(folders)}")  # fmt: skip


@app.command("mv")
@_clean_errors
def rename_experiment(
    old: Annotated[str, typer.Argument(help="Experiment name now")],
    new: Annotated[str, typer.Argument(help="New name (must not exist)")],
    store: StoreOption = None,
) -> None:
    """Rename an experiment in the store; its runs keep their rows and folders.

    The run folders keep their old names (the rows point there); it says where they are.
    """
    from lab._names import safe_name
    from lab.store import Store

    s = Store(store)
    try:
        runs = s.current_runs(old)  # an unknown name fails in the rename, as one line
        s.rename_experiment(old, new)
    finally:
        s.close()
    typer.echo(f"renamed experiment {old!r} to {new!r}")
    folders = sorted({str(Path(r["output_dir"]).parent) for r in runs if r["output_dir"]})
    if folders:
        typer.echo(
            f"its run folders keep their old names, where its rows point: {', '.join(folders)}; "
            f"runs of {new!r} trained from now on get new folders (<output_dir>/"
            f"{safe_name(new)}), without the checkpoints of the old ones"
        )


@app.command("export")
@_clean_errors
def export_experiment(
    name: Annotated[str, typer.Argument(metavar="NAME", help="Experiment name")],
    to: Annotated[str, typer.Option("--to", help="Folder for the Parquet files")],
    store: StoreOption = None,
) -> None:
    """Write one experiment's rows as Parquet files, one per table, into a folder."""
    from lab.export import export

    counts = export(name, to, store=store)
    typer.echo(render(("table", "rows"), list(counts.items())))
    typer.echo(f'\nWrote {to}/<table>.parquet. Read it back: lab.inspect.connect("{to}")')


@app.command()
@_clean_errors
def sync(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="A run folder")],
    store: StoreOption = None,
) -> None:
    """Send a run's spooled batches (RUN_DIR/.lab-spool) to a lab serve server (token:
    $LAB_TOKEN); what the server has already is not stored twice."""
    from lab.store.engine import HTTP_SCHEMES, resolve_url
    from lab.store.http import sync as replay

    url = resolve_url(store)
    if url.backend not in HTTP_SCHEMES:
        raise ConfigError(
            f"lab sync sends to a lab serve server; give --store http(s)://host:port (or set "
            f"LAB_STORE_URL), not {url.shown}"
        )
    sent = replay(run_dir, url)
    typer.echo(f"sent {plural(sent, 'spooled batch', 'spooled batches')} to {url.shown}")
    if sent.left:  # one line each, then exit 1: not everything spooled is in the store
        for line in sent.left:
            typer.echo(f"lab: not sent: {line}", err=True)
        raise typer.Exit(1)


NameOption = Annotated[
    str | None,
    typer.Option("--name", metavar="NAME", help="The lab experiment to import into"),
]
ArmByOption = Annotated[
    str | None,
    typer.Option(
        "--arm-by",
        metavar="FIELD[,FIELD]",
        help="Config fields whose values make an arm; its repeats ordered by the seed field "
        "when every run has one, else by start time [default: each run its own arm]",
    ),
]


@import_app.command("mlflow")
@_clean_errors
def import_mlflow(
    uri: Annotated[str, typer.Argument(metavar="URI", help="MLflow tracking URI")],
    experiment: Annotated[
        str | None,
        typer.Option(
            "--experiment", metavar="NAME",
            help="The MLflow experiment [default: the only one with runs]",
        ),
    ] = None,
    name: NameOption = None,
    arm_by: ArmByOption = None,
    store: StoreOption = None,
) -> None:  # fmt: skip
    """Import an MLflow experiment's runs: params, metric histories, tags, statuses."""
    from lab.importers import import_mlflow as run_import

    result = run_import(uri, experiment=experiment, name=name, store=store, arm_by=arm_by)
    typer.echo(result.line())


@import_app.command("wandb")
@_clean_errors
def import_wandb(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(metavar="RUN_DIR...", help="wandb/run-* or wandb/offline-run-* folders"),
    ],
    name: NameOption = None,
    arm_by: ArmByOption = None,
    store: StoreOption = None,
) -> None:
    """Import wandb runs from their folders: config, history, tags, states."""
    from lab.importers import import_wandb as run_import

    typer.echo(run_import(run_dirs, name=name, store=store, arm_by=arm_by).line())


@import_app.command("tensorboard")
@_clean_errors
def import_tensorboard(
    logdir: Annotated[Path, typer.Argument(metavar="LOGDIR", help="The SummaryWriter folder")],
    name: NameOption = None,
    arm_by: ArmByOption = None,
    store: StoreOption = None,
) -> None:
    """Import TensorBoard runs: scalars with their steps and wall times, add_hparams."""
    from lab.importers import import_tensorboard as run_import

    typer.echo(run_import(logdir, name=name, store=store, arm_by=arm_by).line())


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
    from lab.store.migrations import head_revision, is_known, read_revision

    current = read_revision(store)
    head = head_revision()
    if current is None:
        typer.echo(f"empty (no schema yet; head is {head}; run: lab db upgrade)")
    elif current == head:
        typer.echo(f"{current} (head)")
    elif not is_known(current):
        typer.echo(f"{current} (newer than this lab's {head}; run: pip install -U lab)")
    else:
        typer.echo(f"{current} (head is {head}; run: lab db upgrade)")


@app.command()
@_clean_errors
def serve(
    store: StoreOption = None,
    host: Annotated[
        str, typer.Option(metavar="ADDR", help="Address to bind; not loopback: needs a token")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(metavar="N", help="TCP port")] = 8765,
    max_body: Annotated[
        int, typer.Option(metavar="BYTES", help="Largest request body; larger: 413")
    ] = 64 * 1024 * 1024,
    ssl_certfile: Annotated[
        str | None, typer.Option(metavar="FILE", help="PEM certificate: serve HTTPS")
    ] = None,
    ssl_keyfile: Annotated[
        str | None, typer.Option(metavar="FILE", help="PEM private key of the certificate")
    ] = None,
    timeout_header: Annotated[
        float, typer.Option(metavar="S", help="Seconds to send a request's headers; then closed")
    ] = 10.0,
    timeout_body: Annotated[
        float, typer.Option(metavar="S", help="Longest pause inside a request body; then 408")
    ] = 30.0,
    timeout_keep_alive: Annotated[
        float, typer.Option(metavar="S", help="Seconds an idle connection stays open")
    ] = 5.0,
) -> None:
    """Serve the store over HTTP: a tracking server that jobs log to with a token."""
    from lab.server.app import serve as run_server

    run_server(
        store,
        host=host,
        port=port,
        max_body=max_body,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        timeout_header=timeout_header,
        timeout_body=timeout_body,
        timeout_keep_alive=timeout_keep_alive,
    )


@app.command()
@_clean_errors
def ui(
    store: StoreOption = None,
    port: Annotated[int, typer.Option(metavar="N", help="TCP port on 127.0.0.1")] = 8766,
    no_open: Annotated[bool, typer.Option("--no-open", help="Do not open a browser")] = False,
) -> None:
    """Open the dashboard over a store on this machine: read-only, 127.0.0.1 only, no token."""
    from lab._imports import require

    require("fastapi", "server", "lab ui")  # named as the command the user typed
    from lab.server.app import serve_ui

    serve_ui(store, port=port, open_browser=not no_open)


def _token_url(store: str | None) -> StoreURL:
    """The URL of the database that keeps the tokens: a SQL store, never a server (tokens
    are made where the database is, by whoever may open it)."""
    from lab.store.urls import resolve_url

    url = resolve_url(store)
    if url.backend not in ("sqlite", "postgresql"):
        raise ConfigError(
            f"tokens live in the database behind the server: give --store the sqlite:/// or "
            f"postgresql:// URL that lab serve was started with, not {url.shown}"
        )
    return url


def _token_store(store: str | None) -> Any:
    """The store that keeps the tokens, opened to change them."""
    from lab.store import Store

    return Store(_token_url(store))


@token_app.command("create")
@_clean_errors
def token_create(
    name: Annotated[str, typer.Argument(metavar="NAME", help="Token name (who holds it)")],
    scope: Annotated[
        str,
        typer.Option(
            metavar="read|write|admin",
            help="read: read only; write: read, and write the experiments it creates (or "
            "--experiment); admin: read and write every experiment",
        ),
    ] = "read",
    experiment: Annotated[
        str | None,
        typer.Option(
            metavar="EXP",
            help="Limit the token to this one experiment (it need not exist yet): all it "
            "reads, and with --scope write all it writes, whoever created it",
        ),
    ] = None,
    store: StoreOption = None,
) -> None:
    """Make a token and print it, once: the store keeps only its hash."""
    from lab.server.auth import create_token

    s = _token_store(store)
    try:
        # any other scope is refused by create_token, in one line that names the three
        token = create_token(s.engine, name, cast("Scope", scope), experiment)
    finally:
        s.close()
    typer.echo(token)
    only = f" limited to experiment {experiment!r}" if experiment is not None else ""
    typer.echo(
        f"made {scope} token {name!r}{only}; it is shown this once, keep it (e.g. LAB_TOKEN)",
        err=True,
    )


@token_app.command("list")
@_clean_errors
def token_list(store: StoreOption = None) -> None:
    """List the tokens: names, scopes, when made and revoked (never the tokens)."""
    from lab.store.reader import Reader

    try:
        s = Reader(_token_url(store), empty_ok=True)
    except NoStore:  # no store there yet: no token either (lab token create makes both)
        rows = []
    else:
        try:
            rows = s.list_tokens()
        finally:
            s.close()
    if not rows:
        typer.echo("no tokens yet; make one: lab token create NAME --scope read|write|admin")
        return

    def when(t: Any) -> str:
        return t.strftime("%Y-%m-%d %H:%M:%S") if t is not None else ""

    typer.echo(
        render(
            ("name", "scope", "experiment", "created (UTC)", "revoked (UTC)"),
            [
                (
                    r["name"],
                    r["scope"],
                    r["experiment"] or "",
                    when(r["created_at"]),
                    when(r["revoked_at"]),
                )
                for r in rows
            ],
        )
    )


@token_app.command("revoke")
@_clean_errors
def token_revoke(
    name: Annotated[str, typer.Argument(metavar="NAME", help="Token name")],
    store: StoreOption = None,
) -> None:
    """Revoke a token: a server refuses it from its next request on."""
    from lab.server.auth import revoke_token

    s = _token_store(store)
    try:
        before = revoke_token(s.engine, name)
    finally:
        s.close()
    if before is None:
        typer.echo(f"revoked token {name!r}")
    else:
        typer.echo(f"token {name!r} was already revoked at {before:%Y-%m-%d %H:%M:%S} UTC")


def main() -> None:
    """Entry point of the `lab` console script."""
    app(prog_name="lab")


if __name__ == "__main__":  # pragma: no cover
    main()
