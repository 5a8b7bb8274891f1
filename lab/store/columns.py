"""The store's tables as readers that copy them see them (`lab.inspect`, `lab.export`): the
names of an experiment's tables (`TABLES`), the base whose ``metadata`` holds
each table's columns and keys (`Base`), and the columns a copy of a table takes
(`copied_columns`). Table descriptions only: no row object leaves the store through here."""

from __future__ import annotations

from lab.store.schema import Base as Base
from lab.store.schema import copied_columns as copied_columns
from lab.store.tables import TABLES as TABLES

__all__ = ["TABLES", "Base", "copied_columns"]
