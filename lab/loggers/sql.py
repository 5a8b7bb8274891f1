"""`SqlLogger`: the callback that owns every write to the SQL store.

| hook                | what it writes                                          |
|---------------------|---------------------------------------------------------|
| on_experiment_start | the experiment (with its tags and notes) and its arms   |
| on_group_start      | the group (and its arm, when the experiment added the   |
|                     | arm as it ran: a sampled one)                           |
| (before the run)    | `claim`: the run's row, claimed atomically (Experiment) |
| on_run_start        | the run: config, seed, arm, repeat, status `running`,   |
|                     | provenance (read once per experiment, in a thread that  |
|                     | fills it in if the run started first; `git.diff` file)  |
| on_step_end         | metrics, through the buffered writer                    |
| on_media            | histogram and image rows, through a writer of their own |
|                     | (an image's path relative to the run folder)            |
| on_eval             | its metrics as `<eval>/<key>` metrics, and an eval row  |
|                     | (with its wall time) unless on_benchmark_eval follows   |
| on_benchmark_eval   | an eval row and its predictions (an eval re-run at the  |
|                     | same step replaces both); after training, also its      |
|                     | metrics as `<eval>/<key>` at the run's last step, so    |
|                     | they are final metrics like the others                  |
| on_checkpoint       | a checkpoint row (after flushing metrics)               |
| on_run_end          | final status, error, final metrics, callback failures,  |
|                     | the tags and notes `train(run)` gave the run            |
| (a race's round)    | `record_elimination`: each arm it drops (Experiment)    |
| (a sweep's ask/tell)| `record_trial`, `tell_trial`: each sampled arm's trial  |
| on_experiment_end   | the experiment's status                                 |

Its ids live in ``ctx.ids`` under names starting with ``sql:``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Any, cast

import pydantic

from lab._secrets import logger
from lab.callbacks.registry import register
from lab.errors import ConfigError, NoExperiment
from lab.hooks import FRAMEWORK_CONFIG, NOTES, TAGS, Callback, LogContext, LoopState, Phase
from lab.provenance import Provenance, collect
from lab.records import EvalResult
from lab.store import open_store

if TYPE_CHECKING:
    from pathlib import Path

    from lab.media import Media
    from lab.records import (
        ArmResult,
        ExperimentResult,
        LoopArtifacts,
        ManifestRow,
        RunResult,
        TrainingBatch,
    )
    from lab.store.http import HttpStore
    from lab.store.records import FinishedRun
    from lab.store.store import Store

log = logger("lab.loggers.sql")

EXPERIMENT_ID = "sql:experiment_id"
RUN_ID = "sql:run_id"
CLAIMED = "sql:claimed"  # the run key whose row `claim` took, for on_run_start to take over


def arm_key(name: str) -> str:
    """The `ctx.ids` name of an arm's id."""
    return f"sql:arm:{name}"


def group_key(name: str) -> str:
    """The `ctx.ids` name of a group's id."""
    return f"sql:group:{name}"


def _a_store(value: Any) -> Any:
    """`store` as `SqlLogger` takes it: a `Store`, an `HttpStore`, a URL or None. The two
    classes are looked up only for a value that is neither text nor None (a store given
    from Python, whose module is loaded already): declaring a `SqlLogger` (``lab run FILE
    --dry-run``) loads neither SQLAlchemy nor httpx."""
    if value is None or isinstance(value, str):
        return value
    from lab.store.http import HttpStore
    from lab.store.store import Store

    if isinstance(value, (Store, HttpStore)):
        return value
    raise ValueError("use a Store or a HttpStore or a string, or None")


class SqlLoggerConfig(pydantic.BaseModel):
    """The params of `SqlLogger`: its store."""

    model_config = pydantic.ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    store: Annotated[Any, pydantic.AfterValidator(_a_store)] = None


@register("sql_logger", SqlLoggerConfig)
class SqlLogger(Callback):
    """Records experiments, runs, metrics, evals, predictions and checkpoints in a store.

    Pass a `Store`, an `HttpStore` (a ``lab serve`` server), a URL (``http(s)://`` opens an
    `HttpStore`, token from ``LAB_TOKEN``), or nothing (``LAB_STORE_URL``, else
    ``sqlite:///lab.db``). In
    `on_step_end` it runs after the callbacks that produce step metrics (`metrics_logged`),
    so it stores their keys too, and first among the others (`Phase.RECORD`), so they see a
    step whose metric row is already handed to the store. It is critical: a metric the store
    cannot hold, or a store that stays down longer than its retry window, fails the run with
    that reason.
    """

    phase = Phase.RECORD
    rank_zero_only = True  # under DDP: the experiment, group and run rows are written once
    critical = True  # a run whose record cannot be written fails, with the reason

    def __init__(self, store: Store | HttpStore | str | None = None) -> None:
        self._store_arg = store
        self._owns_store = store is None or isinstance(store, str)
        self._store: Store | HttpStore | None = None
        if not isinstance(store, str):
            self._store = store
        self._run_id: int | None = None
        self._runs: dict[str, int] = {}
        self._errors_written: dict[str, list[dict[str, Any]]] = {}
        self._resumed_at: int | None = None
        self._provenance: Provenance | None = None  # read once per experiment
        self._reading: Future[Provenance] | None = None  # ... in a thread, from its start
        # run key (LogContext types it optional) -> id: claimed here, not started yet
        self._claims: dict[str | None, int] = {}
        self._filling: dict[int, _Pending] = {}  # run id -> its provenance, still to record

    def open(self) -> Store | HttpStore:
        """Open (create or upgrade) the store now; an Experiment calls this before any hook,
        so a bad URL, a dead server or a newer schema stops it before anything runs."""
        if self._store is None:
            # a URL or None: a store given is `_store` (a pickled copy gets its URL instead)
            self._store = open_store(cast("str | None", self._store_arg))
        return self._store

    @property
    def store(self) -> Store | HttpStore:
        """The open store."""
        return self.open()

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the open store: its connections and writer thread cannot cross to
        a worker process (``executor="processes"``). The copy reopens the same store from
        its URL (password included) on first use, and closes it at `close`."""
        state = self.__dict__.copy()
        store = state["_store"] if state["_store"] is not None else state["_store_arg"]
        if not (store is None or isinstance(store, str)):
            state["_store_arg"] = store.url
        state["_store"] = None
        state["_owns_store"] = True
        if state["_reading"] is not None:  # a worker gets the record, not the thread
            state["_provenance"], state["_reading"] = state["_reading"].result(), None
        state["_filling"] = {}  # (the runs of this process: a copy starts its own)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled copy; its store opens on first use (see `__getstate__`)."""
        self.__dict__.update(state)

    # -- experiment level ----------------------------------------------------------------
    def on_experiment_start(self, ctx: LogContext) -> None:
        store = self.open()
        # once: every run of the experiment shares it. Read in a thread from now; a run
        # that starts before it is read gets it from that thread (`_fill_in_provenance`)
        self._provenance, self._reading = None, _collect_soon()
        config = ctx.config
        exp_id = store.begin_experiment(
            ctx.experiment,
            config=config,
            seed=int(config.get("seed", 0)),
            repeats=int(config.get("repeats", 1)),
            tags=ctx.extras.get(TAGS, ()),
            notes=ctx.extras.get(NOTES),
        )
        ctx.ids[EXPERIMENT_ID] = exp_id
        for name in config.get("arms", {}):
            self._add_arm(store, ctx, name)

    def _add_arm(self, store: Store | HttpStore, ctx: LogContext, name: str) -> None:
        """Record the arm `name` of ``ctx.config["arms"]`` (its overrides and config)."""
        config = ctx.config
        ctx.ids[arm_key(name)] = store.add_arm(
            ctx.ids[EXPERIMENT_ID], name, overrides=config["arms"][name],
            config=config.get("arm_configs", {}).get(name, {}),
        )  # fmt: skip

    def on_group_start(self, ctx: LogContext, group_name: str) -> None:
        store = self.open()
        # an arm the experiment added as it ran (a sampled one) is recorded by its first group
        arm = ctx.arm
        if arm is not None and arm_key(arm) not in ctx.ids and arm in ctx.config.get("arms", {}):
            self._add_arm(store, ctx, arm)
        ctx.ids[group_key(group_name)] = store.add_group(
            ctx.ids[EXPERIMENT_ID],
            group_name,
            kind=ctx.group_kind,
            arm_id=ctx.ids.get(arm_key(ctx.arm)) if ctx.arm is not None else None,
        )

    def claim(self, ctx: LogContext) -> FinishedRun | None:
        """Claim the run `ctx` points at before any of its hooks fire (see
        `Store.claim_run`): None when this process won it, the run's record when another
        process finished it meanwhile; raises `RunBusy` while a live process trains it."""
        ctx.ids.pop(RUN_ID, None)
        ctx.ids.pop(CLAIMED, None)
        run_id, finished = self.open().claim_run(ctx.ids[EXPERIMENT_ID], **self._run_fields(ctx))
        if run_id is not None:
            ctx.ids[RUN_ID], ctx.ids[CLAIMED] = run_id, ctx.run_key
            self._claims[ctx.run_key] = run_id  # until on_run_start takes the row over
        return finished

    def release(self, run_key: str, error: str) -> None:
        """Record a claimed run whose `on_run_start` never took its row over (the store
        failed there, or the run never started) as `failed` with `error`, if this process
        still holds it; best effort, since the store may be what failed."""
        run_id = self._claims.pop(run_key, None)
        if run_id is None:
            return
        try:
            self.open().release_run(run_id, error)
        except Exception:
            log.warning("could not record run %s as failed; it stays running until the store "
                        "finds its process gone", run_key, exc_info=True)  # fmt: skip

    def eliminated(self, experiment: str) -> set[str]:
        """The arms of `experiment` whose elimination by its race the store holds."""
        return {e["arm"] for e in self.open().eliminations(experiment)}

    def record_elimination(self, ctx: LogContext, elimination: Any, alpha: float) -> None:
        """Record that the experiment's race dropped `elimination.arm` (a
        `lab.sweeps.Elimination`: its round, test, statistic and corrected p-value, and the
        arm it lost to), decided at level `alpha`; the experiment calls it, in its process,
        as the round that dropped the arm closes."""
        self.open().add_elimination(
            ctx.ids[EXPERIMENT_ID], ctx.ids[arm_key(elimination.arm)], round=elimination.round,
            test=elimination.test, statistic=elimination.statistic,
            p_value=elimination.p_value, alpha=alpha, best=elimination.best,
        )  # fmt: skip

    def trials(self, experiment: str) -> list[dict[str, Any]]:
        """The trials of `experiment`'s sweep the store holds, by number ([] when the store
        knows no such experiment)."""
        try:
            return [dict(t) for t in self.open().trials(experiment)]
        except NoExperiment:
            return []

    def recorded_sweep(self, experiment: str) -> dict[str, Any] | None:
        """The sweep `experiment` recorded in its config, if the store knows one."""
        try:
            config = self.open().get_experiment(experiment)["config"] or {}
        except NoExperiment:
            return None
        return config.get("sweep")

    def record_trial(self, ctx: LogContext, trial: Any, arm: str) -> None:
        """Record sampled arm `arm` (a `lab.sweeps.Trial`) as asked, and the arm first when
        the store has no row of it yet (its group has not started); the experiment calls it,
        in its process, as it asks the arm."""
        store = self.open()
        if arm_key(arm) not in ctx.ids:
            self._add_arm(store, ctx, arm)
        store.add_trial(ctx.ids[EXPERIMENT_ID], trial.number, ctx.ids[arm_key(arm)],
                        dict(trial.params), trial.asked_after)  # fmt: skip

    def tell_trial(self, ctx: LogContext, trial: Any) -> None:
        """Record how a trial of the experiment's sweep ended: its tell, value and state."""
        self.open().tell_trial(ctx.ids[EXPERIMENT_ID], trial.number, told=trial.told,
                               value=trial.value, state=trial.state)  # fmt: skip

    def on_run_start(self, ctx: LogContext) -> None:
        assert ctx.run_key is not None and ctx.group_name is not None
        claimed = ctx.ids.get(RUN_ID) if ctx.ids.get(CLAIMED) == ctx.run_key else None
        # The last run's id must not stand in for this run if recording this one fails.
        ctx.ids.pop(RUN_ID, None)
        ctx.ids.pop(CLAIMED, None)
        self._run_id = None
        store = self.open()
        record = self._run_provenance(ctx)  # None while the experiment's is still read
        run_id = store.start_run(
            ctx.ids[EXPERIMENT_ID], **self._run_fields(ctx), provenance=record, claimed=claimed
        )
        self._claims.pop(ctx.run_key, None)
        ctx.ids[RUN_ID] = self._run_id = self._runs[ctx.run_key] = run_id
        if record is None:
            self._fill_in_provenance(store, run_id, ctx.run_key, ctx.run_dir)

    def _run_fields(self, ctx: LogContext) -> dict[str, Any]:
        assert ctx.run_key is not None and ctx.group_name is not None
        return {
            "group_id": ctx.ids[group_key(ctx.group_name)],
            "run_key": ctx.run_key,
            "arm_id": ctx.ids.get(arm_key(ctx.arm)) if ctx.arm is not None else None,
            "repeat": ctx.repeat or 0,
            "stage": ctx.stage,
            "seed": ctx.seed or 0,
            "config": ctx.run_config or {},
            "output_dir": _folder(ctx),
            "parent_run_id": self._parent_id(ctx),
            "config_hash": ctx.config_hash,
        }

    def on_benchmark_eval(
        self,
        ctx: LogContext,
        eval_result: EvalResult,
        predictions: list[dict],
        *,
        step: int | None = None,
    ) -> None:
        store = self.open()
        store.flush()
        run_id = self._require_run(ctx)
        if step is None and eval_result.metrics:
            # A post-training benchmark's metrics join the run's metrics at its last step,
            # so `summaries`, the final_metrics view and lab.inspect see them as final values.
            last = store.last_step(run_id)
            named = {f"{eval_result.name}/{k}": v for k, v in eval_result.metrics.items()}
            store.log_metrics(run_id, last if last is not None else 0, named)
            store.flush()
        store.write_eval(run_id, replace(eval_result, step=step), predictions)

    def on_run_end(self, ctx: LogContext, run_result: RunResult, arm: ArmResult) -> None:
        store = self.open()
        store.flush()
        run_id = self._require_run(ctx)
        self._provenance_filled(store, run_id)  # a finished run always has its provenance
        framework = ctx.extras.pop(FRAMEWORK_CONFIG, None)
        if framework is not None:
            self._add_framework_config(store, run_id, ctx, framework)
        store.finish_run(
            run_id,
            status=run_result.status,
            error=run_result.error,
            traceback=run_result.traceback,
            summary=run_result.metrics,
            callback_errors=run_result.callback_errors,
            tags=run_result.tags,
            notes=run_result.notes,
            # only a pruned run carries one (a server from before takes no such field)
            **({"pruned": run_result.pruned} if run_result.pruned is not None else {}),
        )
        self._errors_written[run_result.run_key] = list(run_result.callback_errors)
        self._run_id = None

    def on_experiment_end(self, ctx: LogContext, result: ExperimentResult) -> None:
        store = self.open()
        for run in result.runs:  # failures raised (or counted again) after its on_run_end
            run_id = self._runs.get(run.run_key)
            if run_id is not None and run.callback_errors != self._errors_written.get(run.run_key):
                store.set_callback_errors(run_id, run.callback_errors)
        store.finish_experiment(
            ctx.ids[EXPERIMENT_ID], status=result.status, callback_errors=result.callback_errors
        )

    def close(self) -> None:
        if self._store is not None and self._owns_store:
            self._store.close()
            self._store = None

    # -- loop level ----------------------------------------------------------------------
    def post_checkpoint_loaded(self, state: LoopState, path: Path) -> None:
        self._resumed_at = state.step

    def on_train_start(self, state: LoopState) -> None:
        # A fresh start replaces the run's earlier rows; a resume keeps those up to its step.
        self.store.truncate_run(self._require_run(state.ctx), self._resumed_at)
        self._resumed_at = None

    def on_step_end(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        # per step, so no check: on_run_start opened the store and set the run's id
        self._store.log_metrics(self._run_id, step_idx, metrics)  # type: ignore[union-attr, arg-type]  # set
        if state.checkpoint_due:  # durable before the checkpoint commits
            self._store.flush()  # type: ignore[union-attr]  # opened by on_run_start

    def on_step_end_floats(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        """`on_step_end` when the loop hands over a step's metrics as it checked them: every
        value exactly a float, and no callback ran before this one that could have replaced
        one (`Dispatcher.fire_step_end`), so the store skips its pass over the types."""
        self._store.log_metrics(self._run_id, step_idx, metrics, floats=True)  # type: ignore[union-attr, arg-type]  # set
        if state.checkpoint_due:  # durable before the checkpoint commits
            self._store.flush()  # type: ignore[union-attr]  # opened by on_run_start

    def on_step_end_checked(
        self, state: LoopState, step_idx: int, batch: TrainingBatch, metrics: dict[str, float]
    ) -> None:
        """`on_step_end_floats` for a step whose keys the loop checked too (it logs the keys
        of the steps before it, each of which passed `check_key`), so the store skips its
        pass over the keys as well."""
        self._store.log_metrics(self._run_id, step_idx, metrics, floats=True, keys=True)  # type: ignore[union-attr, arg-type]  # set
        if state.checkpoint_due:  # durable before the checkpoint commits
            self._store.flush()  # type: ignore[union-attr]  # opened by on_run_start

    def on_media(self, state: LoopState, step_idx: int, media: Mapping[str, Media]) -> None:
        store = self.open()
        store.media.put(self._require_run(state.ctx), step_idx, media, state.ctx.run_dir)
        if state.checkpoint_due:  # durable before the checkpoint commits, as metrics are
            store.media.flush()

    def on_eval(
        self, state: LoopState, step_idx: int, eval_name: str, metrics: dict[str, float]
    ) -> None:
        store = self.open()
        run_id = self._require_run(state.ctx)
        # Eval metrics join the step metrics as "<eval>/<key>", so curves can plot them.
        store.log_metrics(run_id, step_idx, {f"{eval_name}/{k}": v for k, v in metrics.items()})
        from lab.store.store import Store  # loaded already: the store in hand is one or not

        if isinstance(store, Store):  # (an HttpStore's one queue sends the eval after them)
            store.flush()  # the eval row follows its metrics into the store
        result = state.current_eval  # the loop's whole result: its wall time and tags
        if result is None or result.name != eval_name or result.step != step_idx:
            result = EvalResult(eval_name, metrics, step=step_idx)  # fired by hand: no timing
        elif result.benchmark:
            return  # on_benchmark_eval follows with the predictions, and writes the row once
        store.write_eval(run_id, result)

    def on_checkpoint(self, state: LoopState, row: ManifestRow) -> None:
        store = self.open()
        store.flush()  # every metric up to a saved checkpoint is durable
        store.write_checkpoint(self._require_run(state.ctx), row)

    def on_train_end(self, state: LoopState, artifacts: LoopArtifacts) -> None:
        self.open().flush()

    # ------------------------------------------------------------------------------------
    def _require_run(self, ctx: LogContext) -> int:
        run_id = ctx.ids.get(RUN_ID, self._run_id)
        if run_id is None:
            raise ConfigError(
                "SqlLogger got a run's hook before its on_run_start: attach it to the "
                "Experiment (or lab.start_run), not to a TrainingLoop or RunHandle inside "
                "train(run)"
            )
        return run_id

    def _parent_id(self, ctx: LogContext) -> int | None:
        if ctx.parent_run_key is None:
            return None
        known = self._runs.get(ctx.parent_run_key)
        return (
            known
            if known is not None
            else self.store.find_run(ctx.ids[EXPERIMENT_ID], ctx.parent_run_key)
        )

    def _run_provenance(self, ctx: LogContext) -> dict[str, Any] | None:
        """The experiment's provenance record for a run, its diff written into the run
        folder (`lab.provenance.DIFF_FILE`); read now if the experiment did not. None while
        the experiment's is still being read: the run starts without waiting for git, and
        `_fill_in_provenance` records it once it is read."""
        if self._provenance is None:
            reading = self._reading
            if reading is not None and not reading.done():
                return None
            self._reading = None
            self._provenance = reading.result() if reading is not None else _collect()
        return _run_record(self._provenance, ctx.run_key, ctx.run_dir)

    def _fill_in_provenance(
        self, store: Store | HttpStore, run_id: int, run_key: str, run_dir: Path | None
    ) -> None:
        """Record the run's provenance as soon as the experiment's is read (in the thread
        that reads it, or here if it is done already)."""
        reading = self._reading
        assert reading is not None
        pending = _Pending(run_key, run_dir)
        self._filling[run_id] = pending

        def fill(done: Future[Provenance]) -> None:
            try:
                pending.record = _run_record(done.result(), run_key, run_dir)
                store.set_provenance(run_id, pending.record)
                pending.written = True
            except Exception as exc:  # on_run_end writes it again, and says why if it fails
                log.debug("run %s: provenance not recorded yet: %r", run_key, exc)
            finally:
                pending.done.set()

        reading.add_done_callback(fill)

    def _add_framework_config(
        self, store: Store | HttpStore, run_id: int, ctx: LogContext, config: Any
    ) -> None:
        """Record the config a framework reported beside the run's own (`FRAMEWORK_CONFIG`),
        in its provenance record."""
        if self._provenance is None:
            reading, self._reading = self._reading, None
            self._provenance = reading.result() if reading is not None else _collect()
        record = _run_record(self._provenance, ctx.run_key, ctx.run_dir)
        store.set_provenance(run_id, {**record, "framework_config": config})

    def _provenance_filled(self, store: Store | HttpStore, run_id: int) -> None:
        """Wait until a run started before its provenance was read has it recorded; write it
        here when the reading thread could not."""
        pending = self._filling.pop(run_id, None)
        if pending is None:
            return
        pending.done.wait()
        if pending.written:
            return
        try:
            record = pending.record
            if record is None:
                if self._provenance is None:
                    reading, self._reading = self._reading, None
                    assert reading is not None  # read from the experiment's start on
                    self._provenance = reading.result()
                record = _run_record(self._provenance, pending.run_key, pending.run_dir)
            store.set_provenance(run_id, record)
        except Exception as exc:
            log.warning("run %s: could not record its provenance: %s", pending.run_key, exc)


class _Pending:
    """A run's provenance still to be recorded (see `SqlLogger._fill_in_provenance`)."""

    __slots__ = ("done", "record", "run_dir", "run_key", "written")

    def __init__(self, run_key: str, run_dir: Path | None) -> None:
        self.run_key, self.run_dir = run_key, run_dir
        self.record: dict[str, Any] | None = None
        self.written = False
        self.done = threading.Event()


def _run_record(prov: Provenance, run_key: str | None, run_dir: Path | None) -> dict[str, Any]:
    """A run's copy of the experiment's provenance record, its diff written into the run
    folder (`lab.provenance.DIFF_FILE`)."""
    record = {**prov.record, "git": dict(prov.record["git"])}
    written = None
    if run_dir is not None:
        try:
            written = prov.write_diff(run_dir)
        except OSError as exc:
            log.warning("run %s: could not write its git diff: %s", run_key, exc)
    record["git"]["diff_file"] = written.name if written is not None else None
    return record


def _collect() -> Provenance:
    """`lab.provenance.collect`, which must never fail a run: what it could not read is
    recorded as an error instead."""
    try:
        return collect()
    except Exception as exc:
        log.warning("could not read the provenance of this process: %r", exc)
        return Provenance({"git": {"commit": None}, "error": repr(exc)})


def _collect_soon() -> Future[Provenance]:
    """`_collect` in a thread of its own: most of it is waiting for git's processes, which
    need not hold up the rows written meanwhile."""
    future: Future[Provenance] = Future()

    def read() -> None:
        try:
            future.set_result(_collect())
        except BaseException as exc:  # never leave the run's row waiting for nothing
            future.set_exception(exc)

    threading.Thread(target=read, name="lab-provenance", daemon=True).start()
    return future


def _folder(ctx: LogContext) -> str | None:
    """The run folder as an absolute path, so the record holds wherever it is read from."""
    return str(ctx.run_dir.resolve()) if ctx.run_dir is not None else None
