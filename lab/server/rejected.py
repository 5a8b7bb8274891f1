"""`Rejected`: a request the server refuses, as every route and the app answer it.

It stands below the app and its routes (`lab.server.app` answers it, `lab.server.ingest`,
`lab.server.read` and the dashboard raise it), so the routes never import the app back.
"""

from __future__ import annotations

#: The one line a 401 says for a token the store does not know or has revoked.
WRONG_TOKEN = "the token is wrong or revoked"


class Rejected(Exception):
    """A request the server refuses: its HTTP `status`, the one line `detail` that says what
    is wrong and what to do, and the dotted name of the offending `field` (or None). Routes
    raise it; the app answers it as ``{"detail": ..., "field": ...}``."""

    def __init__(self, status: int, detail: str, field: str | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.field = status, detail, field
