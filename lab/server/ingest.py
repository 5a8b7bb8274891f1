"""The write API: everything `SqlLogger` writes, as `Store`'s write methods take it.

Two kinds of route (serve_api.md, "Write API"):

- **Synchronous calls** that return ids the client needs at once (the experiment, its arms,
  groups, the run claim and start), JSON bodies with the keyword arguments of the `Store`
  method of the same name, and the few reads a recording client asks before it starts
  (``/records/...``: the runs an earlier attempt left, a run's last step).
- **Ordered, idempotent batches** of what a run writes while it trains: metric rows as an
  Arrow IPC stream (``/batches/metrics``), everything else as a list of operations
  (``/batches/ops``). Each batch carries its client's id and a sequence number; the server
  records (client, seq) in ``ingest_batches`` in the same transaction as the batch's rows
  (`lab.store.engine.one_transaction`), so a batch sent again (a retry after a lost answer,
  a spool replayed) is answered as before and stores nothing twice.

Values are JSON with NaN and ±inf written as JSON's ``NaN``/``Infinity`` (Python's `json`
reads and writes them), so they round-trip as data.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

import fastapi
import sqlalchemy as sa
import sqlalchemy.exc as sa_exc
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lab._metrics import check_key
from lab._names import MAX_KEY, check_name
from lab.errors import ConfigError, LabError, NoExperiment, NoRun, RunBusy, StoreError
from lab.media import png_size
from lab.records import EvalResult, ManifestRow
from lab.server.bodies import metric_columns, ops_body
from lab.server.openapi import (
    INT32,
    NO_NUL,
    Count,
    ExperimentPath,
    Id,
    Int32,
    Int53,
    KeptText,
    Key,
    Name,
    NamePath,
    RunPath,
    Tag,
    name_schema,
    problems,
    read_body,
)
from lab.server.ops import BATCH, OpsBatch, Owner
from lab.server.owners import Access, access, as_id
from lab.server.rejected import Rejected
from lab.store import Store
from lab.store.engine import one_transaction
from lab.store.tables import EXPERIMENT_STATUSES, GROUP_KINDS, MAX_TEST, TRIAL_STATES

router = fastapi.APIRouter(tags=["write"])

T = TypeVar("T")
#: A client id: what `HttpStore` makes (a uuid4 in hex), or any short plain name.
CLIENT_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: A batch's sequence number in its header: a whole number from 1, of at most 18 digits.
SEQ = re.compile(r"^0*[1-9][0-9]{0,17}$")
#: Base64 as an image's bytes travel: padded, no other character. With `lab.media.png_size`
#: and the size check of `_image_data`, what `lab.server.ops.PNG_BASE64` declares.
BASE64 = re.compile(r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$")


# -- bodies -----------------------------------------------------------------------------------
# Strict: a body's values are taken as the types they are declared, never converted (true is
# no step, "1" no id); other keys are ignored. Names, keys and tags are declared by the rules
# the store checks them by, and refused with the store's own line (400).
class Body(BaseModel):
    model_config = ConfigDict(strict=True)


class ExperimentIn(Body):
    name: Name
    config: dict[str, Any] = Field(default_factory=dict)
    seed: Int32 = 0
    repeats: Int32 = 1
    tags: list[Tag] = Field(default_factory=list)
    notes: str | None = None
    owner: Owner | None = None


class ArmIn(Body):
    name: Name
    overrides: dict[str, Any] = Field(default_factory=dict)
    config: dict[str, Any] = Field(default_factory=dict)


class GroupIn(Body):
    name: Name
    kind: Literal[GROUP_KINDS] = "repeats"  # type: ignore[valid-type]  # made of the store's tuple
    arm_id: Id | None = None


class RunIn(Body):
    group_id: Id
    run_key: Key
    arm_id: Id | None = None
    repeat: Int32 = 0
    stage: Int32 = 0
    seed: Int32 = 0
    config: dict[str, Any] = Field(default_factory=dict)
    output_dir: KeptText | None = None
    parent_run_id: Id | None = None
    config_hash: Annotated[KeptText, Field(max_length=64)] | None = None
    owner: Owner | None = None


class StartIn(RunIn):
    provenance: dict[str, Any] | None = None
    claimed: Id | None = None


class FinishExperimentIn(Body):
    status: Literal[EXPERIMENT_STATUSES]  # type: ignore[valid-type]  # made of the store's tuple
    callback_errors: list[dict[str, Any]] | None = None


class ReleaseIn(Body):
    error: str
    owner: Owner | None = None


class SupersedeIn(Body):
    run_key: Key
    output_dir: KeptText | None = None


class TruncateIn(Body):
    after_step: Int53 | None = None


class TrialIn(Body):
    """A sampled arm, asked (`Store.add_trial`)."""

    number: Count
    arm_id: Id
    params: dict[str, Any] = Field(default_factory=dict)
    asked_after: Count


class TellIn(Body):
    """How a sampled arm ended (`Store.tell_trial`): value null for a failed one."""

    told: Count
    value: float | None
    state: Literal[TRIAL_STATES]  # type: ignore[valid-type]  # made of the store's tuple


class EliminationIn(Body):
    """An arm a race dropped (`Store.add_elimination`)."""

    arm_id: Id
    round: Count
    test: Annotated[str, Field(json_schema_extra=name_schema(MAX_TEST))]
    statistic: float
    p_value: float
    alpha: float
    best: Name


# -- answers ----------------------------------------------------------------------------------
class ExperimentId(BaseModel):
    experiment_id: int


class ArmId(BaseModel):
    arm_id: int


class GroupId(BaseModel):
    group_id: int


class RunId(BaseModel):
    run_id: int


class MaybeRunId(BaseModel):
    run_id: int | None


class Finished(BaseModel):
    """A run another process finished: its status and final metrics."""

    status: str
    summary: dict[str, Any]


class Claim(BaseModel):
    """A claim's outcome: ``run_id`` when the client won the run, else ``finished``."""

    run_id: int | None
    finished: Finished | None


class Done(BaseModel):
    ok: Literal[True]


class Crashed(BaseModel):
    run_keys: list[str]


class PreviousRun(BaseModel):
    """A current run, as a later attempt judges whether it may reuse it."""

    run_key: str
    status: str
    seed: int
    stage: int
    config: dict[str, Any]
    config_hash: str | None
    summary: dict[str, Any]
    host: str | None
    pid: int | None
    started_at: str
    train: Any
    pruned: dict[str, Any] | None = None  # a pruned run's stop: step, rule, metric, value


class Superseded(BaseModel):
    superseded: int


class CurrentRun(BaseModel):
    """A current run: its id, key, status, folder and owner."""

    run_id: int
    run_key: str
    status: str
    output_dir: str | None
    host: str | None
    pid: int | None
    started_at: str


class LastStep(BaseModel):
    last_step: int | None


class Scope(BaseModel):
    """What a write token may do here: the store's schema revision and the ops an ops batch
    may hold."""

    model_config = ConfigDict(populate_by_name=True)

    scope: Literal["write"]
    schema_: str = Field(alias="schema")
    ops: list[str]


class Stored(BaseModel):
    """A batch's acknowledgement: the ``rows`` it stored (0 when it was stored before)."""

    client_id: str
    seq: int
    rows: int


# -- answers and errors -----------------------------------------------------------------------
def _json(value: Any) -> fastapi.Response:
    """A JSON answer that keeps NaN and ±inf (FastAPI's own refuses them)."""
    from fastapi.encoders import jsonable_encoder

    return fastapi.Response(json.dumps(jsonable_encoder(value)), media_type="application/json")


def _call(where: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a store call, its refusals as 4xx answers with the store's one line, naming
    `where` (the request's field the call was about: ``path.run_id``, ``body``...). A store
    that fails is no refusal: its `StoreError` goes on to the app, which answers 503 without
    the store's URL."""
    try:
        return fn(*args, **kwargs)
    except StoreError:
        raise
    except RunBusy as exc:
        raise Rejected(409, str(exc), where) from None
    except (NoExperiment, NoRun) as exc:
        raise Rejected(404, str(exc), where) from None
    except LabError as exc:
        raise Rejected(400, str(exc), getattr(exc, "field", None) or where) from None
    except sa_exc.IntegrityError:
        raise Rejected(
            404, "an experiment, group, arm or run id in the request is not in the store", where
        ) from None
    except (sa_exc.DataError, ValueError, TypeError, KeyError) as exc:
        why = _first_line(exc)
        raise Rejected(400, f"the store cannot hold this request's values: {why}", where) from None


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _store(request: fastapi.Request) -> Store:
    return request.app.state.store


def _owner(owner: Owner | None) -> dict[str, Any] | None:
    return None if owner is None else owner.model_dump()


# -- synchronous calls ------------------------------------------------------------------------
@router.post("/experiments")
def begin_experiment(body: ExperimentIn, request: fastapi.Request) -> ExperimentId:
    """Create the experiment, or reopen the one of that name (`Store.begin_experiment`),
    driven by the client's process. A new one is recorded as created by this request's
    token; one that exists is reopened only by a token that may write it (403 otherwise,
    see `lab.server.owners`)."""
    store = _store(request)
    allowed = access(request)

    def begin() -> int:
        with one_transaction(store.engine):
            allowed.check_begin(body.name)
            return store.begin_experiment(
                body.name,
                config=body.config,
                seed=body.seed,
                repeats=body.repeats,
                tags=body.tags,
                notes=body.notes,
                owner=_owner(body.owner) or {},
                created_by=allowed.token.name,
            )

    return ExperimentId(experiment_id=_call("body", begin))


@router.post("/experiments/{experiment_id}/arms", responses=problems(404))
def add_arm(experiment_id: ExperimentPath, body: ArmIn, request: fastapi.Request) -> ArmId:
    """Record an arm of an experiment (`Store.add_arm`)."""
    store = _store(request)
    arm_id = _call(
        "path.experiment_id",
        store.add_arm,
        experiment_id,
        body.name,
        overrides=body.overrides,
        config=body.config,
    )
    return ArmId(arm_id=arm_id)


@router.post("/experiments/{experiment_id}/groups", responses=problems(404))
def add_group(experiment_id: ExperimentPath, body: GroupIn, request: fastapi.Request) -> GroupId:
    """Record a group of runs (`Store.add_group`)."""
    store = _store(request)
    access(request).check_parts(experiment_id, arm_id=body.arm_id)
    group_id = _call(
        "path.experiment_id",
        store.add_group,
        experiment_id,
        body.name,
        kind=body.kind,
        arm_id=body.arm_id,
    )
    return GroupId(group_id=group_id)


@router.post(
    "/experiments/{experiment_id}/claims", response_model=Claim, responses=problems(404, 409)
)
def claim_run(
    experiment_id: ExperimentPath, body: RunIn, request: fastapi.Request
) -> fastapi.Response:
    """Claim a run before it starts (`Store.claim_run`): ``run_id`` when the client won it,
    ``finished`` (its record) when another process finished it; 409 while one trains it."""
    store = _store(request)
    _check_run_parts(request, experiment_id, body)
    fields = body.model_dump(exclude={"owner"})
    run_id, finished = _call(
        "path.experiment_id",
        store.claim_run,
        experiment_id,
        owner=_owner(body.owner) or {},
        **fields,
    )
    if run_id is not None:
        store.hand_over(run_id)
    return _json({"run_id": run_id, "finished": finished})


@router.post("/experiments/{experiment}/runs", responses=problems(404, 409))
def start_run(
    body: StartIn,
    request: fastapi.Request,
    experiment_id: Annotated[
        int, fastapi.Path(alias="experiment", ge=1, le=INT32, description="the experiment's id")
    ],
) -> RunId:
    """Record a run as `running` under the client's process (`Store.start_run`)."""
    store = _store(request)
    _check_run_parts(request, experiment_id, body, claimed=body.claimed)
    fields = body.model_dump(exclude={"owner"})
    run_id = _call(
        "path.experiment",
        store.start_run,
        experiment_id,
        owner=_owner(body.owner) or {},
        **fields,
    )
    # The client's batches keep the run's heartbeat, not this server.
    store.hand_over(run_id)
    return RunId(run_id=run_id)


@router.post("/experiments/{experiment_id}/finish", responses=problems(404))
def finish_experiment(
    experiment_id: ExperimentPath, body: FinishExperimentIn, request: fastapi.Request
) -> Done:
    """Record an experiment's final status (`Store.finish_experiment`)."""
    store = _store(request)
    _call(
        "path.experiment_id",
        store.finish_experiment,
        experiment_id,
        status=body.status,
        callback_errors=body.callback_errors,
    )
    return Done(ok=True)


@router.post("/runs/{run_id}/release", responses=problems(404))
def release_run(run_id: RunPath, body: ReleaseIn, request: fastapi.Request) -> Done:
    """Record a claimed run that never started as failed (`Store.release_run`)."""
    _call("path.run_id", _store(request).release_run, run_id, body.error, _owner(body.owner) or {})
    return Done(ok=True)


@router.post("/runs/{run_id}/supersede", responses=problems(404, 409))
def supersede_run(run_id: RunPath, body: SupersedeIn, request: fastapi.Request) -> Done:
    """Set a run aside under a new key (`Store.supersede_run`); the key is checked as a
    run's key is, so that it fits the store's column on every backend."""
    _call("body.run_key", check_name, "run key", body.run_key, MAX_KEY)
    _call("path.run_id", _store(request).supersede_run, run_id, body.run_key, body.output_dir)
    return Done(ok=True)


@router.post("/runs/{run_id}/truncate", responses=problems(404))
def truncate_run(run_id: RunPath, body: TruncateIn, request: fastapi.Request) -> Done:
    """Drop a run's rows after a step, or all of them (`Store.truncate_run`)."""
    _call("path.run_id", _store(request).truncate_run, run_id, body.after_step)
    return Done(ok=True)


@router.post("/experiments/{experiment_id}/sweep/trials", responses=problems(400, 404))
def add_trial(experiment_id: ExperimentPath, body: TrialIn, request: fastapi.Request) -> Done:
    """Record a sampled arm of an experiment as asked (`Store.add_trial`); the same trial
    again stores nothing, another one under its number is refused (400)."""
    access(request).check_parts(experiment_id, arm_id=body.arm_id)
    _call("path.experiment_id", _store(request).add_trial, experiment_id, body.number,
          body.arm_id, body.params, body.asked_after)  # fmt: skip
    return Done(ok=True)


@router.post(
    "/experiments/{experiment_id}/sweep/trials/{number}/tell", responses=problems(400, 404)
)
def tell_trial(
    experiment_id: ExperimentPath,
    number: Annotated[int, fastapi.Path(ge=0, le=INT32, description="the trial's number")],
    body: TellIn,
    request: fastapi.Request,
) -> Done:
    """Record how a sampled arm ended (`Store.tell_trial`); 404 for a trial not asked."""
    _call("path.number", _store(request).tell_trial, experiment_id, number, told=body.told,
          value=body.value, state=body.state)  # fmt: skip
    return Done(ok=True)


@router.post("/experiments/{experiment_id}/race/eliminations", responses=problems(400, 404))
def add_elimination(
    experiment_id: ExperimentPath, body: EliminationIn, request: fastapi.Request
) -> Done:
    """Record that a race dropped an arm (`Store.add_elimination`); an arm is dropped once."""
    access(request).check_parts(experiment_id, arm_id=body.arm_id)
    _call("body", _store(request).add_elimination, experiment_id, body.arm_id,
          round=body.round, test=body.test, statistic=body.statistic, p_value=body.p_value,
          alpha=body.alpha, best=body.best)  # fmt: skip
    return Done(ok=True)


def _check_run_parts(
    request: fastapi.Request, experiment_id: int, body: RunIn, claimed: int | None = None
) -> None:
    """404 unless the group, arm, parent run and claimed run a run's body names belong to
    the experiment of its path: a client starts runs only inside an experiment it writes."""
    access(request).check_parts(
        experiment_id,
        group_id=body.group_id,
        arm_id=body.arm_id,
        runs={"parent_run_id": body.parent_run_id, "claimed": claimed},
    )


# -- what a recording client reads before it starts -------------------------------------------
@router.post("/records/mark_crashed")
def mark_crashed(request: fastapi.Request) -> Crashed:
    """Mark the runs whose process is gone `crashed` (`Store.mark_crashed`)."""
    return Crashed(run_keys=_call("body", _store(request).mark_crashed))


@router.get("/records/experiments/{name}/previous_runs", response_model=dict[str, PreviousRun])
def previous_runs(name: NamePath, request: fastapi.Request) -> fastapi.Response:
    """The current runs of an experiment, by run key (`Store.previous_runs`)."""
    return _json(_call("path.name", _store(request).previous_runs, name))


@router.get("/records/experiments/{name}/current_runs", response_model=list[CurrentRun])
def current_runs(name: NamePath, request: fastapi.Request) -> fastapi.Response:
    """The current runs of an experiment, as rows (`Store.current_runs`)."""
    return _json(_call("path.name", _store(request).current_runs, name))


@router.post("/records/experiments/{name}/supersede_trials", responses=problems(403))
def supersede_trials(name: NamePath, request: fastapi.Request) -> Superseded:
    """Set an experiment's sweep trials aside (`Store.supersede_trials`): kept, out of
    every reader. Only a token that may write the experiment may (none: nothing to do)."""
    access(request).check_begin(name, "path.name")
    return Superseded(superseded=_call("path.name", _store(request).supersede_trials, name))


@router.get("/records/experiments/{name}/run_keys")
def run_keys(name: NamePath, request: fastapi.Request) -> list[str]:
    """Every run key an experiment recorded (`Store.run_keys`)."""
    return _call("path.name", _store(request).run_keys, name)


@router.get("/records/runs", responses=problems(404))
def find_run(
    experiment_id: Annotated[int, fastapi.Query(ge=1, le=INT32)],
    run_key: Annotated[str, fastapi.Query(pattern=NO_NUL)],
    request: fastapi.Request,
) -> MaybeRunId:
    """The id of an experiment's run by key, or null (`Store.find_run`)."""
    found = _call("query.experiment_id", _store(request).find_run, experiment_id, run_key)
    return MaybeRunId(run_id=found)


@router.get("/records/runs/{run_id}/last_step", responses=problems(404))
def last_step(run_id: RunPath, request: fastapi.Request) -> LastStep:
    """A run's last metric step, or null (`Store.last_step`)."""
    return LastStep(last_step=_call("path.run_id", _store(request).last_step, run_id))


# -- ordered, idempotent batches --------------------------------------------------------------
@router.get("/batches/check")
def check_write(request: fastapi.Request) -> Scope:
    """Answers 200 to a write token (401 wrong or revoked, 403 a read token): what a client
    asks when it opens, so a bad token stops it before anything runs. The answer names the
    store's schema revision (as the health check does) and the operations an ops batch may
    hold, so that a client opens with this one request and sends only what this server
    takes."""
    from lab.store.migrations import head_revision

    schema = _store(request).revision or head_revision()
    return Scope(scope="write", schema=schema, ops=list(OPS))


def _field(where: str, name: str) -> str:
    """The field a batch id came in: an X-Lab- header of a metrics batch, or the body."""
    return f"header.x-lab-{name.replace('_id', '')}" if where else f"body.{name}"


def _batch_id(client_id: Any, seq: Any, where: str) -> tuple[str, int]:
    if not isinstance(client_id, str) or not CLIENT_ID.fullmatch(client_id):
        raise Rejected(
            400,
            f"{where}client_id must be 1 to 64 letters, digits, '_', '.' or '-'",
            _field(where, "client_id"),
        )
    try:
        number = 0 if isinstance(seq, str) and not SEQ.fullmatch(seq) else int(seq)
    except (TypeError, ValueError):
        number = 0
    if isinstance(seq, bool) or number < 1 or number >= 2**63:
        raise Rejected(400, f"{where}seq must be a whole number >= 1", _field(where, "seq"))
    return client_id, number


def _record_batch(store: Store, conn: sa.Connection, client_id: str, seq: int, rows: int) -> bool:
    """Record (client, seq) in this transaction; False when it was recorded before."""
    return store.record_batch(conn, client_id, seq, rows)


@router.post(
    "/batches/metrics",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/vnd.apache.arrow.stream": {
                    "schema": {"type": "string", "format": "binary"}
                }
            },
        }
    },
    responses=problems(404),
)
async def metrics_batch(
    request: fastapi.Request,
    x_lab_client: str = fastapi.Header(json_schema_extra={"pattern": CLIENT_ID.pattern}),
    x_lab_seq: str = fastapi.Header(json_schema_extra={"pattern": SEQ.pattern}),
) -> Stored:
    """Store a batch of metric rows: an Arrow IPC stream with columns run_id (int64), step
    (int64), key (string), value (float64; NaN and ±inf kept) and wall_time (float64,
    optional), identified by the X-Lab-Client and X-Lab-Seq headers."""
    client_id, seq = _batch_id(x_lab_client, x_lab_seq, "X-Lab-")
    body = await request.body()
    columns = metric_columns(body)  # bounded: see lab.server.bodies
    allowed = access(request)
    return await run_in_threadpool(
        _store_metrics, _store(request), allowed, client_id, seq, columns
    )


def _store_metrics(
    store: Store, allowed: Access, client_id: str, seq: int, columns: dict[str, list[Any]]
) -> Stored:
    allowed.check_write(runs=set(columns["run_id"]), field="body.run_id")  # before any row
    rows = len(columns["run_id"])

    def write() -> bool:
        with one_transaction(store.engine) as conn:
            if not _record_batch(store, conn, client_id, seq, rows):
                return False
            store.write_metric_columns(  # joins this transaction
                columns["run_id"], columns["step"], columns["key"], columns["value"],
                columns["wall_time"],
            )  # fmt: skip
            return True

    fresh = _call("body", write)
    return Stored(client_id=client_id, seq=seq, rows=rows if fresh else 0)


@router.post("/batches/ops", openapi_extra=read_body(OpsBatch), responses=problems(404))
async def ops_batch(request: fastapi.Request) -> Stored:
    """Apply a batch of writes in order, in one transaction: a JSON object
    ``{"client_id", "seq", "ops": [{"op": NAME, "args": {...}}, ...]}`` where NAME is one
    of write_eval, write_checkpoint, finish_run, set_callback_errors, set_provenance,
    finish_experiment, heartbeat, media, metrics (metric steps: each one's run, step, wall
    time and values by key) and truncate_run (the `Store` method's keyword arguments; see
    `lab.store.http`).
    At most `lab.server.bodies.MAX_BATCH_OPS` ops in one batch."""
    body = ops_body(await request.body())  # bounded: see lab.server.bodies
    client_id, seq = _batch_id(body.get("client_id"), body.get("seq"), "")
    ops = body["ops"]
    runs: set[int] = set()
    experiments: set[int] = set()
    for i, op in enumerate(ops):
        known = isinstance(op, dict) and isinstance(op.get("op"), str) and op["op"] in OPS
        if not known or not isinstance(op.get("args"), dict):
            raise Rejected(
                400,
                f'ops.{i}: each op is {{"op": one of {", ".join(OPS)}, "args": {{...}}}}',
                f"body.ops.{i}",
            )
    try:  # the ops as declared (`lab.server.ops`), their ids and numbers as whole numbers
        ops = [op.model_dump() for op in BATCH.validate_python(body).ops]
    except ValidationError as exc:
        raise RequestValidationError(
            [{**error, "loc": ("body", *error["loc"])} for error in exc.errors()]
        ) from None
    for i, op in enumerate(ops):
        _op_ids(op, f"body.ops.{i}.args", runs, experiments)
    allowed = access(request)

    def apply() -> Stored:
        if runs or experiments:  # every id the batch names, before any of it is stored
            allowed.check_write(runs=runs, experiments=experiments, field="body.ops")
        return _apply_ops(_store(request), client_id, seq, ops)

    return await run_in_threadpool(apply)


def _op_ids(op: dict[str, Any], where: str, runs: set[int], experiments: set[int]) -> None:
    """Add the run and experiment ids operation `op` writes to `runs` and `experiments`
    (a 400 for an id that is not a whole number)."""
    args = op["args"]
    if op["op"] == "metrics":
        runs.update(one["run_id"] for one in args["steps"])  # whole numbers: `lab.server.ops`
        return
    if op["op"] == "media":
        rows = args.get("rows")
        for j, row in enumerate(rows if isinstance(rows, list) else []):
            if isinstance(row, dict) and "run_id" in row:
                runs.add(as_id(row["run_id"], f"{where}.rows.{j}.run_id"))
        return
    if op["op"] == "heartbeat":
        for name, into in (("run_ids", runs), ("experiment_ids", experiments)):
            values = args.get(name) or []
            if not isinstance(values, list):
                raise Rejected(400, f"{where}.{name} must be a list of ids", f"{where}.{name}")
            into.update(as_id(v, f"{where}.{name}") for v in values)
        return
    for name, into in (("run_id", runs), ("experiment_id", experiments)):
        if name in args:
            into.add(as_id(args[name], f"{where}.{name}"))


def _apply_ops(store: Store, client_id: str, seq: int, ops: list[dict[str, Any]]) -> Stored:
    def write() -> bool:
        with one_transaction(store.engine) as conn:
            if not _record_batch(store, conn, client_id, seq, len(ops)):
                return False
            for i, op in enumerate(ops):
                try:
                    OPS[op["op"]](store, conn, **op["args"])
                except TypeError as exc:
                    raise ConfigError(f"ops.{i} ({op['op']}): {exc}") from None
            return True

    fresh = _call("body", write)
    return Stored(client_id=client_id, seq=seq, rows=len(ops) if fresh else 0)


def _metrics(store: Store, conn: sa.Connection, steps: list[dict[str, Any]]) -> None:
    """Metric steps in a JSON batch, in order with its other writes: each step's run, step,
    wall time and values by key (`lab.server.ops.MetricStep`)."""
    run_id: list[int] = []
    step: list[int] = []
    key: list[str] = []
    value: list[float] = []
    wall_time: list[float] = []
    for one in steps:
        values = one["values"]
        for word in values:
            check_key(word, one["step"])
        n = len(values)
        run_id += [one["run_id"]] * n
        step += [one["step"]] * n
        key += values.keys()
        value += map(float, values.values())
        wall_time += [float(one["wall_time"])] * n
    store.write_metric_columns(run_id, step, key, value, wall_time)


def _truncate_run(
    store: Store, conn: sa.Connection, run_id: int, after_step: int | None = None
) -> None:
    """A run's rows after a step, or all of them, dropped in order with the batch's other
    writes (`Store.truncate_run`)."""
    if after_step is not None and type(after_step) is not int:
        raise ConfigError("truncate_run: after_step must be a whole number or null")
    store.truncate_run(int(run_id), after_step)


def _write_eval(
    store: Store,
    conn: sa.Connection,
    run_id: int,
    result: dict[str, Any],
    predictions: list[dict[str, Any]] | None = None,
) -> None:
    known = {k: result[k] for k in ("name", "metrics", "breakdowns", "tags", "step", "seconds",
                                    "error") if k in result}  # fmt: skip
    store.write_eval(int(run_id), EvalResult(**known), predictions)


def _write_checkpoint(store: Store, conn: sa.Connection, run_id: int, row: dict[str, Any]) -> None:
    store.write_checkpoint(int(run_id), ManifestRow(**row))


def _finish_run(store: Store, conn: sa.Connection, run_id: int, **fields: Any) -> None:
    store.finish_run(int(run_id), **fields)


def _set_callback_errors(
    store: Store, conn: sa.Connection, run_id: int, callback_errors: list[dict[str, Any]]
) -> None:
    store.set_callback_errors(int(run_id), callback_errors)


def _set_provenance(
    store: Store, conn: sa.Connection, run_id: int, provenance: dict[str, Any]
) -> None:
    if not isinstance(provenance, dict):
        raise ConfigError("provenance must be a JSON object")
    store.set_provenance(int(run_id), provenance)


def _finish_experiment(store: Store, conn: sa.Connection, experiment_id: int, **kw: Any) -> None:
    store.finish_experiment(int(experiment_id), **kw)


def _heartbeat(
    store: Store,
    conn: sa.Connection,
    run_ids: list[int] | None = None,
    experiment_ids: list[int] | None = None,
    owner: dict[str, Any] | None = None,
) -> None:
    """The heartbeat of a client's running runs, and of the experiments it drives with the
    client's process as their driver (`MetricRows.drive`)."""
    if run_ids:
        store.metric_rows.beat(conn, [int(i) for i in run_ids])
    if experiment_ids:
        driver = Owner.model_validate(owner or {}).model_dump()
        store.metric_rows.drive(conn, [int(i) for i in experiment_ids], driver)


def _media(store: Store, conn: sa.Connection, rows: list[dict[str, Any]]) -> None:
    """Histogram and image rows (``table`` "histograms" or "images", and the row's columns),
    the last one logged at a (run, key, step) winning, as `lab.store.media` writes them.

    An image row brings its PNG's bytes (``data``, base64), which the store keeps and the
    dashboard serves; its size is read from them. Its ``path`` is kept as the client's
    record of where it wrote the file, never opened: a server reads no file a client names."""
    latest: dict[str, dict[tuple[int, str, int], dict[str, Any]]] = {
        "histograms": {},
        "images": {},
    }
    for row in rows:
        row = dict(row)
        table = row.pop("table", None)
        if table not in latest:
            raise ConfigError("media rows need table 'histograms' or 'images'")
        check_name("media key", row.get("key"), MAX_KEY)
        if table == "images":
            row.update(_image_data(row.get("data")))
        latest[table][(int(row["run_id"]), row["key"], int(row["step"]))] = row
    for table, by_key in latest.items():
        if by_key:
            conn.execute(store.media._upserts[table], list(by_key.values()))


def _image_data(text: Any) -> dict[str, Any]:
    """An image row's ``data`` (base64 of a PNG) as the bytes to keep, with the PNG's own
    width and height; ``data`` None for a row without bytes (a client from before the store
    kept them)."""
    if text is None:
        return {"data": None}
    if not isinstance(text, str) or not BASE64.fullmatch(text):
        raise ConfigError("media rows: an image's data must be its PNG's bytes in base64")
    size = png_size(data := base64.b64decode(text))
    if size is None:
        raise ConfigError("media rows: an image's data is not a PNG; send the PNG's bytes")
    if max(size) > INT32:
        raise ConfigError(
            f"media rows: an image's PNG says it is {size[0]} x {size[1]} pixels; the store "
            f"holds sizes up to {INT32}"
        )
    return {"data": data, "width": size[0], "height": size[1]}


OPS: dict[str, Callable[..., None]] = {
    "write_eval": _write_eval,
    "write_checkpoint": _write_checkpoint,
    "finish_run": _finish_run,
    "set_callback_errors": _set_callback_errors,
    "set_provenance": _set_provenance,
    "finish_experiment": _finish_experiment,
    "heartbeat": _heartbeat,
    "media": _media,
    "metrics": _metrics,
    "truncate_run": _truncate_run,
}
