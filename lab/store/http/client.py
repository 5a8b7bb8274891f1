"""The base of `HttpStore`: one keep-alive httpx client to a `lab serve` server.

`HttpClient` opens the connection the way `Store` opens a database: it asks the server
first (its write check, which names the schema, or its health check), so an unreachable
server, a server with a newer schema, or a token the server refuses stops an experiment
before anything runs, with one line each. Every call
goes through `_request`, which adds the bearer token, maps the server's answers onto `lab`'s
errors, and retries with a capped exponential backoff (for up to the retry window) the calls
that may be sent twice. The token is never printed: it lives in one header only.
"""

from __future__ import annotations

import os
import ssl
import time
from typing import Any

import httpx

from lab._env import seconds_from_env
from lab._secrets import mask
from lab.errors import (
    ConfigError,
    NoExperiment,
    RunBusy,
    SchemaTooNew,
    ServerRejected,
    StoreError,
    StoreUnreachable,
    TokenRejected,
)
from lab.store.engine import HTTP_SCHEMES, StoreURL, resolve_url

API = "/api/v1"
DEFAULT_RETRY_S = 30.0
#: Answers worth another try: the server (or a proxy in front of it) is restarting.
_RETRY_STATUS = frozenset({408, 429, 502, 503, 504})
_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 2.0


def retry_window() -> float:
    """How long a call keeps retrying an unreachable server: ``LAB_HTTP_RETRY_S``, else 30 s.

    Past it a synchronous call raises `StoreUnreachable`, and the background sender spools
    its batches to the run folder instead (see `lab.store.http.sender`).
    """
    return seconds_from_env("LAB_HTTP_RETRY_S", DEFAULT_RETRY_S, ConfigError)


def _tls(url: StoreURL) -> ssl.SSLContext | bool:
    """What checks the server's certificate: httpx's default (its CA bundle) for an https
    URL; for a plain http one, a context that is never used and loads no CA, since loading
    them is most of what opening a client costs (about 35 ms, 170 ms the first time).
    Were it ever used, it would refuse every certificate."""
    if url.backend == "https":
        return True
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


class HttpClient:
    """A connection to a `lab serve` server at `url` (``http(s)://host:port``).

    `token`: the bearer token, else ``LAB_TOKEN``. `retry_s`: the retry window (else
    ``LAB_HTTP_RETRY_S``, else 30 s). Opening it checks the token and the server's schema;
    `scope` is then ``"write"`` or ``"read"`` (what the token may do), and `ops` the
    operations the server's ops batches take.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        retry_s: float | None = None,
    ) -> None:
        self.url: StoreURL = resolve_url(url)
        if self.url.backend not in HTTP_SCHEMES:
            raise ConfigError(
                f"{self.url.shown} is not a lab serve URL; use http(s)://host:port, or "
                "lab.store.Store for a SQL store"
            )
        self._token = token if token is not None else (os.environ.get("LAB_TOKEN") or None)
        self.retry_s = retry_window() if retry_s is None else retry_s
        headers = {"User-Agent": "lab"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        self._http = httpx.Client(
            base_url=f"{self.url}{API}",
            headers=headers,
            timeout=timeout,
            limits=httpx.Limits(max_keepalive_connections=4, keepalive_expiry=60.0),
            verify=_tls(self.url),
        )
        #: The server's schema revision (its health check says it).
        self.revision: str | None = None
        #: What the token may do: "write" or "read".
        self.scope: str = "read"
        #: The operations the server's ops batches take (its write check says them); empty
        #: for a server from before they were named: then only what every server takes.
        self.ops: frozenset[str] = frozenset()
        try:
            self._open()
        except BaseException:
            self._http.close()
            raise

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url.shown!r})"

    def _open(self) -> None:
        """One request when the token writes: the write check, whose answer names the
        schema and the operations the server takes. The health check is asked only for
        what that answer does not say (no token, a read token, a server from before)."""
        from lab.store.migrations import head_revision, is_known

        window = min(self.retry_s, 3.0)
        checked: dict[str, Any] = {}
        if self._token:
            answer = self._request("GET", "/batches/check", window_s=window, allow=(403,))
            self.scope = "write" if answer.status_code == 200 else "read"
            checked = answer.json() if self.scope == "write" else {}
            self.ops = frozenset(checked.get("ops") or ())
        if not checked.get("schema"):
            checked = self._request("GET", "/health", window_s=window).json()
        self.revision = str(checked.get("schema") or "")
        if not is_known(self.revision):
            raise SchemaTooNew(
                f"lab serve at {self.url.shown} is at schema revision {self.revision}, newer "
                f"than this lab knows ({head_revision()}); upgrade lab: pip install -U lab"
            )
        if not self._token:
            raise TokenRejected(
                f"lab serve at {self.url.shown} needs a token: set LAB_TOKEN (make one on the "
                "server's store with: lab token create NAME --scope write)"
            )

    # -- the one door to the server ------------------------------------------------------
    def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        retry: bool | None = None,
        allow: tuple[int, ...] = (),
        window_s: float | None = None,
    ) -> httpx.Response:
        """Send one request; returns the 2xx answer (or one whose status is in `allow`).

        `retry`: whether the call may be sent twice (default: GET yes, others no). A call
        that may is retried, with a capped exponential backoff, on a connection failure, a
        timeout and 408/429/502/503/504, for up to `window_s` (default the retry window);
        one that may not is retried only when the connection failed before it was sent.
        Then: `StoreUnreachable`, for a server that does not answer as for one that answers
        that it cannot take the call now (503: its store is down). A 4xx answer becomes
        `lab`'s error for it (401/403 `TokenRejected`, 400 `ConfigError`, 404 `NoExperiment`,
        409 `RunBusy`, others `ServerRejected`), with the server's one line.
        """
        retry = method == "GET" if retry is None else retry
        window = self.retry_s if window_s is None else window_s
        deadline = time.monotonic() + window
        delay = _BACKOFF_S
        while True:
            try:
                answer = self._http.request(
                    method, path, json=json, content=content, params=params, headers=headers
                )
            except httpx.TransportError as exc:
                sent = not isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
                if (sent and not retry) or time.monotonic() + delay > deadline:
                    raise self._unreachable(exc) from None
            else:
                status = answer.status_code
                if status < 300 or status in allow:
                    return answer
                if not (retry and status in _RETRY_STATUS) or time.monotonic() + delay > deadline:
                    raise self._refused(answer, time.monotonic() - deadline + window)
            time.sleep(delay)
            delay = min(delay * 2, _MAX_BACKOFF_S)

    def _unreachable(self, exc: BaseException) -> StoreUnreachable:
        return StoreUnreachable(
            f"lab serve at {self.url.shown} did not answer ({mask(str(exc)) or type(exc).__name__}"
            f"); start it (lab serve --store URL) or check the URL and the network"
        )

    def _refused(
        self, answer: httpx.Response, waited: float = 0.0
    ) -> StoreError | ConfigError | NoExperiment | RunBusy:
        """`lab`'s error for an answer that is not a success, after `waited` seconds; its
        `status` attribute is the answer's HTTP status."""
        error = self._error_for(answer, waited)
        error.status = answer.status_code  # type: ignore[union-attr]  # an attribute of its own
        return error

    def _error_for(
        self, answer: httpx.Response, waited: float
    ) -> StoreError | ConfigError | NoExperiment | RunBusy:
        status = answer.status_code
        try:
            body = answer.json()
            detail = str(body.get("detail")) if isinstance(body, dict) else str(body)
        except ValueError:
            detail = answer.text.strip().splitlines()[0] if answer.text.strip() else ""
        detail = mask(detail)
        where = f"lab serve at {self.url.shown}"
        if status == 401:
            return TokenRejected(
                f"{where} refused the token in LAB_TOKEN: it is wrong or revoked; make one "
                "with lab token create NAME --scope write on the server's store"
            )
        if status == 403:
            return TokenRejected(f"{where}: {detail or 'this token may not do that'}")
        if status == 400:
            return ConfigError(detail)
        if status == 404:
            return NoExperiment(detail or f"{where} knows no such record")
        if status == 409:
            return RunBusy(detail)
        if status in _RETRY_STATUS:  # the server is there, and cannot take it now
            how_long = f" for {waited:.1f}s (LAB_HTTP_RETRY_S)" if waited >= 0.05 else ""
            return StoreUnreachable(
                f"{where} answered {status}{how_long}: {detail or 'try again later'}"
            )
        if status == 413:
            return ServerRejected(f"{where} refused a body over its limit: {detail}")
        if status < 500:
            return ServerRejected(f"{where} refused a request ({status}): {detail}")
        return StoreError(f"{where} failed ({status}): {detail}; see the server's log")

    def close(self) -> None:
        """Release the connection."""
        self._http.close()
