"""Hooks for the schemathesis run of ``tests/test_serve_fuzz.py`` (its ``SCHEMATHESIS_HOOKS``).

A metrics batch's body is an Arrow IPC stream, which no JSON schema can describe, so
schemathesis has no way to make one: it sends the bytes it makes for a binary string, which
the server must refuse cleanly (``tests/schemathesis.toml`` says why the one check that a
valid body is accepted is left out there)."""

from __future__ import annotations

import schemathesis

schemathesis.serializer.alias("application/vnd.apache.arrow.stream", "application/octet-stream")
