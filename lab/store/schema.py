"""The store's tables, declared as classes. Alembic's revisions must produce exactly this.

Rows are not entities: these `Sql*` classes stay inside `lab.store`; users get plain dicts,
DataFrames or DuckDB relations back. Each class is written as a SQLAlchemy 2 declarative
model would be (``name: Mapped[type] = column(...)``: the annotation gives the column's type
and whether it may be NULL) but builds a plain Core `sa.Table`, held as ``__table__``, and
its attributes are that table's columns (``SqlRun.status``). Nothing here needs the ORM,
whose import a run's start would pay for (17,000 objects and 50 ms; with SQLAlchemy's
other objects, enough to make the interpreter's first full garbage collection after
``import torch`` fall inside ``lab.start_run``).

NaN in a float column: SQLite turns a NaN into NULL when it stores it, so on SQLite a NULL
`metrics.value` *is* NaN (a metric value is never missing). Every reader in `lab` maps it
back. PostgreSQL keeps NaN as it is. JSON columns write non-finite floats as the strings
"NaN", "Infinity" and "-Infinity", since JSON has no such numbers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, ClassVar

import sqlalchemy as sa

from lab._names import MAX_KEY, MAX_NAME
from lab.store.tables import DERIVED_TABLES as DERIVED_TABLES  # named with the models too
from lab.store.tables import EXPERIMENT_STATUSES as EXPERIMENT_STATUSES
from lab.store.tables import GROUP_KINDS as GROUP_KINDS
from lab.store.tables import MAX_TEST
from lab.store.tables import PRIVATE_TABLES as PRIVATE_TABLES
from lab.store.tables import RUN_STATUSES as RUN_STATUSES
from lab.store.tables import TABLES as TABLES
from lab.store.tables import TOKEN_SCOPES as TOKEN_SCOPES
from lab.store.tables import TRIAL_STATES as TRIAL_STATES

if TYPE_CHECKING:  # the annotations' types, for type checkers (at run time they are text)
    from sqlalchemy.orm import Mapped

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

CHECKPOINT_EVENTS = ("save", "remove")


def _one_of(column: str, values: tuple[str, ...]) -> str:
    """A CHECK constraint's SQL: "status IN ('running', 'completed')"."""
    quoted = ", ".join(f"'{value}'" for value in values)
    return f"{column} IN ({quoted})"


# A column's type by its annotation, where `column(...)` names none. none_as_null: a Python
# None is SQL NULL, not the JSON text 'null', so that `callback_errors IS NULL` means "no
# failures" to every SQL reader.
_TYPES: dict[str, Any] = {
    "int": sa.Integer,
    "float": sa.Float,
    "str": sa.String,
    "bytes": sa.LargeBinary,
    "datetime": sa.DateTime,
    "dict[str, Any]": lambda: sa.JSON(none_as_null=True),
    "list[Any]": lambda: sa.JSON(none_as_null=True),
}


class _Column:
    """What `column(...)` was given, until `Base` builds the column."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args, self.kwargs = args, kwargs


def column(*args: Any, **kwargs: Any) -> Any:
    """A column of a `Base` class: `sa.Column`'s arguments less its name, and its type and
    ``nullable`` where the annotation says them (as ``mapped_column`` takes them)."""
    return _Column(args, kwargs)


class Base:
    """The tables' base: each subclass becomes ``__table__`` in `metadata`, its annotated
    attributes the table's columns, in order, and ``__table_args__`` its constraints and
    options. `sa.insert(SqlRun)`, `sa.update(SqlRun)` and joins take the class as its table."""

    metadata: ClassVar[sa.MetaData] = sa.MetaData(naming_convention=NAMING)
    __tablename__: ClassVar[str]
    __table__: ClassVar[sa.Table]

    def __init_subclass__(cls) -> None:
        columns = [_built(name, text, cls.__dict__.get(name)) for name, text in _own(cls)]
        args = cls.__dict__.get("__table_args__", ())
        args = (args,) if isinstance(args, dict) else args  # (constraints..., options)
        has_options = bool(args) and isinstance(args[-1], dict)
        options = args[-1] if has_options else {}
        constraints = args[:-1] if has_options else args
        cls.__table__ = sa.Table(cls.__tablename__, cls.metadata, *columns, *constraints, **options)
        for built in columns:
            setattr(cls, built.name, built)

    @classmethod
    def __clause_element__(cls) -> sa.Table:
        return cls.__table__


def _own(cls: type) -> list[tuple[str, str]]:
    """The class's own ``Mapped[...]`` annotations, in order: (name, the type's text)."""
    annotations = inspect.get_annotations(cls)
    return [
        (name, text[len("Mapped[") : -1])
        for name, text in annotations.items()
        if text.startswith("Mapped[")
    ]


def _is_type(arg: Any) -> bool:
    """Whether `arg` is a column type, given as a class (``sa.Text``) or an instance."""
    return isinstance(arg, sa.types.TypeEngine) or (
        isinstance(arg, type) and issubclass(arg, sa.types.TypeEngine)
    )


def _built(name: str, text: str, given: _Column | None) -> sa.Column[Any]:
    """Column `name` of type text `text` (``int | None``), from what `column(...)` was given."""
    args, kwargs = (given.args, dict(given.kwargs)) if given else ((), {})
    base, optional = (text[: -len(" | None")], True) if text.endswith(" | None") else (text, False)
    if not any(_is_type(a) for a in args):
        args = (_TYPES[base](), *args)
    kwargs.setdefault("nullable", optional and not kwargs.get("primary_key", False))
    return sa.Column(name, *args, **kwargs)


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


Timestamp = sa.DateTime()  # naive UTC on every backend


class SqlExperiment(Base):
    __tablename__ = "experiments"

    experiment_id: Mapped[int] = column(primary_key=True)
    name: Mapped[str] = column(sa.String(MAX_NAME), unique=True)
    status: Mapped[str] = column(sa.String(16))
    config: Mapped[dict[str, Any]]
    seed: Mapped[int]
    repeats: Mapped[int]
    created_at: Mapped[datetime] = column(Timestamp, default=_now)
    ended_at: Mapped[datetime | None] = column(Timestamp)
    callback_errors: Mapped[list[Any] | None]  # experiment-level callback failures
    tags: Mapped[list[Any] | None]  # plain strings, W&B style
    notes: Mapped[str | None] = column(sa.Text)
    # the driver process that runs the experiment (as a run's owner): a driver that is gone
    # while the experiment is `running` leaves it `crashed`
    host: Mapped[str | None] = column(sa.String(255))
    pid: Mapped[int | None]
    process_start: Mapped[float | None] = column(sa.Double)
    boot_id: Mapped[str | None] = column(sa.String(64))
    heartbeat_at: Mapped[datetime | None] = column(Timestamp)
    # the name of the `lab serve` token that created it; NULL when a local process did
    created_by: Mapped[str | None] = column(sa.String(MAX_NAME))

    __table_args__ = (sa.CheckConstraint(_one_of("status", EXPERIMENT_STATUSES), name="status"),)


class SqlArm(Base):
    __tablename__ = "arms"

    arm_id: Mapped[int] = column(primary_key=True)
    experiment_id: Mapped[int] = column(
        sa.ForeignKey("experiments.experiment_id", ondelete="CASCADE")
    )
    name: Mapped[str] = column(sa.String(MAX_NAME))
    overrides: Mapped[dict[str, Any]]
    config: Mapped[dict[str, Any]]

    __table_args__ = (sa.UniqueConstraint("experiment_id", "name"),)


class SqlGroup(Base):
    __tablename__ = "groups"

    group_id: Mapped[int] = column(primary_key=True)
    experiment_id: Mapped[int] = column(
        sa.ForeignKey("experiments.experiment_id", ondelete="CASCADE")
    )
    arm_id: Mapped[int | None] = column(sa.ForeignKey("arms.arm_id", ondelete="CASCADE"))
    name: Mapped[str] = column(sa.String(MAX_NAME))
    kind: Mapped[str] = column(sa.String(16))

    __table_args__ = (
        sa.UniqueConstraint("experiment_id", "name"),
        sa.CheckConstraint(_one_of("kind", GROUP_KINDS), name="kind"),
    )


class SqlRun(Base):
    __tablename__ = "runs"

    run_id: Mapped[int] = column(primary_key=True)
    experiment_id: Mapped[int] = column(
        sa.ForeignKey("experiments.experiment_id", ondelete="CASCADE")
    )
    group_id: Mapped[int] = column(sa.ForeignKey("groups.group_id", ondelete="CASCADE"))
    arm_id: Mapped[int | None] = column(sa.ForeignKey("arms.arm_id", ondelete="CASCADE"))
    run_key: Mapped[str] = column(sa.String(MAX_KEY))
    repeat: Mapped[int]
    stage: Mapped[int]
    seed: Mapped[int]
    config: Mapped[dict[str, Any]]
    status: Mapped[str] = column(sa.String(16))
    error: Mapped[str | None] = column(sa.Text)
    traceback: Mapped[str | None] = column(sa.Text)
    summary: Mapped[dict[str, Any] | None]
    callback_errors: Mapped[list[Any] | None]
    output_dir: Mapped[str | None] = column(sa.Text)
    parent_run_id: Mapped[int | None] = column(  # the previous stage, in a chain
        sa.ForeignKey("runs.run_id", ondelete="SET NULL")
    )
    host: Mapped[str | None] = column(sa.String(255))  # where the run's process lives
    pid: Mapped[int | None]
    started_at: Mapped[datetime] = column(Timestamp, default=_now)
    ended_at: Mapped[datetime | None] = column(Timestamp)
    # last seen alive: set by the run's metric writer while the run is `running`
    heartbeat_at: Mapped[datetime | None] = column(Timestamp)
    # what the run's result depends on (config, seed, stage, train function), hashed: a run
    # is reused by a later attempt only when this is the same
    config_hash: Mapped[str | None] = column(sa.String(64))
    # set when `fresh=True` replaced this run: kept, never deleted, left out of every summary
    superseded_at: Mapped[datetime | None] = column(Timestamp)
    provenance: Mapped[dict[str, Any] | None]  # git, packages, versions, devices, command
    tags: Mapped[list[Any] | None]
    notes: Mapped[str | None] = column(sa.Text)
    # the owning process's start time (epoch seconds) and the host's boot id: a pid alone
    # is reused, and means nothing in another PID namespace
    process_start: Mapped[float | None] = column(sa.Double)
    boot_id: Mapped[str | None] = column(sa.String(64))
    # a `pruned` run's stop: {"step": int, "rule": str, "metric": str, "value": float}
    pruned: Mapped[dict[str, Any] | None]

    __table_args__ = (
        sa.UniqueConstraint("experiment_id", "run_key"),
        sa.Index(None, "experiment_id", "status"),
        sa.Index(None, "group_id"),
        sa.CheckConstraint(_one_of("status", RUN_STATUSES), name="status"),
    )


#: In a constraint's `info`: the one dialect it is made on (`compared_on` reads it).
ONLY_ON = "lab_only_on"


def _runs_key_on_sqlite() -> sa.ForeignKeyConstraint:
    """A table's ``run_id`` foreign key to `runs` (ON DELETE CASCADE), made on SQLite only:
    `metrics` (revision 0010) and `metric_blocks` (0011) have none on PostgreSQL, where the
    trigger ``trg_runs_delete_metrics`` deletes their rows with the run."""
    return sa.ForeignKeyConstraint(
        ["run_id"], ["runs.run_id"], ondelete="CASCADE", info={ONLY_ON: "sqlite"}
    ).ddl_if(dialect="sqlite")


class SqlMetric(Base):
    """One point: (run, key, step) -> value and wall time.

    On PostgreSQL `metrics` has no foreign key to `runs` (revision 0010): the key's check
    looked the run up, and locked it, for every row, which halved what a metric batch's
    COPY writes per second. The run's rows hold the same guarantees without it: the
    transaction that writes a batch also writes its keys' `summaries`, whose foreign key
    refuses a run that is not there (and so the batch, rolled back whole); and the trigger
    ``trg_runs_delete_metrics`` deletes a run's metrics (and, since 0011, its
    `metric_blocks`) with the run, in the same statement, as ON DELETE CASCADE did (an
    experiment deleted deletes its runs, and so their metrics). SQLite keeps the foreign
    key: its check costs little."""

    __tablename__ = "metrics"
    __table_args__ = (_runs_key_on_sqlite(),)

    run_id: Mapped[int] = column(primary_key=True)
    key: Mapped[str] = column(sa.String(MAX_KEY), primary_key=True)
    step: Mapped[int] = column(sa.BigInteger, primary_key=True)
    value: Mapped[float | None] = column(sa.Double)  # NULL is NaN on SQLite
    wall_time: Mapped[float] = column(sa.Double)


class SqlSummary(Base):
    """One row per (run, key), kept up to date by every metric flush, so that listing runs
    and their final values never scans `metrics`. `min_value` and `max_value` leave NaN out
    (NULL when every point was NaN); `count` counts every point; `last_value` may be NaN
    (NULL on SQLite, as in `metrics`)."""

    __tablename__ = "summaries"

    run_id: Mapped[int] = column(sa.ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = column(sa.String(MAX_KEY), primary_key=True)
    count: Mapped[int] = column(sa.BigInteger)
    first_step: Mapped[int] = column(sa.BigInteger)
    last_step: Mapped[int] = column(sa.BigInteger)
    last_value: Mapped[float | None] = column(sa.Double)
    min_value: Mapped[float | None] = column(sa.Double)
    max_value: Mapped[float | None] = column(sa.Double)
    last_wall_time: Mapped[float] = column(sa.Double)


class SqlMetricBlock(Base):
    """One row per (run, key) and block of `BLOCK_STEPS` steps (block b holds the steps
    ``b * BLOCK_STEPS`` to ``b * BLOCK_STEPS + BLOCK_STEPS - 1``): how many points it has,
    their first and last step, and the min, max, sum and count of their values with NaN
    left out (min, max and sum NULL when every value was NaN).

    Derived from `metrics`, like an index: the transaction that writes metric rows
    recomputes, from the rows, every block they fall in (`lab.store.blocks`), so a series
    is cut into buckets by reading whole blocks and only the points at each bucket's two
    edges (a million points at 2,000 buckets read ~100,000 rows, not a million), or, for
    buckets narrower than a block, from the points packed in the blocks (31,250 rows for a
    million points).
    """

    __tablename__ = "metric_blocks"
    # On SQLite the rows live in their key's B-tree: a range of blocks is read in one
    # pass, with no lookup of each row by rowid. (No DuckDB view reads this table.) On
    # PostgreSQL no foreign key to `runs` (revision 0011), as `metrics` has none: the
    # trigger that deletes a run's metrics deletes its blocks too.
    __table_args__ = (_runs_key_on_sqlite(), {"sqlite_with_rowid": False})

    run_id: Mapped[int] = column(primary_key=True)
    key: Mapped[str] = column(sa.String(MAX_KEY), primary_key=True)
    block: Mapped[int] = column(sa.BigInteger, primary_key=True)
    points: Mapped[int] = column(sa.BigInteger)
    step_min: Mapped[int] = column(sa.BigInteger)
    step_max: Mapped[int] = column(sa.BigInteger)
    value_min: Mapped[float | None] = column(sa.Double)
    value_max: Mapped[float | None] = column(sa.Double)
    value_sum: Mapped[float | None] = column(sa.Double)
    value_count: Mapped[int] = column(sa.BigInteger)
    #: The block's points in step order: each step's offset in the block (one byte each,
    #: 0 to BLOCK_STEPS - 1), and each value as a little-endian float64, NaN kept. A cut
    #: of narrow buckets reads these instead of one row of `metrics` per point.
    point_offsets: Mapped[bytes | None] = column(sa.LargeBinary)
    point_values: Mapped[bytes | None] = column(sa.LargeBinary)


class SqlEval(Base):
    __tablename__ = "evals"

    eval_id: Mapped[int] = column(primary_key=True)
    run_id: Mapped[int] = column(sa.ForeignKey("runs.run_id", ondelete="CASCADE"))
    name: Mapped[str] = column(sa.String(MAX_KEY))
    step: Mapped[int | None] = column(sa.BigInteger)  # NULL: after training
    metrics: Mapped[dict[str, Any]]
    breakdowns: Mapped[dict[str, Any]]
    tags: Mapped[dict[str, Any]]
    seconds: Mapped[float] = column(sa.Double)
    error: Mapped[str | None] = column(sa.Text)
    created_at: Mapped[datetime] = column(Timestamp, default=_now)

    __table_args__ = (sa.Index(None, "run_id", "name", "step"),)


class SqlPrediction(Base):
    __tablename__ = "predictions"

    eval_id: Mapped[int] = column(
        sa.ForeignKey("evals.eval_id", ondelete="CASCADE"), primary_key=True
    )
    idx: Mapped[int] = column(primary_key=True)
    example_id: Mapped[str | None] = column(sa.Text)
    input: Mapped[str | None] = column(sa.Text)
    output: Mapped[str | None] = column(sa.Text)
    target: Mapped[str | None] = column(sa.Text)
    score: Mapped[float | None] = column(sa.Double)
    extras: Mapped[dict[str, Any] | None]


class SqlCheckpoint(Base):
    __tablename__ = "checkpoints"

    checkpoint_id: Mapped[int] = column(primary_key=True)
    run_id: Mapped[int] = column(sa.ForeignKey("runs.run_id", ondelete="CASCADE"))
    step: Mapped[int] = column(sa.BigInteger)
    path: Mapped[str] = column(sa.Text)
    event: Mapped[str] = column(sa.String(16))
    metrics: Mapped[dict[str, Any]]
    reason: Mapped[str | None] = column(sa.Text)
    created_at: Mapped[datetime] = column(Timestamp)

    __table_args__ = (
        sa.Index(None, "run_id", "step"),
        sa.CheckConstraint(_one_of("event", CHECKPOINT_EVENTS), name="event"),
    )


class SqlHistogram(Base):
    """A histogram logged at a step (`lab.media.Histogram`): keyed as a metric is, so
    logging the same (run, key, step) again replaces it. `edges` and `counts` are JSON
    lists of finite numbers; NaN and ±inf are counted apart."""

    __tablename__ = "histograms"

    run_id: Mapped[int] = column(sa.ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = column(sa.String(MAX_KEY), primary_key=True)
    step: Mapped[int] = column(sa.BigInteger, primary_key=True)
    edges: Mapped[list[Any]]
    counts: Mapped[list[Any]]
    nan: Mapped[int] = column(sa.BigInteger)
    posinf: Mapped[int] = column(sa.BigInteger)
    neginf: Mapped[int] = column(sa.BigInteger)
    wall_time: Mapped[float] = column(sa.Double)


class SqlImage(Base):
    """An image logged at a step (`lab.media.Image`): a PNG file, `path` relative to the
    run's `output_dir` (absolute when the run has none); the same (run, key, step) again
    replaces it."""

    __tablename__ = "images"

    run_id: Mapped[int] = column(sa.ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = column(sa.String(MAX_KEY), primary_key=True)
    step: Mapped[int] = column(sa.BigInteger, primary_key=True)
    path: Mapped[str] = column(sa.Text)
    width: Mapped[int]
    height: Mapped[int]
    wall_time: Mapped[float] = column(sa.Double)
    #: The PNG's bytes, kept in the store (revision 0008 on): what every door serves, so no
    #: server ever opens a file by a path that a client sent.
    data: Mapped[bytes | None] = column(sa.LargeBinary)


class SqlSweepTrial(Base):
    """A sampled arm as its sampler knows it (`lab.sweeps`): `number` is its ask order in
    the experiment (arm ``s{number:03d}``), `params` its active parameters, `asked_after`
    how many tells had happened when it was asked, `told` its tell's sequence number and
    `value` the arm's value once told (NULL before, and for a failed trial). Replaying the
    asks and tells in this order rebuilds the sampler after a kill."""

    __tablename__ = "sweep_trials"

    experiment_id: Mapped[int] = column(
        sa.ForeignKey("experiments.experiment_id", ondelete="CASCADE"), primary_key=True
    )
    number: Mapped[int] = column(primary_key=True)
    arm_id: Mapped[int] = column(sa.ForeignKey("arms.arm_id", ondelete="CASCADE"))
    params: Mapped[dict[str, Any]]
    asked_after: Mapped[int]
    told: Mapped[int | None]
    value: Mapped[float | None] = column(sa.Double)
    state: Mapped[str] = column(sa.String(16))

    __table_args__ = (sa.CheckConstraint(_one_of("state", TRIAL_STATES), name="state"),)


class SqlElimination(Base):
    """An arm a race dropped (`lab.sweeps.racing`): after which `round`, by which `test`,
    with the post-hoc `statistic` against the best arm (`best_arm`, by name) and the
    corrected `p_value` that was below `alpha`. An arm is dropped once."""

    __tablename__ = "eliminations"

    experiment_id: Mapped[int] = column(
        sa.ForeignKey("experiments.experiment_id", ondelete="CASCADE"), primary_key=True
    )
    arm_id: Mapped[int] = column(sa.ForeignKey("arms.arm_id", ondelete="CASCADE"), primary_key=True)
    round: Mapped[int]
    test: Mapped[str] = column(sa.String(MAX_TEST))
    statistic: Mapped[float] = column(sa.Double)
    p_value: Mapped[float] = column(sa.Double)
    alpha: Mapped[float] = column(sa.Double)
    best_arm: Mapped[str] = column(sa.String(MAX_NAME))
    created_at: Mapped[datetime] = column(Timestamp, default=_now)


class SqlToken(Base):
    """A `lab serve` access token: only its SHA-256 hash is kept (the token itself is
    printed once, when it is made). A write token may also read; `revoked_at` set: refused."""

    __tablename__ = "tokens"

    token_id: Mapped[int] = column(primary_key=True)
    name: Mapped[str] = column(sa.String(MAX_NAME), unique=True)
    scope: Mapped[str] = column(sa.String(16))
    token_hash: Mapped[str] = column(sa.String(64), unique=True)
    created_at: Mapped[datetime] = column(Timestamp)
    revoked_at: Mapped[datetime | None] = column(Timestamp)
    # the one experiment (by name) this token may read and write; NULL: not limited
    experiment: Mapped[str | None] = column(sa.String(MAX_NAME))

    __table_args__ = (sa.CheckConstraint(_one_of("scope", TOKEN_SCOPES), name="scope"),)


class SqlIngestBatch(Base):
    """A batch of writes a `lab serve` client sent, by its client id and sequence number:
    written in the same transaction as the batch's rows, so a batch sent again (a retry
    after a lost response, a spool replayed) is recognised and stores nothing twice."""

    __tablename__ = "ingest_batches"

    client_id: Mapped[str] = column(sa.String(64), primary_key=True)
    seq: Mapped[int] = column(sa.BigInteger, primary_key=True)
    rows: Mapped[int] = column(sa.BigInteger)
    received_at: Mapped[datetime] = column(Timestamp)


def copied_columns(table: str) -> list[sa.Column[Any]]:
    """The columns of store table `table` that its copies for analysis carry (`lab.inspect`'s
    views, the server's ``/tables``, an export): all but an image's PNG bytes
    (``images.data``), which only the dashboard's image route serves, one image at a time."""
    columns = Base.metadata.tables[table].columns
    return [c for c in columns if not (table == "images" and c.name == "data")]


def compared_on(dialect: str) -> Callable[..., bool]:
    """Alembic's `include_object` for a database of `dialect`: the models' schema objects,
    less the constraints made on another dialect only (`ONLY_ON`), which autogenerate would
    otherwise find missing there."""

    def include(obj: Any, _name: Any, _type: str, reflected: bool, _compare_to: Any) -> bool:
        only = None if reflected else getattr(obj, "info", {}).get(ONLY_ON)
        return only is None or only == dialect

    return include


#: Steps per row of `metric_blocks`: about the square root of the points per bucket of a
#: big series cut for a plot (a million points at 2,000 buckets: 500 per bucket), where
#: the blocks read and the edge points read cost the least together.
BLOCK_STEPS = 32
