"""The web UI that `lab serve` serves at ``/`` (and `lab ui` locally): pages, static files
and the read-token prompt. It draws what the dashboard API (`lab.server.dashboard`) returns.

Every page is the same HTML shell (``static/index.html``); ``static/app.js`` reads the URL
and builds the page from the API's JSON with ``textContent`` only, so no stored name,
config or prediction can become markup. The pages and ``/static`` need no token, so that
the prompt can show: a page request tells the shell only whether its session holds a live
token. When it does, an experiment, run or metric in the URL that the store does not hold
is answered here with an HTML 404 page that links back to ``/``.

Tokens in the browser: the prompt POSTs a read (or write) token to ``/ui/token``, which
checks it and keeps it in an ``HttpOnly; SameSite=Strict`` session cookie; the token gate
(`lab.server.app.TokenGate`) accepts that cookie for GET and HEAD only, with read scope
whatever the token's own, so a browser session never writes. ``/ui/logout`` drops it.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request

#: The folder ``/static`` serves: the shell, app.js, app.css and the vendored uPlot.
STATIC = Path(__file__).resolve().parent / "static"
#: The session cookie that holds the token the prompt was given.
COOKIE = "lab_token"
#: What a page may load and run: its own scripts and styles, images from the server, nothing
#: inline, nothing from elsewhere (the charts set styles through the CSSOM, which it allows).
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'; form-action 'self'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def signed_in(request: Any) -> bool:
    """Whether this request holds a live token (the session cookie, or no tokens at all with
    `lab ui`): only then are names in a page URL looked up in the store."""
    state = request.scope.get("state") or {}
    return state.get("token") is not None


def not_found_page(what: str) -> Any:
    """The HTML 404 page: one line naming what is missing (escaped), and a link back."""
    from fastapi.responses import HTMLResponse

    text = html.escape(what)
    body = (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="icon" href="data:,"><title>Not found · lab</title>'
        '<link rel="stylesheet" href="/static/app.css"></head>\n'
        '<body><header class="top"><a class="brand" href="/">lab</a></header>'
        f'<main id="main"><section class="notfound"><h1>Not found</h1><p id="notfound-detail">'
        f'{text}</p><p><a id="back" href="/">Back to the experiments</a></p></section></main>'
        "</body></html>\n"
    )
    return HTMLResponse(body, 404, headers=HEADERS)


def _has(request: Any, lookup: Callable[..., bool], *args: Any) -> bool:
    """What `lookup` (one of `lab.store.served_reads`) answers on a connection to the
    request's store."""
    from lab.server.read import store_of
    from lab.store.engine import connect

    with connect(store_of(request).engine) as conn:
        return lookup(conn, *args)


def _missing_experiment(request: Any, name: str) -> str | None:
    from lab.store.served_reads import has_experiment

    found = _has(request, has_experiment, name)
    return None if found else f"no experiment named {name!r} in this store"


def _missing_metric(request: Any, name: str, key: str) -> str | None:
    from lab.store.served_reads import has_metric

    found = _has(request, has_metric, name, key)
    return None if found else f"experiment {name!r} has no metric {key!r}"


def _missing_run(request: Any, run_id: str) -> str | None:
    from lab.store.served_reads import has_run

    if not run_id.isascii() or not run_id.isdigit() or len(run_id) > 18:
        return f"no run with id {run_id!r}: run ids are whole numbers"
    found = _has(request, has_run, int(run_id))
    return None if found else f"no run with id {run_id} in this store"


def mount(app: Any, *, auth: bool = True) -> None:
    """Add the UI's pages, its static files and (with `auth`) the token cookie's two routes
    to `app`. The pages are left out of the OpenAPI schema: they are not API."""
    from starlette.staticfiles import StaticFiles

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    _add_pages(app, auth=auth)
    if auth:
        _add_token_routes(app)


def _add_pages(app: Any, *, auth: bool) -> None:
    """The pages: the same shell each, or an HTML 404 for a name the store lacks when the
    request holds a live token."""
    from fastapi.responses import HTMLResponse

    shell = (STATIC / "index.html").read_text(encoding="utf-8")
    page = {"methods": ["GET", "HEAD"], "include_in_schema": False}

    def shell_page(request: Request) -> Any:
        filled = shell.replace("{{auth}}", "1" if auth else "0").replace(
            "{{signed_in}}", "1" if signed_in(request) else "0"
        )
        return HTMLResponse(filled, headers=HEADERS)

    @app.api_route("/", **page)
    def experiments_page(request: Request) -> Any:
        return shell_page(request)

    @app.api_route("/experiments/{name:path}/predictions", **page)
    @app.api_route("/experiments/{name:path}/sweep", **page)
    def experiment_subpage(request: Request, name: str) -> Any:
        if signed_in(request):
            missing = _missing_experiment(request, name)
            if missing:
                return not_found_page(missing)
        return shell_page(request)

    @app.api_route("/experiments/{name:path}", **page)
    def experiment_page(request: Request, name: str) -> Any:
        if signed_in(request):
            metric = request.query_params.get("metric")
            missing = _missing_experiment(request, name)
            if missing is None and metric:
                missing = _missing_metric(request, name, metric)
            if missing:
                return not_found_page(missing)
        return shell_page(request)

    @app.api_route("/runs/{run_id}", **page)
    def run_page(request: Request, run_id: str) -> Any:
        if signed_in(request):
            missing = _missing_run(request, run_id)
            if missing:
                return not_found_page(missing)
        return shell_page(request)


def _add_token_routes(app: Any) -> None:
    """``/ui/token`` (a token into the session cookie) and ``/ui/logout`` (dropped)."""
    from fastapi.responses import JSONResponse, Response

    @app.post("/ui/token", include_in_schema=False)
    async def sign_in(request: Request) -> Any:
        from starlette.concurrency import run_in_threadpool

        from lab.server.auth import find_token
        from lab.server.rejected import WRONG_TOKEN, Rejected

        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            raise Rejected(415, 'send the token as JSON: {"token": "lab_..."}', "body")
        try:
            body = await request.json()
        except ValueError:
            body = None
        token = body.get("token") if isinstance(body, dict) else None
        if not isinstance(token, str) or not token.strip() or len(token) > 200:
            raise Rejected(400, 'send the token as JSON: {"token": "lab_..."}', "token")
        found = await run_in_threadpool(find_token, app.state.store.engine, token.strip())
        if found is None:
            raise Rejected(401, WRONG_TOKEN, "token")
        answer = JSONResponse({"name": found[0], "scope": "read"}, headers=HEADERS)
        answer.set_cookie(
            COOKIE,
            token.strip(),
            httponly=True,
            samesite="strict",
            path="/",
            secure=request.url.scheme == "https",
        )
        return answer

    @app.post("/ui/logout", include_in_schema=False)
    def sign_out(request: Request) -> Any:
        answer = Response(status_code=204, headers=HEADERS)
        answer.delete_cookie(
            COOKIE, path="/", httponly=True, samesite="strict",
            secure=request.url.scheme == "https",
        )  # fmt: skip
        return answer
