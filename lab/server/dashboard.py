"""The dashboard's read API: the JSON the web UI (`lab.server.ui`) draws, under
``/api/v1/dashboard``, behind a read token like the rest of the read API."""

from __future__ import annotations

import fastapi

router = fastapi.APIRouter(tags=["dashboard"])
