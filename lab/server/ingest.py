"""The write API: everything `SqlLogger` writes, as `Store`'s write methods take it."""

from __future__ import annotations

import fastapi

router = fastapi.APIRouter(tags=["write"])
