"""The FastAPI app `lab serve` runs: health, the write API (`lab.server.ingest`) and the read
API (`lab.server.read`), all under ``/api/v1``, every route but the health check behind a
bearer token (`lab.server.auth`).

Every rejection has one shape, ``{"detail": "<one line>", "field": "<dotted name>" | null}``,
whatever raised it: a route's `Rejected`, a `LabError` from the store (the same checks and
messages as a local store), FastAPI's validation (422, reshaped to name the field), a body
over the limit (413, answered before the body is read whole) or a database that refuses a
write. Nothing a client sends can make a 500; a 500 is a bug, and says only that.

A store that fails (it cannot be reached, read or written) is a 503 with one fixed line,
`STORE_DOWN`, wherever it fails, the token check included: never the store's URL, host or
reason, which only the server's log holds, once per outage (`Outage`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import ssl
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from lab._imports import require
from lab._secrets import logger, register
from lab.errors import (
    ConfigError,
)
from lab.server.rejected import WRONG_TOKEN, Rejected
from lab.store import Store

require("fastapi", "server", "lab serve")  # before starlette, so a missing extra is one line

from starlette.routing import BaseRoute, Route  # noqa: E402

from lab.server.failures import (  # noqa: E402
    STORE_DOWN,
    BodyRefused,
    add_handlers,
    one_line,
    store_failed,
)

#: The largest request body the server accepts unless told otherwise (``--max-body``).
MAX_BODY = 64 * 1024 * 1024
API = "/api/v1"
#: The port `lab serve` listens on unless told otherwise.
PORT = 8765
#: How long a client may take to send a request's line and headers (``--timeout-header``).
HEADER_TIMEOUT_S = 10.0
#: The longest a request body may pause before it is answered 408 (``--timeout-body``).
BODY_TIMEOUT_S = 30.0
#: How long an idle kept-alive connection stays open (``--timeout-keep-alive``, uvicorn's 5).
KEEP_ALIVE_S = 5.0
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Outage:
    """The store's outages as the server meets them. Each is logged once, when a request (or
    the health check) first finds the store failing, with the reason (its password masked),
    and once when the store answers again; the requests in between are answered 503 with
    `STORE_DOWN` and log nothing, so an outage is two lines in the log, not a traceback per
    request."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        """Whether the store failed the last time the server asked it."""
        return self._since is not None

    def failed(self, exc: BaseException) -> None:
        """Note that the store failed with `exc` (logged if it answered until now)."""
        with self._lock:
            if self._since is not None:
                return
            self._since = time.monotonic()
        reason = one_line(getattr(exc, "orig", None) or exc) or type(exc).__name__
        logger("uvicorn.error").error(
            "lab serve: the store failed (%s); requests are answered 503 until it answers again",
            reason,
        )

    def answered(self) -> None:
        """Note that the store answered (logged if it had failed)."""
        if self._since is None:
            return
        with self._lock:
            if self._since is None:
                return
            took, self._since = time.monotonic() - self._since, None
        logger("uvicorn.error").warning("lab serve: the store answers again (after %.1f s)", took)


class _StoreDown(Exception):
    """The token check found the store failing (already noted in the `Outage`)."""


class BodyLimit:
    """Pure ASGI middleware: a request body over `max_body` bytes is answered 413 without
    being read whole. A declared Content-Length is checked before anything is read; a body
    without one (chunked) is counted as it arrives and refused at the first byte over.

    With `body_timeout`, a body that stops arriving (no byte for that many seconds while the
    app waits for it) is answered 408 and its connection closed, so a stalled client holds
    no request for ever."""

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        max_body: int,
        body_timeout: float | None = None,
    ) -> None:
        self.app, self.max_body, self.body_timeout = app, max_body, body_timeout

    def _too_large(self) -> Rejected:
        return Rejected(
            413,
            f"the request body is over the server's limit of {self.max_body} bytes; send "
            "smaller batches, or start the server with a larger --max-body",
            "body",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_json(send, 400, "the Content-Length header is not a number",
                                     "header.content-length")  # fmt: skip
                    return
                if declared > self.max_body:
                    await _send_rejected(send, self._too_large())
                    return
        seen = 0
        started = False
        done = False  # the whole body is in: what is received next is no body

        async def counted() -> Message:
            nonlocal seen, done
            if done or self.body_timeout is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), self.body_timeout)
                except TimeoutError:
                    raise BodyRefused(self._stalled()) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise BodyRefused(self._too_large())
                done = not message.get("more_body", False)
            else:
                done = True
            return message

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except BodyRefused as exc:
            if not started:
                await _send_rejected(send, exc.rejected)

    def _stalled(self) -> Rejected:
        return Rejected(
            408,
            f"the request body stopped arriving (nothing for {self.body_timeout:g} s, the "
            "server's --timeout-body); send the request again",
            "body",
        )


async def _send_json(
    send: Send, status: int, detail: str, field: str | None, *, challenge: bool = False
) -> None:
    """Answer a request from middleware, before the app has seen it; the connection is
    closed after, since the body was not read."""
    import json

    body = json.dumps({"detail": detail, "field": field}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if challenge:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_rejected(send: Send, rejected: Rejected) -> None:
    await _send_json(send, rejected.status, rejected.detail, rejected.field)


#: Paths that need no token: the health check and the API's description.
OPEN_PATHS = frozenset(
    {f"{API}/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
)
NO_TOKEN = (
    "no token: every endpoint but /api/v1/health needs Authorization: Bearer <token> (make "
    "one with lab token create NAME --scope read|write|admin)"
)


class TokenGate:
    """Pure ASGI middleware: a request to the API (anything under ``/api/`` but
    `OPEN_PATHS`) without a live token is answered 401 before its body is read or its route
    is looked up, so a client without a token learns nothing and costs nothing. The token
    (`lab.server.auth.Token`: name, scope, experiment) goes into the request's state
    (``request.state.token``) for the routes' scope and ownership checks.

    The token comes from the ``Authorization: Bearer`` header, or, for a GET or HEAD only,
    from the web UI's session cookie (`lab.server.ui.COOKIE`), which counts as a read token
    whatever its own scope: a browser session reads, it never writes. The UI's pages and
    static files need no token (the prompt must show); a page is told whether its cookie
    holds a live token, and only then looks names up in the store."""

    def __init__(
        self, app: Callable[..., Awaitable[None]], store: Store, outage: Outage | None = None
    ) -> None:
        self.app, self.store = app, store
        self.outage = outage or Outage()

    async def _find(self, token: str) -> Any:
        """The live token (`lab.server.auth.Token`: name, scope, experiment), or None;
        `_StoreDown` when the store fails (then the request is answered 503, as a route's
        would be)."""
        from starlette.concurrency import run_in_threadpool

        from lab.server.auth import find_token

        try:
            found = await run_in_threadpool(find_token, self.store.engine, token)
        except Exception as exc:
            if not store_failed(exc):
                raise
            self.outage.failed(exc)
            raise _StoreDown from None
        self.outage.answered()
        return found

    async def _cookie(self, scope: Scope) -> Any:
        """The live token of the session cookie, with the read scope; None for a cookie
        whose token is wrong or revoked; False when there is no cookie or the method may not
        use it."""
        from starlette.requests import cookie_parser

        from lab.server.ui import COOKIE

        if scope.get("method") not in ("GET", "HEAD"):
            return False
        token = ""
        for name, value in scope.get("headers", ()):
            if name == b"cookie":
                token = cookie_parser(value.decode("latin-1")).get(COOKIE, "") or token
        if not token.strip():
            return False
        found = await self._find(token.strip())
        return None if found is None else found._replace(scope="read")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            await self._gate(scope, receive, send)
        except _StoreDown:
            await _send_json(send, 503, STORE_DOWN, None)

    async def _gate(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if not path.startswith("/api/"):  # the UI: pages, /static, /ui/token
            if not path.startswith("/static/"):
                found = await self._cookie(scope)
                if found:
                    scope.setdefault("state", {})["token"] = found
            await self.app(scope, receive, send)
            return
        header = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
        kind, _, token = header.decode("latin-1").strip().partition(" ")
        if not header:
            session = await self._cookie(scope)
            if session is None:
                await _send_json(send, 401, WRONG_TOKEN, "cookie.lab_token")
                return
            if session:
                scope.setdefault("state", {})["token"] = session
                await self.app(scope, receive, send)
                return
        if kind.lower() != "bearer" or not token.strip():
            await _send_json(send, 401, NO_TOKEN, "header.authorization", challenge=True)
            return
        found = await self._find(token.strip())
        if found is None:
            await _send_json(send, 401, WRONG_TOKEN, "header.authorization", challenge=True)
            return
        scope.setdefault("state", {})["token"] = found
        await self.app(scope, receive, send)


#: The Host headers a server without tokens answers: its loopback names, with any port.
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost"})
LOCAL_ONLY = "lab ui answers only requests to 127.0.0.1 or localhost; open http://127.0.0.1:PORT/"


class LocalReader:
    """Pure ASGI middleware of a server without tokens (`lab ui`, on loopback only): every
    request reads as the token ``local`` with read scope.

    Only a request addressed to a loopback name (its Host header) is answered: a web page
    from elsewhere that rebinds its own domain name to 127.0.0.1 (DNS rebinding) sends its
    domain as the Host, and is refused before it can read a thing."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = ""
            for name, value in scope.get("headers", ()):
                if name == b"host":
                    host = value.decode("latin-1").strip().lower()
            if host.rsplit(":", 1)[0] not in LOCAL_HOSTS:
                await _send_json(send, 421, LOCAL_ONLY, "header.host")
                return
            from lab.server.auth import Token

            scope.setdefault("state", {})["token"] = Token("local", "read")
        await self.app(scope, receive, send)


def create_app(
    store: Store | str,
    *,
    max_body: int = MAX_BODY,
    auth: bool = True,
    writes: bool = True,
    body_timeout: float = BODY_TIMEOUT_S,
) -> Any:
    """Build the app in front of `store` (a `Store`, or any store URL `lab` takes).

    Why a factory: tests and ``lab serve`` build one app per store, and importing FastAPI
    waits until a server is wanted. `auth=False` lets every request read without a token
    and `writes=False` leaves the write API out: what `lab ui` serves on loopback.
    `body_timeout`: the longest a request body may pause (then 408).
    """
    import fastapi

    if not isinstance(max_body, int) or max_body < 1:
        raise ConfigError(f"max_body {max_body!r}: use a whole number of bytes >= 1")
    _check_seconds("body_timeout", body_timeout)
    the_store = store if isinstance(store, Store) else Store(store)
    if the_store.engine.url.password:  # masked wherever it might turn up: paths, errors, logs
        register(str(the_store.engine.url.password))

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        yield
        analysis = getattr(_app.state, "inspect", None)  # the dashboard's DuckDB, if opened
        if analysis is not None:
            analysis.close()
        the_store.close()

    app = fastapi.FastAPI(
        title="lab", summary="lab's tracking server", version="1", lifespan=lifespan
    )
    app.state.store = the_store
    app.state.max_body = max_body
    app.state.outage = outage = Outage()
    #: Whether an image recorded before the store kept image bytes is read from its run's
    #: folder: by `lab ui` alone (this machine's store, on loopback), never by `lab serve`.
    app.state.run_folders = not auth

    app.state.probed = 0.0  # when the health check may ask the store again
    add_handlers(app)
    _add_routes(app, auth=auth, writes=writes)
    app.add_middleware(BodyLimit, max_body=max_body, body_timeout=body_timeout)
    if auth:  # added last: the outermost, runs first
        app.add_middleware(TokenGate, store=the_store, outage=outage)
    else:
        app.add_middleware(LocalReader)
    return app


def _add_routes(app: Any, *, auth: bool, writes: bool) -> None:
    """Add every route to `app`: health, the token check, the write API (with `writes`),
    the read API, the dashboard's and the UI's pages, each router behind its scope and
    ownership checks; and note the methods at each path (what a 405 names)."""
    import fastapi

    from lab.server.dashboard import router as dashboard_api
    from lab.server.health import router as health_api
    from lab.server.health import token_router
    from lab.server.ingest import router as ingest_api
    from lab.server.openapi import problems, with_models
    from lab.server.ops import OpsBatch
    from lab.server.owners import checked, scoped
    from lab.server.read import router as read_api
    from lab.server.ui import mount as mount_ui

    # What any request past the token gate may be answered, whatever its route: no live
    # token (401; off loopback, 421, without tokens), a body that stalls (408) or is too
    # large (413), a store that fails (503).
    everywhere = (401 if auth else 421, 408, 413, 503)
    app.include_router(health_api, prefix=API)
    app.include_router(
        token_router,
        prefix=API,
        dependencies=[fastapi.Depends(scoped("read"))],
        responses=problems(*everywhere),
    )
    # Every route past the token gate may answer these; each route declares its own besides.
    answers = problems(*everywhere, 422)
    if writes:
        app.include_router(
            ingest_api,
            prefix=API,
            dependencies=checked("write"),
            responses={**answers, **problems(400, 403)},
        )
        with_models(app, OpsBatch)  # the ops batch: read within bounds, not by FastAPI
    app.include_router(read_api, prefix=API, dependencies=checked("read"), responses=answers)
    app.include_router(
        dashboard_api,
        prefix=f"{API}/dashboard",
        dependencies=checked("read"),
        responses=answers,
    )
    mount_ui(app, auth=auth)
    mounted = _answered(API, ingest_api.routes if writes else [])
    mounted += _answered(API, read_api.routes)
    mounted += _answered(f"{API}/dashboard", dashboard_api.routes)
    mounted += _answered("", app.router.routes)
    app.state.methods = Methods(mounted)


def _answered(prefix: str, routes: list[BaseRoute]) -> list[tuple[str, set[str]]]:
    """Each route's path under `prefix` with the methods it answers: a route of HTTP
    methods only (a mount, such as the UI's files, answers none of its own)."""
    return [(f"{prefix}{r.path}", r.methods) for r in routes if isinstance(r, Route) and r.methods]


class Methods:
    """Which methods the app answers at each of its routes' paths: what a 405 names in its
    ``Allow`` header. Two routes may share one path (``GET`` and ``POST`` of
    ``/api/v1/experiments``), so the header lists the methods of every route at the path
    of the first route the request's path matches, as the OpenAPI document lists them."""

    def __init__(self, routes: list[tuple[str, set[str]]]) -> None:
        from starlette.routing import compile_path

        self.routes = [(*compile_path(path)[:2], methods) for path, methods in routes]

    def allowed(self, path: str) -> list[str]:
        """The methods at the path `path` is at, sorted; none for a path of no route."""
        at = next((form for regex, form, _ in self.routes if regex.match(path)), None)
        found = (m for regex, form, methods in self.routes if form == at and regex.match(path)
                 for m in methods)  # fmt: skip
        return sorted(set(found))


def _check_seconds(option: str, seconds: float) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ConfigError(f"{option} {seconds!r}: give a number of seconds > 0")
    if seconds == float("inf"):
        raise ConfigError(f"{option} {seconds!r}: give a finite number of seconds")


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine (127.0.0.0/8, ::1,
    localhost)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def _check_tls(certfile: str | None, keyfile: str | None) -> None:
    """Load the certificate and key once before serving, so that a wrong file is one line
    here rather than a traceback out of uvicorn."""
    if certfile is None and keyfile is None:
        return
    if certfile is None or keyfile is None:
        raise ConfigError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
    for what, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if not Path(path).is_file():
            raise ConfigError(f"{what} {path}: no such file")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"--ssl-certfile {certfile} with --ssl-keyfile {keyfile}: not a PEM certificate "
            f"and its private key ({one_line(exc)})"
        ) from None


def _check_options(port: int, max_body: int, *timeouts: float) -> None:
    """`lab serve`'s port, largest body and timeouts (header, body, keep-alive), each
    refused with one line that names its option."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: use a TCP port from 0 to 65535")
    if max_body < 1:
        raise ConfigError(f"--max-body {max_body}: use a number of bytes >= 1")
    options = ("--timeout-header", "--timeout-body", "--timeout-keep-alive")
    for option, seconds in zip(options, timeouts, strict=True):
        _check_seconds(option, seconds)


def _served_app(url: Any, host: str, *, max_body: int, body_timeout: float) -> Any:
    """The app `lab serve` runs over the store at `url` (opened and migrated here): refused
    with one line when `host` is not loopback and the store holds no live token, so that
    the port never lets in someone the store cannot identify."""
    from lab.server.auth import has_live_token

    the_store = Store(url)
    try:
        if not is_loopback(host) and not has_live_token(the_store.engine):
            raise ConfigError(
                f"lab serve --host {host}: the store has no live token, so anyone who reaches "
                "the port could write; make one first: lab token create NAME --scope write "
                f"--store {url.shown}"
            )
        return create_app(the_store, max_body=max_body, body_timeout=body_timeout)
    except BaseException:
        the_store.close()
        raise


def serve(
    store: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = PORT,
    max_body: int = MAX_BODY,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    log_level: str = "info",
    timeout_header: float = HEADER_TIMEOUT_S,
    timeout_body: float = BODY_TIMEOUT_S,
    timeout_keep_alive: float = KEEP_ALIVE_S,
) -> None:
    """Run `lab serve` in this process until it is stopped (SIGINT, SIGTERM).

    Everything that can be wrong is checked before a port is bound: the store opens (and
    is migrated), the certificate loads, and an address other than loopback is bound only
    when the store holds a live token, so that the port never lets in someone the store
    cannot identify. The server's log lines go through `lab._secrets.mask`.

    A slow client holds a connection no longer than the timeouts allow: `timeout_header`
    seconds to send a request's line and headers, pauses of at most `timeout_body` seconds
    inside its body (then 408), and `timeout_keep_alive` seconds idle between requests.
    """
    require("uvicorn", "server", "lab serve")
    import uvicorn

    from lab.server.timeouts import with_header_timeout
    from lab.store.engine import resolve_url

    _check_options(port, max_body, timeout_header, timeout_body, timeout_keep_alive)
    url = resolve_url(store)
    if url.backend not in ("sqlite", "postgresql"):
        raise ConfigError(
            f"lab serve --store {url.shown}: the server fronts a database; give it a "
            "sqlite:/// or postgresql:// URL"
        )
    _check_tls(ssl_certfile, ssl_keyfile)
    app = _served_app(url, host, max_body=max_body, body_timeout=timeout_body)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        server_header=False,
        http=with_header_timeout(timeout_header),
        timeout_keep_alive=timeout_keep_alive,  # type: ignore[arg-type]  # a float works
    )
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger(name)  # lab's masking filter on each: a filter does not reach children
    scheme = "https" if ssl_certfile else "http"
    where = f"[{host}]" if ":" in host else host
    print(
        f"lab serve: {url.shown} at {scheme}://{where}:{port} (bodies up to {max_body} bytes)",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.Server(config).run()


#: The port `lab ui` listens on unless told otherwise (one above `lab serve`'s, so both run).
UI_PORT = PORT + 1


def serve_ui(
    store: str | None = None,
    *,
    port: int = UI_PORT,
    open_browser: bool = True,
    log_level: str = "warning",
) -> None:
    """Run `lab ui`: the dashboard over `store`, on 127.0.0.1 only, until it is stopped.

    The store is opened read-only (as ``lab show`` opens it: nothing is written, a dead
    run reads as crashed), without the write API and without tokens, which is safe only
    because nobody but this machine's users can reach loopback. With `open_browser`, the
    default browser opens the page once the server answers.
    """
    require("uvicorn", "server", "lab ui")
    import threading
    import time
    import webbrowser

    import uvicorn

    from lab.store.engine import resolve_url

    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: use a TCP port from 0 to 65535")
    url = resolve_url(store)
    if url.backend not in ("sqlite", "postgresql"):
        raise ConfigError(
            f"lab ui --store {url.shown}: the dashboard reads a database; give it a "
            "sqlite:/// or postgresql:// URL (a lab serve server has the dashboard at its /)"
        )
    the_store = Store(url, readonly=True)
    try:
        app = create_app(the_store, auth=False, writes=False)
    except BaseException:
        the_store.close()
        raise
    from lab.server.timeouts import with_header_timeout

    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level=log_level, server_header=False,
        http=with_header_timeout(HEADER_TIMEOUT_S),
    )  # fmt: skip
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger(name)
    server = uvicorn.Server(config)
    page = f"http://127.0.0.1:{port}/"

    def open_when_up() -> None:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            webbrowser.open(page)

    print(f"lab ui: {url.shown} at {page} (read-only, this machine only)", file=sys.stderr,
          flush=True)  # fmt: skip
    if open_browser:
        threading.Thread(target=open_when_up, daemon=True).start()
    server.run()
