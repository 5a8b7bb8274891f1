"""JSON for what lab writes (store columns, run-folder files): NaN and inf kept as data.

JSON has no NaN or infinity. Python's `json` writes the tokens ``NaN`` and ``Infinity``
anyway, which strict parsers (jq, JavaScript, PostgreSQL's jsonb) reject or misread, so
every JSON document lab writes holds them as the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"``, and lab's readers turn those strings back into floats.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

#: The string each non-finite float is written as, and back.
NON_FINITE: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def finite_json(value: Any) -> Any:
    """`value` with every non-finite float (in dicts, lists and tuples) as its string."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def floats_back(values: Mapping[str, Any]) -> dict[str, Any]:
    """A flat mapping of metrics with the strings of `finite_json` turned back into floats."""
    return {k: NON_FINITE.get(v, v) if isinstance(v, str) else v for k, v in values.items()}
