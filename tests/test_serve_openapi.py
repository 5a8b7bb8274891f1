"""What `/openapi.json` declares, a real `lab serve` does (SQLite and PostgreSQL): the
server's side of the cases schemathesis found where the two disagreed
(``tests/test_serve_fuzz.py`` holds the whole document to the server)."""

from __future__ import annotations

import base64
import io
import struct
from typing import Any

import httpx
import pyarrow as pa
import sqlalchemy as sa

from lab.media import write_image
from tests.served import Served

API = "/api/v1"


def _recorded(http: httpx.Client, name: str = "doc") -> tuple[int, int, int]:
    """A new experiment with one group and one running run: their ids."""
    exp = http.post(f"{API}/experiments", json={"name": name}).json()["experiment_id"]
    group = http.post(f"{API}/experiments/{exp}/groups", json={"name": "g"}).json()["group_id"]
    run = http.post(f"{API}/experiments/{exp}/runs", json={"group_id": group, "run_key": "r0"})
    return exp, group, run.json()["run_id"]


def _metrics(http: httpx.Client, run_id: int, steps: list[int]) -> None:
    table = pa.table({
        "run_id": pa.array([run_id] * len(steps), pa.int64()),
        "step": pa.array(steps, pa.int64()),
        "key": pa.array(["loss"] * len(steps), pa.string()),
        "value": pa.array([float(s) for s in steps], pa.float64()),
    })  # fmt: skip
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    headers = {"X-Lab-Client": "doc", "X-Lab-Seq": "1"}
    answer = http.post(f"{API}/batches/metrics", content=sink.getvalue(), headers=headers)
    assert answer.status_code == 200, answer.text


def _steps(url: str, run_id: int) -> list[int]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(
                sa.text("SELECT step FROM metrics WHERE run_id = :r ORDER BY step"), {"r": run_id}
            ).scalars())  # fmt: skip
    finally:
        engine.dispose()


def _ops(http: httpx.Client, seq: int, *ops: dict[str, Any], client: Any = "doc") -> Any:
    return http.post(f"{API}/batches/ops", json={"client_id": client, "seq": seq, "ops": list(ops)})


def _answer(response: httpx.Response) -> tuple[int, dict[str, Any]]:
    return response.status_code, response.json()


def test_a_step_is_a_whole_number_never_true_or_text(served: Served) -> None:
    with served.client() as http:
        _exp, _group, run_id = _recorded(http)
        _metrics(http, run_id, [0, 1, 2, 3, 4])
        truncate = f"{API}/runs/{run_id}/truncate"
        refused = [http.post(truncate, json={"after_step": bad}) for bad in (True, "1", 1.5)]
        assert _steps(served.store_url, run_id) == [0, 1, 2, 3, 4]  # nothing dropped
        whole = http.post(truncate, json={"after_step": 3.0})  # JSON Schema's integer
    assert [_answer(r) for r in refused] == [
        (422, {"detail": "body.after_step: Input should be a valid integer",
               "field": "body.after_step"}),
        (422, {"detail": "body.after_step: Input should be a valid integer",
               "field": "body.after_step"}),
        (422, {"detail": "body.after_step: Input should be a valid integer, got a number with "
                         "a fractional part", "field": "body.after_step"}),
    ]  # fmt: skip
    assert _answer(whole) == (200, {"ok": True})
    assert _steps(served.store_url, run_id) == [0, 1, 2, 3]


def test_a_405_lists_every_method_the_document_lists_at_its_path(served: Served) -> None:
    document = httpx.get(f"{served.url}/openapi.json").json()
    runs = document["paths"]["/api/v1/experiments/{experiment}/runs"]
    assert sorted(runs) == ["get", "post"]  # one path, as OpenAPI has it: not two templates
    assert "/api/v1/experiments/{name}/runs" not in document["paths"]
    with served.client() as http:
        answers = {
            path: http.request(method, f"{API}{path}")
            for method, path in [
                ("OPTIONS", "/experiments"),
                ("DELETE", "/experiments/7/runs"),
                ("DELETE", "/experiments/a%2Fb/runs"),  # no experiment id: reads only
                ("PUT", "/runs/1/truncate"),
            ]
        }
    assert {p: (a.status_code, a.headers["allow"]) for p, a in answers.items()} == {
        "/experiments": (405, "GET, POST"),
        "/experiments/7/runs": (405, "GET, POST"),
        "/experiments/a%2Fb/runs": (405, "GET"),
        "/runs/1/truncate": (405, "POST"),
    }
    assert answers["/experiments"].json() == {
        "detail": "OPTIONS is not allowed on /api/v1/experiments",
        "field": None,
    }


def test_an_experiment_name_with_a_line_break_reaches_its_routes(served: Served) -> None:
    with served.client() as http:
        _recorded(http, "two\nlines")
        runs = http.get(f"{API}/experiments/two%0Alines/runs")
        page = http.get(f"{API}/dashboard/experiments/two%0Alines/runs")
        record = http.get(f"{API}/experiments/two%0Alines")
    assert (runs.status_code, [r["run_key"] for r in runs.json()]) == (200, ["r0"])
    assert (page.status_code, [r["run_key"] for r in page.json()["runs"]]) == (200, ["r0"])
    assert (record.status_code, record.json()["name"]) == (200, "two\nlines")


def test_an_ops_batch_is_checked_against_its_declared_union_before_any_op_runs(
    served: Served,
) -> None:
    with served.client() as http:
        exp_id, _group, run_id = _recorded(http)
        finish = {"op": "finish_run", "args": {"run_id": run_id, "status": "completed"}}
        answers = [
            _ops(http, 1, {"op": {}, "args": {}}),  # was a 500
            _ops(http, 1, finish, client={}),  # was a 500
            _ops(http, 1, finish, {"op": "finish_run", "args": {"run_id": run_id,
                                                                "status": "done"}}),
            _ops(http, 1, {"op": "heartbeat", "args": {"run_ids": [True]}}),
            _ops(http, 1, {"op": "finish_experiment", "args": {"experiment_id": exp_id,
                                                               "status": "completed",
                                                               "extra": 1}}),
        ]  # fmt: skip
        status = http.get(f"{API}/experiments/doc").json()["runs"][0]["status"]
    assert [_answer(a) for a in answers] == [
        (400, {"detail": 'ops.0: each op is {"op": one of write_eval, write_checkpoint, '
                         "finish_run, set_callback_errors, set_provenance, finish_experiment, "
                         'heartbeat, media, metrics, truncate_run, "args": {...}}',
               "field": "body.ops.0"}),
        (400, {"detail": "client_id must be 1 to 64 letters, digits, '_', '.' or '-'",
               "field": "body.client_id"}),
        (422, {"detail": "body.ops.1.finish_run.args.status: Input should be 'running', "
                         "'completed', 'failed', 'stopped', 'crashed' or 'pruned'",
               "field": "body.ops.1.finish_run.args.status"}),
        (422, {"detail": "body.ops.0.heartbeat.args.run_ids.0: Input should be a valid integer",
               "field": "body.ops.0.heartbeat.args.run_ids.0"}),
        (422, {"detail": "body.ops.0.finish_experiment.args.extra: Extra inputs are not "
                         "permitted", "field": "body.ops.0.finish_experiment.args.extra"}),
    ]  # fmt: skip
    assert status == "running"  # the batch with one bad op applied none of its ops


def _png_of_size(width: int, height: int, tmp: Any) -> bytes:
    png = bytearray(write_image(tmp, "k", 0, [[0]]).path.read_bytes())
    png[16:24] = struct.pack(">II", width, height)  # what the IHDR chunk says
    return bytes(png)


def test_values_the_server_checks_are_declared_and_refused_as_declared(
    served: Served, tmp_path: Any
) -> None:
    with served.client() as http:
        exp_id, group_id, run_id = _recorded(http)
        kind = http.post(f"{API}/experiments/{exp_id}/groups", json={"name": "h", "kind": "x"})
        done = http.post(f"{API}/experiments/{exp_id}/finish", json={"status": "done"})
        key = http.post(f"{API}/runs/{run_id}/supersede", json={"run_key": " "})
        steps = [http.get(f"{API}/runs/{run_id}/predictions", params={"step": step})
                 for step in ("5_0", " 5", "\u0665", "5", "final")]  # fmt: skip
        cursor = http.get(f"{API}/runs/{run_id}/predictions", params={"after": "1.2 "})
        big = base64.b64encode(_png_of_size(2**31, 1, tmp_path)).decode()
        image = _ops(http, 1, {"op": "media", "args": {"rows": [{
            "table": "images", "run_id": run_id, "key": "k", "step": 0, "path": "k.png",
            "width": 1, "height": 1, "wall_time": 0.0, "data": big}]}})  # fmt: skip
        claim = {"group_id": group_id, "run_key": "c0", "config_hash": "a"}
        first = http.post(f"{API}/experiments/{exp_id}/claims", json=claim)
        _ops(http, 2, {"op": "finish_run", "args": {"run_id": first.json()["run_id"],
                                                   "status": "completed"}})  # fmt: skip
        other = http.post(f"{API}/experiments/{exp_id}/claims", json={**claim, "config_hash": "b"})
    assert _answer(kind) == (
        422,
        {"detail": "body.kind: Input should be 'repeats' or 'chain'", "field": "body.kind"},
    )
    assert _answer(done) == (422, {
        "detail": "body.status: Input should be 'running', 'completed', 'failed' or 'crashed'",
        "field": "body.status"})  # fmt: skip
    assert _answer(key) == (400, {
        "detail": "run key ' ' is not a non-empty string; give it a name",
        "field": "body.run_key"})  # fmt: skip
    assert [s.status_code for s in steps] == [400, 400, 400, 200, 200]
    assert steps[0].json() == {
        "detail": "step='5_0': give a step number, or 'final' for the eval after training",
        "field": "step",
    }
    assert _answer(cursor) == (400, {
        "detail": "after='1.2 ' is not a page cursor; pass the 'next' of the page before",
        "field": "after"})  # fmt: skip
    assert _answer(image) == (400, {
        "detail": "media rows: an image's PNG says it is 2147483648 x 1 pixels; the store "
                  "holds sizes up to 2147483647", "field": "body"})  # fmt: skip
    assert first.status_code == 200
    assert _answer(other) == (409, {
        "detail": "run c0 of experiment 'doc' was just recorded with other settings by another "
                  "process; use a new experiment name, or start afresh with fresh=True "
                  "(--fresh on the command line)", "field": "path.experiment_id"})  # fmt: skip
