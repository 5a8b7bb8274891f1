"""The FastAPI app `lab serve` runs: health, the write API (`lab.server.ingest`) and the read
API (`lab.server.read`), all under ``/api/v1``, every route but the health check behind a
bearer token (`lab.server.auth`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lab._imports import require
from lab.store import Store

#: The largest request body the server accepts unless told otherwise (``--max-body``).
MAX_BODY = 64 * 1024 * 1024
API = "/api/v1"


def create_app(store: Store | str, *, max_body: int = MAX_BODY) -> Any:
    """Build the app in front of `store` (a `Store`, or any store URL `lab` takes).

    Why a factory: tests and ``lab serve`` build one app per store, and importing FastAPI
    waits until a server is wanted.
    """
    require("fastapi", "server", "lab serve")
    import fastapi
    import fastapi.security

    from lab.server import ingest, read
    from lab.server.auth import token_scope
    from lab.store.migrations import head_revision

    the_store = store if isinstance(store, Store) else Store(store)
    app = fastapi.FastAPI(title="lab", summary="lab's tracking server", version="1")
    app.state.store = the_store
    app.state.max_body = max_body

    def scoped(scope: str) -> Callable[..., None]:
        """A dependency that lets a request through with a live token of `scope` (a write
        token reads too)."""
        bearer = fastapi.security.HTTPBearer(auto_error=False)

        def check(credentials: Any = fastapi.Depends(bearer)) -> None:
            if credentials is None or credentials.scheme.lower() != "bearer":
                raise fastapi.HTTPException(
                    401,
                    "this endpoint needs a token: Authorization: Bearer <token> (make one with "
                    "lab token create NAME --scope read|write)",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            have = token_scope(the_store.engine, credentials.credentials)
            if have is None:
                raise fastapi.HTTPException(
                    401, "the token is wrong or revoked", headers={"WWW-Authenticate": "Bearer"}
                )
            if scope == "write" and have != "write":
                raise fastapi.HTTPException(403, "a read token cannot write; use a write token")

        return check

    @app.get(f"{API}/health", tags=["health"])
    def health() -> dict[str, Any]:
        """Whether the server is up, and the store's schema revision (no token needed)."""
        return {"status": "ok", "schema": the_store.revision or head_revision()}

    app.include_router(ingest.router, prefix=API, dependencies=[fastapi.Depends(scoped("write"))])
    app.include_router(read.router, prefix=API, dependencies=[fastapi.Depends(scoped("read"))])

    @app.on_event("shutdown")
    def close() -> None:
        the_store.close()

    return app
