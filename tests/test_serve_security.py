"""`lab serve` against a hostile or broken world, on a real server: a client that names a
file of the server's host, bodies that decode to far more than they weigh, slow clients
that hold connections, and a store that goes away under it (a real PostgreSQL behind a
real TCP proxy that is cut)."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pyarrow as pa
import pydantic
import pytest
import sqlalchemy as sa
import test_durability
import torch
from test_durability import Proxy
from test_serve_auth import REPO, LabServe, make_token
from test_serve_auth import lab as lab_cli

import lab
import lab.inspect
from lab.server.app import STORE_DOWN
from lab.server.bodies import MAX_BATCH_OPS, MAX_BATCH_ROWS, MAX_JSON_VALUES
from lab.server.dashboard import NO_BYTES
from lab.store.http.sender import MAX_OPS, MAX_OPS_BYTES, MAX_POINTS, Op, Sender
from tests import warm
from tests.served import Served, free_port

OPS = "/api/v1/batches/ops"
proxied = test_durability.proxied  # PostgreSQL behind a TCP proxy a test can cut
METRICS = "/api/v1/batches/metrics"


def _rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.exec_driver_sql(sql).all()]
    finally:
        engine.dispose()


def _run(http: Any, output_dir: str | None, name: str = "attack") -> int:
    """An experiment, arm, group and run made over the write API, as the issue's steps do."""
    exp = http.post("/api/v1/experiments", json={"name": name}).json()["experiment_id"]
    arm = http.post(f"/api/v1/experiments/{exp}/arms", json={"name": "a"}).json()["arm_id"]
    group = http.post(
        f"/api/v1/experiments/{exp}/groups", json={"name": "a", "arm_id": arm}
    ).json()["group_id"]
    body = {"group_id": group, "run_key": "a-r0", "arm_id": arm, "output_dir": output_dir}
    return http.post(f"/api/v1/experiments/{exp}/runs", json=body).json()["run_id"]


def _media(client_id: str, seq: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"client_id": client_id, "seq": seq, "ops": [{"op": "media", "args": {"rows": rows}}]}


# -- 1. a server never opens a file a client names ----------------------------------------------
def test_no_path_a_client_sends_makes_the_server_read_a_file(
    served: Served, tmp_path: Path
) -> None:
    """The reproduction: a run whose folder is ``/`` and image rows whose paths lead to the
    server's command line (its store URL, password included) and to a file outside any run
    folder. The rows are kept (a path is data), and the image route reads none of them."""
    secret = tmp_path / "elsewhere" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("a file of the server's host")
    paths = ["proc/self/cmdline", str(secret)[1:], str(secret), "../../.." + str(secret)]
    with served.client() as http:
        run_id = _run(http, "/")
        rows = [
            {"table": "images", "run_id": run_id, "key": "k", "step": step, "path": path,
             "width": 1, "height": 1, "wall_time": 0}
            for step, path in enumerate(paths)
        ]  # fmt: skip
        answer = http.post(OPS, json=_media("attacker", 1, rows))
        assert (answer.status_code, answer.json()["rows"]) == (200, 1), answer.text
    assert _rows(served.store_url, "select step, path, data from images order by step") == [
        (step, path, None) for step, path in enumerate(paths)
    ]
    with served.client(served.read_token) as http:
        for step in range(len(paths)):
            got = http.get(f"/api/v1/dashboard/runs/{run_id}/image?key=k&step={step}")
            assert got.status_code == 404, f"step {step} served {got.content[:120]!r}"
            assert (got.status_code, got.json()) == (404, {
                "detail": NO_BYTES.format(run_id=run_id, key="k", step=step), "field": "key",
            })  # fmt: skip
            assert "secret" not in got.text and "python" not in got.text


class _Cfg(pydantic.BaseModel):
    lr: float = 0.1


def _images(run: lab.RunSpec) -> lab.LoopArtifacts:
    """Four steps; an image of the weights at steps 2 and 4."""
    torch.manual_seed(run.seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=run.config.lr)
    x = torch.randn(8, 4)
    with lab.RunHandle(run, model, opt, num_steps=4) as loop:
        for step in loop.steps():
            loss = torch.nn.functional.mse_loss(model(x), x[:, :2])
            opt.zero_grad()
            loss.backward()
            opt.step()
            loop.end_step({"loss": loss.item()})
            if step % 2 == 0:
                loop.log_image("weights", (model.weight.detach() + 1) / 2)
    assert loop.artifacts is not None
    return loop.artifacts


def test_an_image_logged_through_the_server_is_kept_and_served_from_the_store(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client sends the PNG's bytes; the store keeps them; the dashboard serves them,
    the same bytes, after the run's folder is gone."""
    monkeypatch.setenv("LAB_TOKEN", served.write_token)
    folder = tmp_path / "runs"
    lab.Experiment("pictures", _images, base_config=_Cfg(), store=served.url,
                   output_dir=str(folder)).run()  # fmt: skip
    files = sorted((folder / "pictures" / "base-r0" / "media").rglob("*.png"))
    assert [f.name for f in files] == ["step_000002.png", "step_000004.png"]
    written = [f.read_bytes() for f in files]
    stored = _rows(served.store_url, "select step, width, height, data from images order by step")
    assert [(s, w, h, bytes(d)) for s, w, h, d in stored] == [
        (2, 4, 2, written[0]), (4, 4, 2, written[1]),
    ]  # fmt: skip
    shutil.rmtree(folder)
    with served.client(served.read_token) as http:
        (run,) = http.get("/api/v1/dashboard/experiments/pictures/runs").json()["runs"]
        page = http.get(f"/api/v1/dashboard/runs/{run['run_id']}").json()
        got = [http.get(image["url"]) for image in page["images"]]
    assert [(g.status_code, g.headers["content-type"]) for g in got] == [(200, "image/png")] * 2
    assert [g.content for g in got] == written
    # the analysis copies leave the bytes out: over HTTP, and through Arrow locally
    for con in (
        lab.inspect.connect(served.url),
        lab.inspect.connect(served.store_url, mode="arrow"),
    ):
        assert con.sql("select key, step, width from images order by step").fetchall() == [
            ("weights", 2, 4), ("weights", 4, 4),
        ]  # fmt: skip
        con.close()


def test_image_bytes_a_client_sends_must_be_a_png(served: Served, tmp_path: Path) -> None:
    """Bytes that are not base64 or not a PNG are one line and store nothing; a PNG's size is
    read from it, not taken from the row."""
    from lab.media import write_image

    png = write_image(tmp_path, "k", 0, np.zeros((3, 5), dtype=np.uint8)).path.read_bytes()
    with served.client() as http:
        run_id = _run(http, None)
        row = {"table": "images", "run_id": run_id, "key": "k", "step": 0, "path": "x.png",
               "width": 99, "height": 99, "wall_time": 0.0}  # fmt: skip
        gif = base64.b64encode(b"GIF89a").decode()
        refused = [http.post(OPS, json=_media("c", 1, [{**row, "data": data}]))
                   for data in ("%%%", gif)]  # fmt: skip
        kept = http.post(
            OPS, json=_media("c", 1, [{**row, "data": base64.b64encode(png).decode()}])
        )
    assert [(r.status_code, r.json()["detail"]) for r in refused] == [
        (400, "media rows: an image's data must be its PNG's bytes in base64"),
        (400, "media rows: an image's data is not a PNG; send the PNG's bytes"),
    ]
    assert kept.status_code == 200, kept.text
    assert [(w, h, bytes(d)) for w, h, d in _rows(
        served.store_url, "select width, height, data from images"
    )] == [(5, 3, png)]  # fmt: skip


# -- 2. an Arrow body is bounded by what it decodes to, not what it weighs -------------------
def _stream(table: pa.Table, **options: Any) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(**options)) as w:
        w.write_table(table)
    return sink.getvalue()


def _peak_rss(pid: int, during: Any) -> tuple[Any, int]:
    """Run `during()` while sampling the RSS of process `pid`; (its result, the most RSS
    rose above where it started, in bytes)."""
    process = psutil.Process(pid)
    start = process.memory_info().rss
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result = during()
        time.sleep(0.2)  # anything allocated late shows too
    finally:
        done.set()
        sampler.join()
    return result, peak[0] - start


def test_a_compressed_arrow_body_is_413_and_the_server_decodes_none_of_it(
    served: Served,
) -> None:
    """The issue's body: 200M int64 zeros, zstd-compressed into a few KiB. The server reads
    the message headers, sees the compression and answers 413 before a buffer is decoded:
    its memory does not move."""
    zeros = pa.array(np.zeros(200_000_000, dtype=np.int64))  # calloc'd: costs no memory here
    body = _stream(pa.table({"run_id": zeros}), compression="zstd")
    del zeros
    assert len(body) < 200 * 1024
    headers = {"X-Lab-Client": "c1", "X-Lab-Seq": "1"}
    assert served.process is not None
    with served.client() as http:
        http.get("/api/v1/token")  # warm: the first request's own allocations are not counted
        answer, grew = _peak_rss(
            served.process.pid, lambda: http.post(METRICS, content=body, headers=headers)
        )
    assert (answer.status_code, answer.json()) == (413, {
        "detail": "the Arrow body is compressed, which the server does not accept (its buffers "
                  "could decode to far more than --max-body); send the stream uncompressed",
        "field": "body",
    })  # fmt: skip
    assert grew < 32 * 1024 * 1024, f"the server's memory grew by {grew / 2**20:.0f} MiB"


def _metric_table(rows: int, run_id: int) -> pa.Table:
    return pa.table({
        "run_id": pa.array(np.full(rows, run_id, dtype=np.int64)),
        "step": pa.array(np.arange(rows, dtype=np.int64)),
        "key": pa.array(["loss"] * rows).dictionary_encode(),
        "value": pa.array(np.zeros(rows)),
    })  # fmt: skip


def test_an_arrow_body_holds_at_most_max_batch_rows_and_plain_columns(served: Served) -> None:
    with served.client() as http:
        run_id = _run(http, None)
        over = http.post(METRICS, content=_stream(_metric_table(MAX_BATCH_ROWS + 1, run_id)),
                         headers={"X-Lab-Client": "c1", "X-Lab-Seq": "1"})  # fmt: skip
        nested = pa.table({"run_id": [[1]], "step": [1], "key": ["loss"], "value": [1.0]})
        odd = http.post(METRICS, content=_stream(nested),
                        headers={"X-Lab-Client": "c1", "X-Lab-Seq": "2"})  # fmt: skip
        extra = _metric_table(3, run_id).append_column("junk", pa.array([[1, 2]] * 3))
        fine = http.post(METRICS, content=_stream(extra),
                         headers={"X-Lab-Client": "c1", "X-Lab-Seq": "3"})  # fmt: skip
    assert (over.status_code, over.json()) == (413, {
        "detail": f"the Arrow body holds more than {MAX_BATCH_ROWS} rows, the most one batch "
                  "may hold; send smaller batches",
        "field": "body",
    })  # fmt: skip
    assert (odd.status_code, odd.json()) == (400, {
        "detail": "the Arrow column 'run_id' is list<item: int64>; send int64",
        "field": "body.run_id",
    })  # fmt: skip
    assert (fine.status_code, fine.json()["rows"]) == (200, 3)  # other columns: never read
    assert _rows(served.store_url, "select step from metrics order by step") == [(0,), (1,), (2,)]


# -- 4. a JSON body is bounded in ops and in values ----------------------------------------------
def test_an_ops_batch_holds_at_most_max_batch_ops_and_max_json_values(served: Served) -> None:
    heartbeat = {"op": "heartbeat", "args": {"run_ids": []}}
    with served.client() as http:
        over = http.post(OPS, json={"client_id": "c", "seq": 1,
                                    "ops": [heartbeat] * (MAX_BATCH_OPS + 1)})  # fmt: skip
        padded = http.post(OPS, json={"client_id": "c", "seq": 2, "ops": [],
                                      "pad": [0] * MAX_JSON_VALUES})  # fmt: skip
        deep = http.post(
            OPS,
            content=b'{"client_id": "c", "seq": 3, "ops": [], "x": '
            + b"[" * 100_000
            + b"]" * 100_000
            + b"}",
            headers={"Content-Type": "application/json"},
        )
        at_limit = http.post(OPS, json={"client_id": "c", "seq": 4,
                                        "ops": [heartbeat] * MAX_BATCH_OPS})  # fmt: skip
    assert (over.status_code, over.json()) == (413, {
        "detail": f"the batch holds {MAX_BATCH_OPS + 1} ops; the server takes at most "
                  f"{MAX_BATCH_OPS} in one batch; send smaller batches",
        "field": "body.ops",
    })  # fmt: skip
    assert (padded.status_code, padded.json()) == (413, {
        "detail": f"the JSON body holds more than {MAX_JSON_VALUES} values, the most one "
                  "batch may hold; send smaller batches",
        "field": "body",
    })  # fmt: skip
    assert (deep.status_code, deep.json()) == (400, {
        "detail": "the body is nested too deep to be read as JSON", "field": "body",
    })  # fmt: skip
    assert (at_limit.status_code, at_limit.json()["rows"]) == (200, MAX_BATCH_OPS)
    assert _rows(served.store_url, "select seq, rows from ingest_batches") == [(4, MAX_BATCH_OPS)]


def test_the_client_cuts_its_batches_inside_the_servers_limits() -> None:
    """`Sender._batches` (the client's cut, before anything is posted): metric steps never
    past `MAX_POINTS` (a step is never split), ops at most `MAX_OPS` and about
    `MAX_OPS_BYTES` per batch, in order, each body the JSON the server reads."""
    assert MAX_POINTS <= MAX_BATCH_ROWS and MAX_OPS <= MAX_BATCH_OPS
    sender = Sender(None, "c", lambda run_id: None, heartbeat_s=60.0)  # type: ignore[arg-type]
    step = {f"k{i}": 0.5 for i in range(100_000)}
    cut = [sender._number(batch) for batch in sender._batches([(1, s, step, 0.0)
                                                                for s in range(5)])]  # fmt: skip
    rows = [pa.ipc.open_stream(batch.body).read_all().num_rows for batch in cut]
    assert [(batch.kind, batch.seq) for batch in cut] == [("arrow", 1), ("arrow", 2), ("arrow", 3)]
    assert rows == [200_000, 200_000, 100_000]
    many = [Op("set_callback_errors", {"run_id": 7, "callback_errors": [i]}, 7)
            for i in range(2 * MAX_OPS + 5)]  # fmt: skip
    big = [Op("set_provenance", {"run_id": 8, "provenance": {"x": "y" * 3_000_000}}, 8)
           for _ in range(7)]  # fmt: skip
    cut = [sender._number(batch) for batch in sender._batches([*many, *big])]
    bodies = [json.loads(batch.body) for batch in cut]
    assert [(b["client_id"], b["seq"], len(b["ops"])) for b in bodies] == [
        ("c", 4, MAX_OPS), ("c", 5, MAX_OPS), ("c", 6, 5 + 2), ("c", 7, 2), ("c", 8, 2),
        ("c", 9, 1),
    ]  # fmt: skip
    assert [batch.run_id for batch in cut] == [7, 7, 7, 8, 8, 8]
    assert all(len(batch.body) <= MAX_OPS_BYTES + 64 for batch in cut)
    ops = [op for b in bodies for op in b["ops"]]
    assert ops[: 2 * MAX_OPS + 5] == [
        {"op": "set_callback_errors", "args": {"run_id": 7, "callback_errors": [i]}}
        for i in range(2 * MAX_OPS + 5)
    ]


# -- 5. slow clients hold no connection for ever ------------------------------------------------
@pytest.fixture
def impatient(tmp_path: Path) -> Iterator[tuple[LabServe, str]]:
    """`lab serve` with every timeout at 1 s, and a write token."""
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    token = make_token(url, "w", "write")
    args = ("--timeout-header", "1", "--timeout-body", "1", "--timeout-keep-alive", "1")
    server = LabServe(url, tmp_path / "serve.log", args=args).start()
    try:
        yield server, token
    finally:
        server.stop()


def _connect(server: LabServe) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _until_closed(sock: socket.socket, since: float) -> tuple[float, bytes]:
    """Read `sock` until the server closes it: (seconds from `since`, what it sent)."""
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"still open after {time.monotonic() - since:.1f} s") from None
    return time.monotonic() - since, got


def _response(sock: socket.socket) -> tuple[bytes, Any]:
    """One HTTP answer read off `sock`: (its status line, its JSON body)."""
    got = b""
    while b"\r\n\r\n" not in got:
        got += sock.recv(65536)
    head, _, body = got.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))  # fmt: skip
    while len(body) < length:
        body += sock.recv(65536)
    return head.split(b"\r\n")[0], json.loads(body)


def _trickle(sock: socket.socket, data: bytes, every_s: float) -> None:
    """Send `data` a byte at a time, every `every_s`, until it is sent or the server closes."""
    for i in range(len(data)):
        try:
            sock.sendall(data[i : i + 1])
        except OSError:
            return
        time.sleep(every_s)


def _established(server: LabServe) -> list[Any]:
    assert server.process is not None
    return [c for c in psutil.Process(server.process.pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_ESTABLISHED]  # fmt: skip


def test_a_client_that_stalls_is_disconnected_after_the_timeout(
    impatient: tuple[LabServe, str],
) -> None:
    """With 1 s timeouts: a connection that sends nothing, half a head, or a head a byte at a
    time is closed about 1 s after it opened; one idle after its answer 1 s after it; a
    body that stops is answered 408 and closed. Nothing stays open."""
    server, token = impatient
    head = b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    waited = {}
    for case in ("nothing", "half a head", "a byte at a time"):
        start = time.monotonic()
        with _connect(server) as sock:
            if case == "half a head":
                sock.sendall(head[:30])
            if case == "a byte at a time":
                threading.Thread(target=_trickle, args=(sock, head * 20, 0.1), daemon=True).start()
            waited[case], got = _until_closed(sock, start)
            assert got == b"", case
    with _connect(server) as sock:
        sock.sendall(head)
        answer = sock.recv(65536)
        start = time.monotonic()
        assert answer.startswith(b"HTTP/1.1 200 OK")
        waited["idle after an answer"], _ = _until_closed(sock, start)
    body = json.dumps({"client_id": "c", "seq": 1, "ops": []}).encode()
    with _connect(server) as sock:
        sock.sendall(
            b"POST /api/v1/batches/ops HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            + token.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body[:10]
        )  # fmt: skip
        start = time.monotonic()
        waited["a body that stops"], got = _until_closed(sock, start)
    status, _, rest = got.partition(b"\r\n")
    assert status == b"HTTP/1.1 408 Request Timeout"
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1]) == {
        "detail": "the request body stopped arriving (nothing for 1 s, the server's "
        "--timeout-body); send the request again",
        "field": "body",
    }
    assert all(0.8 < s < 4.0 for s in waited.values()), waited
    deadline = time.monotonic() + 5
    while _established(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _established(server) == []


def test_a_slow_client_that_keeps_sending_within_the_timeouts_is_answered(
    impatient: tuple[LabServe, str],
) -> None:
    """A head sent in pieces inside 1 s, then a body with pauses of 0.4 s over 2 s: the
    timeouts bound a stall, not a slow request."""
    server, token = impatient
    body = json.dumps({"client_id": "c", "seq": 1, "ops": [], "pad": "x" * 40}).encode()
    head = (b"POST /api/v1/batches/ops HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            + token.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n")  # fmt: skip
    with _connect(server) as sock:
        for i in range(0, len(head), len(head) // 4 + 1):
            sock.sendall(head[i : i + len(head) // 4 + 1])
            time.sleep(0.15)
        for i in range(0, len(body), len(body) // 5 + 1):
            sock.sendall(body[i : i + len(body) // 5 + 1])
            time.sleep(0.4)
        answer = _response(sock)
    assert answer == (b"HTTP/1.1 200 OK", {"client_id": "c", "seq": 1, "rows": 0})


def test_lab_serve_refuses_a_timeout_that_is_not_a_positive_number(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    for option in ("--timeout-header", "--timeout-body", "--timeout-keep-alive"):
        done = lab_cli("serve", "--store", url, option, "0")
        assert done.returncode != 0
        assert done.stderr.strip().splitlines()[-1] == (
            f"error: {option} 0.0: give a number of seconds > 0"
        )


# -- 6 and 8. a store that fails: 503, one log line per outage, never the store's URL -----------
@pytest.fixture
def behind_proxy(
    proxied: tuple[str, str, Proxy], tmp_path: Path
) -> Iterator[tuple[LabServe, str, Proxy, str]]:
    """`lab serve` in front of a PostgreSQL database reached through a TCP proxy the test can
    cut: (the server, a write token, the proxy, the direct URL)."""
    direct, through, proxy = proxied
    token = make_token(direct, "w", "write")
    server = LabServe(through, tmp_path / "serve.log").start()
    try:
        yield server, token, proxy, direct
    finally:
        server.stop()


def _secrets_of(url: str, proxy: Proxy) -> list[str]:
    """What a client must never read of the store's URL: its user, host, ports, database."""
    parsed = sa.engine.make_url(url)
    return [str(parsed.username), str(parsed.database), str(proxy.port), str(parsed.port),
            "127.0.0.1", "postgresql", "psycopg"]  # fmt: skip


def _health(server: LabServe, status: int, timeout: float = 15.0) -> dict[str, Any]:
    """The health check's answer, once it is `status` (the store is asked once a second)."""
    deadline = time.monotonic() + timeout
    while True:
        answer = httpx.get(f"{server.url}/api/v1/health", timeout=10)
        if answer.status_code == status or time.monotonic() > deadline:
            assert answer.status_code == status, answer.text
            return answer.json()
        time.sleep(0.1)


@pytest.mark.postgres
def test_a_store_that_goes_away_is_a_503_and_one_log_line_per_outage(
    behind_proxy: tuple[LabServe, str, Proxy, str],
) -> None:
    """Through two outages: every request (the token check, reads, writes, the dashboard, a
    page with the session cookie) is answered 503 with one line that names nothing of the
    store; the health check says the store is unreachable; the log has one line when each
    outage starts and one when it ends, and no traceback."""
    from lab.server.ui import COOKIE
    from lab.store.migrations import head_revision

    server, token, proxy, _direct = behind_proxy
    bearer = {"Authorization": f"Bearer {token}"}
    assert _health(server, 200) == {"status": "ok", "store": "ok", "schema": head_revision()}
    refused: list[httpx.Response] = []
    browser = httpx.Client(base_url=server.url, timeout=30, cookies={COOKIE: token})
    with browser, httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.post("/api/v1/experiments", json={"name": "e"}, headers=bearer).is_success
        for _outage in range(2):
            proxy.cut()
            for _ in range(5):
                refused += [
                    http.get("/api/v1/token", headers=bearer),
                    http.get("/api/v1/experiments", headers=bearer),
                    http.post("/api/v1/experiments", json={"name": "f"}, headers=bearer),
                    http.get("/api/v1/dashboard/experiments/e", headers=bearer),
                    browser.get("/experiments/e"),
                ]
            assert _health(server, 503) == {
                "status": "degraded", "store": "unreachable", "schema": head_revision(),
            }  # fmt: skip
            proxy.restore()
            assert _health(server, 200)["store"] == "ok"
            back = http.get("/api/v1/token", headers=bearer)
            assert back.json() == {"name": "w", "scope": "write", "experiment": None}
    assert {(a.status_code, a.text) for a in refused} == {
        (503, json.dumps({"detail": STORE_DOWN, "field": None}))
    }
    log = server.stop()
    assert log.count("lab serve: the store failed (") == 2, log
    assert log.count("lab serve: the store answers again (after ") == 2, log
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log


@pytest.mark.postgres
def test_a_store_error_in_a_route_never_tells_the_client_the_stores_url(
    behind_proxy: tuple[LabServe, str, Proxy, str],
) -> None:
    """The token is checked while the store answers; the store goes away while the client
    is still sending the body; the route's store call then fails with a `StoreUnreachable`
    whose text names the store's URL. The client is told 503 and the fixed line only."""
    server, token, proxy, direct = behind_proxy
    body = json.dumps({"name": "late"}).encode()
    with _connect(server) as sock:
        sock.sendall(
            b"POST /api/v1/experiments HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            + token.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n"
        )  # fmt: skip
        time.sleep(1.0)  # the token check has passed; the route waits for the body
        proxy.cut()
        sock.sendall(body)
        status, payload = _response(sock)
    assert (status, payload) == (
        b"HTTP/1.1 503 Service Unavailable", {"detail": STORE_DOWN, "field": None},
    )  # fmt: skip
    assert [s for s in _secrets_of(direct, proxy) if s in json.dumps(payload)] == []
    log = server.stop()
    assert "lab serve: the store failed (" in log and "Traceback" not in log


@pytest.mark.postgres
def test_lab_ui_over_a_store_that_goes_away_answers_503_without_its_url(
    proxied: tuple[str, str, Proxy], tmp_path: Path
) -> None:
    """`lab ui` (no token check: the routes meet the store first) over PostgreSQL through the
    proxy: the dashboard's answers while it is cut are 503 with the fixed line."""
    direct, through, proxy = proxied
    make_token(direct, "w", "write")  # creates the schema
    port = free_port()
    log = (tmp_path / "ui.log").open("wb")
    process = warm.popen(
        [sys.executable, "-m", "lab.cli", "ui", "--store", through, "--port", str(port),
         "--no-open"],
        stdout=log, stderr=log, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/api/v1/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        assert httpx.get(f"{url}/api/v1/dashboard/experiments").status_code == 200
        proxy.cut()
        answers = [httpx.get(f"{url}{path}", timeout=30) for path in (
            "/api/v1/dashboard/experiments", "/api/v1/experiments", "/api/v1/dashboard/runs/1",
        )]  # fmt: skip
    finally:
        process.terminate()
        process.wait(timeout=15)
        log.close()
    assert [(a.status_code, a.json()) for a in answers] == [
        (503, {"detail": STORE_DOWN, "field": None})
    ] * 3
    assert [s for s in _secrets_of(direct, proxy) if any(s in a.text for a in answers)] == []
