"""The server's frame: a health check without a token, every other route behind one."""

from __future__ import annotations

from tests.served import Served


def test_health_needs_no_token_and_names_the_schema(module_served: Served) -> None:
    import httpx

    from lab.store.migrations import head_revision

    answer = httpx.get(f"{module_served.url}/api/v1/health")
    assert answer.status_code == 200
    assert answer.json() == {"status": "ok", "store": "ok", "schema": head_revision()}


def test_the_openapi_schema_is_served(module_served: Served) -> None:
    import httpx

    schema = httpx.get(f"{module_served.url}/openapi.json").json()
    assert schema["info"]["title"] == "lab"
    assert "/api/v1/health" in schema["paths"]
