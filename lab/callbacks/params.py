"""Parameter types for callback signatures: the constraint is written once, in the signature.

A registered callback's ``__init__`` annotations are its only statement of what a valid
parameter is: `lab.callbacks.register` builds the pydantic Config from them and checks every
call against it, from Python and from YAML alike. These aliases carry the usual constraints::

    @register("my_monitor")
    class MyMonitor(Callback):
        def __init__(self, every: PositiveInt = 10, threshold: PositiveFloat = 3.0) -> None:
            self.every, self.threshold = every, threshold

Ints are strict (``True`` and ``2.0`` are not counts); numbers accept ints and numeric
strings, so YAML 1.1's ``1e-3`` (a string to PyYAML) reads as 0.001, but not ``true``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import annotated_types as at
import pydantic

__all__ = ["FileName", "NonEmptyStr", "NonNegativeFloat", "NonNegativeInt", "PositiveFloat",
           "PositiveInt"]  # fmt: skip


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"use a number, not {value!r}")
    return value


def _file_name(value: str) -> str:
    if not value or Path(value).name != value:
        raise ValueError("give a file name, not a path")
    return value


#: An int >= 1 (a count, a period in steps).
PositiveInt = Annotated[int, pydantic.Strict(), at.Ge(1)]
#: An int >= 0.
NonNegativeInt = Annotated[int, pydantic.Strict(), at.Ge(0)]
#: A number > 0 (NaN is not).
PositiveFloat = Annotated[float, pydantic.BeforeValidator(_no_bool), at.Gt(0)]
#: A number >= 0 (NaN is not).
NonNegativeFloat = Annotated[float, pydantic.BeforeValidator(_no_bool), at.Ge(0)]
#: A string with at least one character.
NonEmptyStr = Annotated[str, at.MinLen(1)]
#: A bare file name (no folder), written inside the run folder.
FileName = Annotated[str, pydantic.AfterValidator(_file_name)]
