"""`lab serve`: a tracking server over HTTP in front of any store `lab` takes.

Jobs log to one endpoint with a token instead of reaching the database with its password;
notebooks read back through the same endpoint. `create_app` builds the FastAPI app that
``lab serve`` runs on uvicorn. FastAPI and uvicorn come with the ``server`` extra.
"""

from __future__ import annotations

from lab.server.app import create_app

__all__ = ["create_app"]
