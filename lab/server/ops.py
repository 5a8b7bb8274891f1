"""An ops batch (``POST /api/v1/batches/ops``) as the server reads it: the batch's client
id and sequence number, and its operations, each ``{"op": NAME, "args": {...}}`` with the
arguments of the `Store` method of that name (what `lab.store.http` queues).

`OpsBatch` is a discriminated union on ``op``: the OpenAPI document declares each op's
arguments exactly, and the server checks a batch against it (after `lab.server.bodies`
has parsed it within bounds) before it applies any op, so a malformed op is a 422 naming
its field and nothing of its batch is written. Arguments are strict: ``true`` is not a
step, ``"1"`` is not a run id. Free text (an error, a traceback, notes) may hold anything,
the store keeps NUL as U+FFFD; text the store keeps as it is (a checkpoint's path) may not
hold NUL, which PostgreSQL cannot hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, WithJsonSchema, create_model

from lab._names import MAX_KEY
from lab.server.openapi import EXACT, Id, Int32, Int53, KeptText, Key, Tag, whole
from lab.store.tables import EXPERIMENT_STATUSES, RUN_STATUSES

#: The earliest and latest time (epoch seconds) a checkpoint row may carry: years 1 to 9999.
FIRST_TIME, LAST_TIME = -62135596800.0, 253402300799.0
#: A PNG's bytes in base64: a PNG signature, then an IHDR chunk whose width and height are
#: below 2**31 (what `lab.media.png_size` reads, and an ``integer`` column holds), in 24
#: bytes or more.
PNG_BASE64 = (
    r"^iVBORw0KGg[o-r][A-Za-z0-9+/]{5}SUhEU[g-n][A-Za-z0-9+/]{4}"
    r"[ABEFIJMNQRUVYZcdghklopstwx014589][A-Za-z0-9+/](?:[A-Za-z0-9+/]{4})+"
    r"(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
)

Seconds = Annotated[float, Field(ge=FIRST_TIME, le=LAST_TIME, allow_inf_nan=False)]


class Strict(BaseModel):
    """Arguments as the store method takes them: strict types, no other keys."""

    model_config = ConfigDict(strict=True, extra="forbid")


class Owner(BaseModel):
    """The client process that trains a run or drives an experiment: what tells a live one
    from a crashed one. Other keys are ignored."""

    model_config = ConfigDict(strict=True)

    host: Annotated[KeptText, Field(max_length=255)] | None = None
    pid: Int32 | None = None
    process_start: float | None = None
    boot_id: Annotated[KeptText, Field(max_length=64)] | None = None


class EvalIn(BaseModel):
    """An `EvalResult` without its predictions (sent beside it); other keys are ignored."""

    model_config = ConfigDict(strict=True)

    name: Key
    metrics: dict[str, Any]
    breakdowns: dict[str, Any] = Field(default_factory=dict)
    tags: dict[str, Any] = Field(default_factory=dict)
    step: Int53 | None = None
    seconds: float = 0.0
    error: str | None = None


class WriteEval(Strict):
    run_id: Id
    result: EvalIn
    predictions: list[dict[str, Any]] | None = None


class CheckpointIn(Strict):
    """A `ManifestRow`: a save or a removal of one checkpoint."""

    run_key: str
    step: Int53
    path: KeptText
    event: Literal["save", "remove"]
    time: Seconds
    metrics: dict[str, Any] = Field(default_factory=dict)
    reason: KeptText | None = None
    kind: Literal["regular", "ephemeral", "fixed"] = "regular"


class WriteCheckpoint(Strict):
    run_id: Id
    row: CheckpointIn


class Pruned(Strict):
    """Where a pruning rule stopped a run (`runs.pruned`)."""

    step: Int53
    rule: str
    metric: Key
    value: float


class FinishRun(Strict):
    run_id: Id
    status: Literal[RUN_STATUSES]  # type: ignore[valid-type]  # made of the store's tuple
    error: str | None = None
    traceback: str | None = None
    summary: dict[str, Any] | None = None
    callback_errors: list[dict[str, Any]] | None = None
    tags: list[Tag] = Field(default_factory=list)
    notes: str | None = None
    pruned: Pruned | None = None


class SetCallbackErrors(Strict):
    run_id: Id
    callback_errors: list[dict[str, Any]]


class SetProvenance(Strict):
    run_id: Id
    provenance: dict[str, Any]


class FinishExperiment(Strict):
    experiment_id: Id
    status: Literal[EXPERIMENT_STATUSES]  # type: ignore[valid-type]  # made of the store's tuple
    callback_errors: list[dict[str, Any]] | None = None


class Heartbeat(Strict):
    """The heartbeat of a client's running runs, and of the experiments it drives with the
    client's process (`owner`) as their driver."""

    run_ids: list[Id] | None = None
    experiment_ids: list[Id] | None = None
    owner: Owner | None = None


class HistogramRow(BaseModel):
    """A histogram logged at a step (`lab.media.Histogram`); other keys are ignored."""

    model_config = ConfigDict(strict=True)

    table: Literal["histograms"]
    run_id: Id
    key: Key
    step: Int53
    edges: list[float]
    counts: list[float]
    nan: Int53
    posinf: Int53
    neginf: Int53
    wall_time: float


class ImageRow(BaseModel):
    """An image logged at a step (`lab.media.Image`): its PNG's bytes in base64 (``data``;
    null from a client that sends none), kept by the store, which takes the width and
    height from them; ``path`` is the client's record of its file, never opened. Other keys
    are ignored."""

    model_config = ConfigDict(strict=True)

    table: Literal["images"]
    run_id: Id
    key: Key
    step: Int53
    path: KeptText
    width: Int32
    height: Int32
    wall_time: float
    data: (
        Annotated[
            str,
            Field(  # declared, and checked by `lab.server.ingest._image_data` (its own line)
                json_schema_extra={
                    "pattern": PNG_BASE64,
                    "contentEncoding": "base64",
                    "contentMediaType": "image/png",
                }
            ),
        ]
        | None
    ) = None


class Media(Strict):
    rows: list[Annotated[HistogramRow | ImageRow, Field(discriminator="table")]]


#: A metric key as the store takes it (`lab._metrics.check_key`): 1 to `MAX_KEY` characters,
#: no NUL.
METRIC_KEY = {"type": "string", "pattern": r"^[^\x00]*$", "minLength": 1, "maxLength": MAX_KEY}
NUMBER = {"type": "number"}


class MetricStep(Strict):
    """One step's metrics of one run: its values by key (NaN and ±inf are values, as JSON's
    ``NaN``, ``Infinity``, ``-Infinity``)."""

    run_id: Id
    step: Int53
    wall_time: float
    values: Annotated[
        dict[str, float],
        WithJsonSchema(
            {"type": "object", "propertyNames": METRIC_KEY, "additionalProperties": NUMBER}
        ),
    ]


class Metrics(Strict):
    """Metric steps in order with a batch's other writes (what a ``/batches/metrics`` Arrow
    body holds, for a few steps among other writes)."""

    steps: list[MetricStep]


class TruncateRun(Strict):
    """A run's rows after a step (all of them for null), dropped before the batch's
    later writes."""

    run_id: Id
    after_step: Int53 | None = None


#: Each op's name and the model of its arguments (the `Store` method of that name's).
ARGS: dict[str, type[BaseModel]] = {
    "write_eval": WriteEval,
    "write_checkpoint": WriteCheckpoint,
    "finish_run": FinishRun,
    "set_callback_errors": SetCallbackErrors,
    "set_provenance": SetProvenance,
    "finish_experiment": FinishExperiment,
    "heartbeat": Heartbeat,
    "media": Media,
    "metrics": Metrics,
    "truncate_run": TruncateRun,
}


def _op(name: str, args: type[BaseModel]) -> type[BaseModel]:
    """The model of one op, ``{"op": name, "args": {...}}`` (any other key is ignored)."""
    title = "".join(part.title() for part in name.split("_")) + "Op"
    return create_model(
        title,
        __config__=ConfigDict(strict=True),
        op=(Literal[name], ...),  # type: ignore[arg-type]  # the op's name, made at run time
        args=(args, ...),
    )


if TYPE_CHECKING:  # a union made at run time: to a type checker, each op is a model of `_op`
    AnyOp = BaseModel
else:
    #: One op: which model its arguments take is told by its ``op``.
    AnyOp = Annotated[
        Union[tuple(_op(name, args) for name, args in ARGS.items())],  # noqa: UP007
        Field(discriminator="op"),
    ]


class OpsBatch(BaseModel):
    """A batch of writes, applied in order in one transaction, identified by its client's
    id and sequence number (a batch sent again stores nothing twice). Other keys are
    ignored."""

    model_config = ConfigDict(strict=True)

    client_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    seq: whole(1, EXACT)  # type: ignore[valid-type]  # an Annotated int made at run time
    ops: list[AnyOp]


#: Checks a parsed batch against `OpsBatch`.
BATCH = TypeAdapter(OpsBatch)
