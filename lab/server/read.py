"""The read API: experiments, runs, summaries, series, predictions, evals, checkpoints and
exports."""

from __future__ import annotations

import fastapi

router = fastapi.APIRouter(tags=["read"])
