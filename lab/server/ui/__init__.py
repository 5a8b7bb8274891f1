"""The web UI that `lab serve` serves at ``/`` (and `lab ui` locally): pages, static files
and the read-token prompt. It draws what the dashboard API (`lab.server.dashboard`) returns."""

from __future__ import annotations

from typing import Any


def mount(app: Any) -> None:
    """Add the UI's pages and static files to `app`."""
