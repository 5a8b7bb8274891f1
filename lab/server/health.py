"""The two routes a client asks before anything else: the health check (no token needed),
and which token a request carries (``GET /api/v1/token``)."""

from __future__ import annotations

import time
from typing import Any, Literal

import fastapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.requests import Request

from lab.server.failures import store_failed
from lab.server.openapi import problems

router = fastapi.APIRouter(tags=["health"])
#: ``GET /token``: included behind the read scope's check (`lab.server.owners.scoped`).
token_router = fastapi.APIRouter(tags=["health"])


class Health(BaseModel):
    """The health check's answer: whether the server is up and its store answers."""

    status: Literal["ok", "degraded"]
    store: Literal["ok", "unreachable"]
    schema_: str = Field(alias="schema", description="the store's schema revision")


class TokenInfo(BaseModel):
    """The name and scope of the token a request carries, and the one experiment it is
    limited to (null: none)."""

    name: str
    scope: Literal["read", "write", "admin"]
    experiment: str | None


@router.get(
    "/health",
    response_model=Health,
    responses={
        503: {"model": Health, "description": "The server is up and its store fails"},
        **problems(408, 413),
    },
)
def health(request: Request) -> Any:
    """Whether the server is up and its store answers, and the store's schema revision
    (no token needed): ``status`` ok or degraded, ``store`` ok or unreachable (then 503).
    The store is asked at most once a second; between, the last answer stands."""
    from lab.store.engine import check_reachable
    from lab.store.migrations import head_revision

    state = request.app.state
    if time.monotonic() >= state.probed:
        state.probed = time.monotonic() + 1.0
        try:
            check_reachable(state.store.engine)
        except Exception as exc:
            if not store_failed(exc):
                raise
            state.outage.failed(exc)
        else:
            state.outage.answered()
    schema = state.store.revision or head_revision()
    if state.outage.down:
        body = {"status": "degraded", "store": "unreachable", "schema": schema}
        return JSONResponse(body, 503)
    return {"status": "ok", "store": "ok", "schema": schema}


@token_router.get("/token")
def whoami(request: Request) -> TokenInfo:
    """The name and scope of the token this request carries, and the one experiment it
    is limited to (null: none): how a client checks its token (and whether it may write)
    before it sends anything."""
    token = request.state.token
    return TokenInfo(name=token.name, scope=token.scope, experiment=token.experiment)
