"""How long a slow client may hold a connection of `lab serve`.

uvicorn closes a connection that stays idle between two requests (``timeout_keep_alive``),
but it has no limit on how long a client may take to send a request: its keep-alive timer
is disarmed by the first byte that arrives, so a client that connects and sends nothing,
or sends its headers a byte at a time, holds the connection (and a file handle) for ever.
An ASGI middleware cannot help there, since the app is called only once the headers are in.

So the server runs uvicorn's own HTTP/1.1 protocol (h11) with a deadline for the request's
head: a connection whose request line and headers have not all arrived `header_timeout`
seconds after it opened (or, on a kept-alive connection, after the first byte of its next
request) is closed. Once the head is in, the deadline is gone: a long body is bounded by
its own pauses (`lab.server.app.BodyLimit`), a slow answer by nothing here.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def with_header_timeout(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head takes longer than
    `seconds` to arrive (see the module's text); give it to ``uvicorn.Config(http=...)``."""

    class HeaderDeadline(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._watch_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

        def _waiting_for_head(self) -> bool:
            return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

        def _watch_head(self) -> None:
            """Arm the deadline while a request's head is awaited (from the connection's
            start, or from the first byte of a kept-alive connection's next request, the
            idle wait before it being the keep-alive timer's), disarm it once it is in."""
            if not self._waiting_for_head():
                self._stop_head_timer()
            elif self._head_timer is None and (self.timeout_keep_alive_task is None):
                self._head_timer = self.loop.call_later(seconds, self._head_expired)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if self._waiting_for_head():
                self.transport.close()

    HeaderDeadline.__qualname__ = HeaderDeadline.__name__ = "HeaderDeadline"
    return HeaderDeadline
