"""How `lab serve` answers what went wrong: one shape, ``{"detail": "<one line>", "field":
"<dotted name>" | null}``, whatever raised it (a route's `Rejected`, a `LabError` from the
store, FastAPI's validation, a body over the limit, a database that refuses a write), and
`STORE_DOWN` for a store that fails, with nothing of its URL or reason, which only the
server's log holds (`lab.server.app.Outage`)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from lab._secrets import mask
from lab.errors import LabError, NoExperiment, NoRun, NoToken, RunBusy, StoreError
from lab.server.rejected import Rejected

#: The one line a 503 says while the store behind the server fails: nothing of the store's
#: URL (user, host, database) or of the driver's reason, which only the server's log holds.
STORE_DOWN = "the store behind the server failed; try again later (the server's log says why)"


def status_of(exc: LabError) -> int:
    """The HTTP status of a `LabError` a route let through: what is missing is 404, a busy
    run 409, any other refusal 400 (a `StoreError` is a 503 of its own: `STORE_DOWN`)."""
    if isinstance(exc, NoExperiment | NoRun | NoToken):
        return 404
    if isinstance(exc, RunBusy):
        return 409
    return 400


def one_line(text: object) -> str:
    """The first line of `text`, credentials masked: what an error body may say."""
    lines = str(text).strip().splitlines()
    return mask(lines[0].strip()) if lines else ""


def store_failed(exc: BaseException) -> bool:
    """Whether `exc` says the store itself failed (it cannot be reached, read or written: a
    `StoreError`, a connection the driver lost or could not open), rather than that a request
    asked for something wrong."""
    if isinstance(exc, StoreError | sa.exc.OperationalError | sa.exc.InterfaceError):
        return True
    return isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated


class BodyRefused(HTTPException):
    """Raised out of `receive` at the first byte over the limit, or when the body stops
    arriving. An `HTTPException`, because FastAPI passes those through its body parsing
    unchanged (it turns any other error there into a 400); the app's handler answers it,
    and `BodyLimit` does if nothing else did. The connection is closed after: the rest of
    the body is never read."""

    def __init__(self, rejected: Rejected) -> None:
        super().__init__(rejected.status, rejected.detail)
        self.rejected = rejected


def answer(status: int, detail: str, field: str | None, **headers: str) -> Any:
    """The one shape of every rejection, as a response."""
    return JSONResponse({"detail": detail, "field": field}, status, headers=headers or None)


async def rejected(_request: Any, exc: Rejected) -> Any:
    return answer(exc.status, one_line(exc.detail), exc.field)


async def body_refused(_request: Any, exc: BodyRefused) -> Any:
    refused = exc.rejected
    return answer(refused.status, refused.detail, refused.field, connection="close")


async def http_error(request: Any, exc: HTTPException) -> Any:
    detail, field = exc.detail, getattr(exc, "field", None)
    headers = dict(exc.headers or {})
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"no endpoint {request.method} {request.url.path}; /openapi.json lists them"
    elif exc.status_code == 405:
        detail = f"{request.method} is not allowed on {request.url.path}"
        headers["Allow"] = ", ".join(request.app.state.methods.allowed(request.url.path))
    elif exc.status_code == 400 and detail == "There was an error parsing the body":
        detail, field = "the body is not JSON in UTF-8; send a JSON body", "body"
    return answer(exc.status_code, one_line(detail), field, **headers)


async def invalid(_request: Any, exc: RequestValidationError) -> Any:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ())]
    if first.get("type") == "json_invalid":
        why = (first.get("ctx") or {}).get("error", "")
        return answer(422, one_line(f"the body is not valid JSON ({why})"), "body")
    field = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return answer(422, one_line(f"{field}: {first.get('msg', 'invalid')}{more}"), field)


def store_down(request: Any, exc: BaseException) -> Any:
    """503 with `STORE_DOWN`, the outage noted (and logged once) in the app's `Outage`."""
    request.app.state.outage.failed(exc)
    return answer(503, STORE_DOWN, None)


async def lab_error(request: Any, exc: LabError) -> Any:
    if isinstance(exc, StoreError):  # its text names the store: the log alone says it
        return store_down(request, exc)
    return answer(status_of(exc), one_line(exc), getattr(exc, "field", None))


async def conflict(_request: Any, exc: sa.exc.IntegrityError) -> Any:
    why = one_line(exc.orig)
    return answer(409, f"the write conflicts with what the store holds: {why}", None)


async def bad_value(_request: Any, exc: sa.exc.DataError) -> Any:
    return answer(400, f"the store cannot hold a value of this request: "
                       f"{one_line(exc.orig)}", None)  # fmt: skip


async def driver_error(request: Any, exc: sa.exc.DBAPIError) -> Any:
    if not store_failed(exc):
        raise exc  # a bug: a 500, its traceback in the log
    return store_down(request, exc)


async def too_big(_request: Any, exc: OverflowError) -> Any:  # SQLite's 64-bit integers
    return answer(400, "a number in the request is out of the store's range (integers "
                       "hold 64 bits); send a smaller one", None)  # fmt: skip


async def bug(_request: Any, exc: Exception) -> Any:  # the traceback goes to the log
    return answer(500, f"internal error in lab serve ({type(exc).__name__}); the server's "
                       "log has the traceback", None)  # fmt: skip


#: What answers each kind of failure, most specific first (IntegrityError and DataError
#: before DBAPIError, every other exception last).
HANDLERS: tuple[tuple[type[BaseException], Any], ...] = (
    (Rejected, rejected),
    (BodyRefused, body_refused),
    (HTTPException, http_error),
    (RequestValidationError, invalid),
    (LabError, lab_error),
    (sa.exc.IntegrityError, conflict),
    (sa.exc.DataError, bad_value),
    (sa.exc.DBAPIError, driver_error),
    (OverflowError, too_big),
    (Exception, bug),
)


def add_handlers(app: Any) -> None:
    """Answer every failure in `app` in the one shape (see `HANDLERS`)."""
    for kind, handler in HANDLERS:
        app.add_exception_handler(kind, handler)
