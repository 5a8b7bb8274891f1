"""schemathesis fuzzes every operation of the served OpenAPI schema, whatever routes it holds,
against a real `lab serve` (SQLite and PostgreSQL) with a write token: no answer is a 5xx, and
every rejection is a 4xx whose JSON body is ``{"detail": ..., "field": ...}`` (a 422
names its field).

Bounded: 25 examples per operation and mode, no shrinking, no deadline per
example (a request to a real server takes what it takes)."""

from __future__ import annotations

import contextlib
from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.served import Served

# An Arrow body is fuzzed as raw bytes: whatever schemathesis makes must be refused cleanly.
schemathesis.serializer.alias("application/vnd.apache.arrow.stream", "application/octet-stream")

#: examples per operation; with the merged API this keeps the file under about 90 s
EXAMPLES = 25


def _check(case: Any, token: str, failures: list[str]) -> None:
    answer = case.call(headers={"Authorization": f"Bearer {token}"}, timeout=30)
    failures.append("")  # one per request sent: the test counts them
    text = answer.content[:300].decode("utf-8", "replace")  # an export's body is binary
    where = f"{case.method} {case.formatted_path} -> {answer.status_code}: {text}"
    if answer.status_code >= 500:
        failures.append(where)
    elif answer.status_code >= 400:
        try:
            body = answer.json()
        except ValueError:
            body = None
        kind = answer.headers.get("content-type") or [""]  # schemathesis: a list per header
        json_type = (kind if isinstance(kind, str) else kind[0]).startswith("application/json")
        if not (
            json_type
            and isinstance(body, dict)
            and set(body) == {"detail", "field"}
            and isinstance(body["detail"], str)
            and body["detail"]
            and (body["field"] is None or isinstance(body["field"], str))
            and (answer.status_code != 422 or body["field"])  # a violation names its field
        ):
            failures.append(where)


def test_no_input_makes_a_server_error_and_every_rejection_names_its_field(
    served: Served,
) -> None:
    """Each operation: valid and schema-violating requests (schemathesis' positive and
    negative modes), `EXAMPLES` of each at most; all failures are listed at once."""
    schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json", timeout=30)
    auth = {"Authorization": f"Bearer {served.write_token}"}
    failures: list[str] = []
    fuzzed = []
    for result in schema.get_all_operations():
        operation = result.ok()
        fuzzed.append(f"{operation.method.upper()} {operation.path}")
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = operation.as_strategy(mode, headers=auth)

            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
                database=None,
            )
            @given(case=strategy)
            def fuzz(case: Any) -> None:
                _check(case, served.write_token, failures)

            with contextlib.suppress(Unsatisfiable):  # no input violates a schema without any
                fuzz()
    assert "GET /api/v1/token" in fuzzed and "GET /api/v1/health" in fuzzed
    sent = failures.count("")
    assert sent >= len(fuzzed)  # every operation was called
    bad = sorted({f for f in failures if f})
    assert bad == [], f"{len(bad)} bad answers of {sent}:\n" + "\n".join(bad)
