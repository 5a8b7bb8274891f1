"""What the server's OpenAPI document (``/openapi.json``) says beyond what FastAPI reads from
a route's signature, so that the document is true to the server: the one body of every
rejection (`Problem`) and which statuses a route answers with it (`problems`), and the
types of the values the routes take and answer.

The document is checked against the running server by schemathesis's conformance checks
(``tests/test_serve_fuzz.py``): every status a route answers is declared, every answer
matches its declared schema, every request the document calls valid is accepted and every
request it calls invalid is refused. Where a route checks a value itself (to answer 400
with a line of its own), its parameter declares the same rule (`ranged`, `one_of`), so
that a client reading the document knows it before it sends anything.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import fastapi
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.json_schema import models_json_schema
from pydantic_core import PydanticCustomError

from lab._names import MAX_KEY, MAX_NAME, TAG

#: The largest integer an ``integer`` column holds on PostgreSQL (ids, seeds, repeats).
INT32 = 2**31 - 1
#: The largest whole number a JSON number holds exactly (a double): the bound of a step or
#: a count in JSON, where the store's ``bigint`` would hold more than a client can send.
EXACT = 2**53


class Problem(BaseModel):
    """The body of every rejection: one line that says what is wrong and what to do, and
    the dotted name of the offending field (``query.limit``, ``body.ops.3``), null when no
    one field is at fault."""

    model_config = ConfigDict(extra="forbid")

    detail: Annotated[str, Field(min_length=1)]
    field: str | None


class Invalid(Problem):
    """The body of a 422: a parameter or a body field is missing or of the wrong type, and
    ``field`` names it."""

    field: str


#: What each status of a rejection means, whichever route answers it.
WHY: dict[int, str] = {
    400: "The request asks for something the server refuses (the line says what and why), "
    "or its body cannot be read",
    401: "No token, or one the store does not know or has revoked",
    403: "The token may not do this: a read token writes nothing, a write token only the "
    "experiments it created, a token limited to an experiment reads and writes no other",
    404: "What the request names is not in the store",
    408: "The request body stopped arriving (the server's --timeout-body)",
    409: "The request conflicts with what the store holds: a run another process trains, "
    "or recorded meanwhile with other settings",
    413: "The request body is over the server's --max-body, or holds more than one batch may",
    421: "The request was not addressed to 127.0.0.1 or localhost (lab ui answers those only)",
    422: "A parameter or a body field is missing or of the wrong type (``field`` names it)",
    503: "The store behind the server failed; try again later",
}


def problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of the rejections `statuses`, each with the `Problem` body:
    what a route (or a router, for all of its routes) declares besides its answer."""
    return {
        status: {"model": Invalid if status == 422 else Problem, "description": WHY[status]}
        for status in statuses
    }


def read_body(model: type[BaseModel]) -> dict[str, Any]:
    """The ``openapi_extra`` of a route that reads its JSON body itself (within bounds, see
    `lab.server.bodies`) and checks it against `model`: the body as the document declares
    it (`with_models` puts `model` among the document's schemas)."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def with_models(app: Any, *models: type[BaseModel]) -> None:
    """Make `app`'s OpenAPI document hold `models` among its schemas: the bodies of the
    routes that read their body themselves (`read_body`), which FastAPI does not see."""
    make = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = make()
            _, found = models_json_schema(
                [(model, "validation") for model in models],
                ref_template="#/components/schemas/{model}",
            )
            document.setdefault("components", {}).setdefault("schemas", {}).update(
                found.get("$defs", {})
            )
        return app.openapi_schema

    app.openapi = openapi


def ranged(default: int | None, low: int, high: int, **kwargs: Any) -> Any:
    """A query parameter that the route itself checks to lie in `low`..`high` (answering
    400 with a line that names the limits): the range as the document declares it."""
    return fastapi.Query(default, json_schema_extra={"minimum": low, "maximum": high}, **kwargs)


def one_of(default: str | None, *values: str, **kwargs: Any) -> Any:
    """A query parameter that the route itself checks to be one of `values` (answering 400
    with a line that lists them): the choice as the document declares it."""
    return fastapi.Query(default, json_schema_extra={"enum": list(values)}, **kwargs)


#: A pattern for text with no NUL character, which PostgreSQL cannot hold and so no name,
#: key or value in the store holds: a parameter that is looked up in the store.
NO_NUL = r"^[^\x00]*$"
#: Text the store keeps as it is (a path, a host): no NUL, which PostgreSQL cannot hold.
KeptText = Annotated[str, Field(pattern=NO_NUL)]
#: The characters Python counts as whitespace (what ``str.strip`` removes), spelled out for
#: a character class: ``\s`` means other sets in other engines.
SPACE = r"\t-\r\x1c- \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
#: A pattern for a name the store takes (`lab._names.check_name`): not blank, no NUL.
NAMED = rf"^[^\x00]*[^\x00{SPACE}][^\x00]*$"


def _whole(value: Any) -> Any:
    """A whole number as JSON has it: an integer, or a number without a fraction (JSON
    Schema counts ``1.0`` an integer); never ``true`` or ``"1"``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


def whole(low: int, high: int) -> Any:
    """The type of a whole number in a body, within `low`..`high` (see `_whole`): what
    the document declares ``integer`` with its bounds, and no more nor less."""
    return Annotated[int, Field(strict=False, ge=low, le=high), BeforeValidator(_whole)]


#: A step or a count in a body: a whole number JSON holds exactly.
Int53 = whole(-EXACT, EXACT)
#: A whole number the store's ``integer`` columns hold on PostgreSQL: seeds, repeats, stages.
Int32 = whole(-INT32 - 1, INT32)
#: The id of a row the store made (experiment, arm, group, run): a whole number from 1.
Id = whole(1, INT32)
#: A count or an order the store's ``integer`` columns hold: a whole number from 0 (a
#: sweep's trial number, a race's round).
Count = whole(0, INT32)
#: A time as the server writes it: ISO 8601 in UTC, without an offset.
Timestamp = Annotated[str, Field(description="ISO 8601, UTC without an offset")]
#: A float as the server writes it: a JSON number, or NaN and ±inf as the strings
#: ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``.
Number = float | Literal["NaN", "Infinity", "-Infinity"]


def name_schema(limit: int = MAX_NAME) -> dict[str, Any]:
    """The JSON schema of a name the store checks itself (`lab._names.check_name`: not
    blank, no NUL, at most `limit` characters): declared, not enforced here, so that the
    store's own line answers a bad one."""
    return {"type": "string", "pattern": NAMED, "minLength": 1, "maxLength": limit}


#: An experiment, arm or group name in a body.
Name = Annotated[str, Field(json_schema_extra=name_schema())]
#: A run key, an eval name or a metric key in a body.
Key = Annotated[str, Field(json_schema_extra=name_schema(MAX_KEY))]
#: A tag in a body (`lab._names.check_tags`, which answers a bad one with its own line).
Tag = Annotated[str, Field(json_schema_extra={"pattern": TAG.pattern})]


#: What the document says of an experiment's name in a path.
NAME_IN_PATH = "the experiment's name (a / in it sent as %2F)"
#: An experiment's name in a path.
NamePath = Annotated[str, fastapi.Path(pattern=NO_NUL, description=NAME_IN_PATH)]
#: An experiment's id in a path (the write API's).
ExperimentPath = Annotated[
    int, fastapi.Path(ge=1, le=INT32, description="the experiment's id (as it was created)")
]
#: A run's id in a path.
RunPath = Annotated[int, fastapi.Path(ge=1, le=INT32, description="the run's id")]
