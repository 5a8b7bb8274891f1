"""The served OpenAPI document is true to the server: schemathesis runs every operation it
holds against a real `lab serve` (SQLite and PostgreSQL) with a write token, with all of
its checks, as a user runs it (``docs/serve.md``):

- no answer is a 5xx, and every answer's status, content type, headers and body are the
  ones the document declares for it (a rejection's body is ``{"detail", "field"}`` with a
  one-line detail, and a 422 names its field);
- every request the document calls valid is accepted (or answered 401, 403, 404 or 409),
  and every request it calls invalid is refused;
- a method the document does not list is answered 405 with the ``Allow`` the document
  lists, a request without the token 401, and what a create returns can be read back.

Its phases: the coverage phase's boundary cases (empty names, limits, missing fields,
wrong types), then `EXAMPLES` generated requests per operation and mode (valid and
invalid), then stateful sequences that feed what one answer returns into the next request.
A fixed seed, no shrinking: the run is the same each time, and takes about half a minute a
backend. The one check left out, and why: ``tests/schemathesis.toml``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests import warm
from tests.served import Served

ROOT = Path(__file__).resolve().parents[1]
#: The settings the run reads: the one check it leaves out, on the one operation.
SETTINGS = ROOT / "tests" / "schemathesis.toml"
#: Generated requests per operation and mode, besides the coverage phase's.
EXAMPLES = 10
SEED = 27


def test_every_check_of_schemathesis_holds_on_every_operation(
    served: Served, tmp_path: Path
) -> None:
    report = tmp_path / "report.json"
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(SETTINGS),
        "run", f"{served.url}/openapi.json",
        "-H", f"Authorization: Bearer {served.write_token}",
        "--max-examples", str(EXAMPLES), "--seed", str(SEED), "--no-shrink",
        "--workers", "1", "--request-timeout", "30", "--generation-database", "none",
        "--no-color", "--report", "json", "--report-json-path", str(report),
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",  # the Arrow body as bytes
    }
    done = warm.run(command, env=env, capture_output=True, text=True, timeout=600)
    shown = done.stdout[done.stdout.find("=== FAILURES") :][-20_000:] + done.stderr[-2_000:]
    assert report.exists(), shown
    result = json.loads(report.read_text())
    failures = {f["code"]: (f["title"], f["count"], f["operations"]) for f in result["failures"]}
    assert (failures, result["errors"]) == ({}, []), shown
    operations = result["operations"]
    assert operations["tested"] == operations["total"] >= 36 and not operations["errored"]
    ran = {name: phase["status"] for name, phase in result["phases"].items()}
    assert ran == {
        "examples": "skip",  # the document holds no examples
        "coverage": "success",
        "fuzzing": "success",
        "stateful": "success",
    }, ran
    assert done.returncode == 0, shown
