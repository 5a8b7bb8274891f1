"""`lab serve` and `lab token`, as an operator runs them: real subprocesses of the `lab`
command, a real uvicorn on loopback in front of SQLite and PostgreSQL, real HTTPS with a
certificate made here. Tokens are printed once and kept as hashes; every endpoint but the
health check wants one; every rejection is one JSON shape; no token or password leaks into a
log line, an error body, a command's output or a stored row."""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from lab.server.app import NO_TOKEN, WRONG_TOKEN, BodyLimit, is_loopback
from tests import warm
from tests.served import Served, free_port

REPO = Path(__file__).resolve().parents[1]
TOKEN = re.compile(r"lab_[A-Za-z0-9_-]{43}")
HEALTH = "/api/v1/health"
OPEN = {HEALTH, "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


def lab(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the `lab` command line in a subprocess, as a user types it."""
    return warm.run(
        [sys.executable, "-m", "lab.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )


def make_token(store_url: str, name: str, scope: str = "write") -> str:
    made = lab("token", "create", name, "--scope", scope, "--store", store_url)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


@dataclass
class LabServe:
    """`lab serve` in a subprocess, its stdout and stderr (uvicorn's access and error log)
    going to one file."""

    store_url: str
    log: Path
    args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    scheme: str = "http"
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def start(self, verify: Any = True) -> LabServe:
        argv = ["serve", "--store", self.store_url, "--port", str(self.port), *self.args]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with self.log.open("ab") as out:
            self.process = warm.popen(
                [sys.executable, "-m", "lab.cli", *argv], stdout=out, stderr=out, env=env
            )
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.url + HEALTH, timeout=1.0, verify=verify).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lab serve did not start:\n{self.log.read_text()}")
            time.sleep(0.05)

    def stop(self) -> str:
        """Stop it as an operator does (SIGTERM) and return everything it logged."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.log.read_text()


@dataclass
class Tokens:
    server: LabServe
    write: str
    read: str


@pytest.fixture
def lab_serve(store_url: str, tmp_path: Path) -> Iterator[Tokens]:
    """`lab serve` on loopback in front of `store_url` (SQLite and PostgreSQL), with a write
    and a read token made by `lab token create`."""
    write = make_token(store_url, "tests-write", "write")
    read = make_token(store_url, "tests-read", "read")
    server = LabServe(store_url, tmp_path / "serve.log").start()
    try:
        yield Tokens(server, write, read)
    finally:
        server.stop()


def _operations(url: str) -> list[tuple[str, str, list[str]]]:
    """(method, path with its parameters filled, tags) of every operation the server's own
    schema lists: what was merged later is checked too."""
    schema = httpx.get(url + "/openapi.json").json()
    out = []
    for path, item in schema["paths"].items():
        for method, op in item.items():
            if method in ("get", "post", "put", "patch", "delete"):
                filled = re.sub(r"\{[^}]+\}", "1", path)
                out.append((method.upper(), filled, op.get("tags", [])))
    return out


def _shape(answer: httpx.Response, status: int, detail: str, field: str | None) -> None:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert answer.json() == {"detail": detail, "field": field}


# -- lab token ---------------------------------------------------------------------------------


def test_token_create_prints_it_once_and_the_store_keeps_only_its_hash(store_url: str) -> None:
    made = lab("token", "create", "ci", "--scope", "write", "--store", store_url)
    assert made.returncode == 0, made.stderr
    token = made.stdout.removesuffix("\n")
    assert TOKEN.fullmatch(token), made.stdout  # alone on stdout: TOKEN=$(lab token create ...)
    assert made.stderr == "made write token 'ci'; it is shown this once, keep it (e.g. LAB_TOKEN)\n"
    reader = make_token(store_url, "notebooks", scope="read")
    default = lab("token", "create", "plain", "--store", store_url)  # no --scope: read only
    assert default.stderr.startswith("made read token 'plain'")
    assert len({token, reader, default.stdout}) == 3

    engine = sa.create_engine(
        store_url.replace("postgresql://", "postgresql+psycopg://", 1)
    )  # the raw rows, as someone who stole the database sees them
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT token_id, name, scope, token_hash, revoked_at FROM tokens "
                        "ORDER BY token_id")
            ).all()  # fmt: skip
            everything = repr(conn.execute(sa.text("SELECT * FROM tokens")).all())
    finally:
        engine.dispose()
    assert [tuple(r) for r in rows] == [
        (1, "ci", "write", hashlib.sha256(token.encode()).hexdigest(), None),
        (2, "notebooks", "read", hashlib.sha256(reader.encode()).hexdigest(), None),
        (3, "plain", "read", hashlib.sha256(default.stdout.strip().encode()).hexdigest(), None),
    ]
    assert token not in everything and token[4:] not in everything

    listed = lab("token", "list", "--store", store_url)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == [
        "name", "scope", "experiment", "created", "(UTC)", "revoked", "(UTC)"
    ]  # fmt: skip
    assert [line.split()[:2] for line in lines[1:]] == [
        ["ci", "write"], ["notebooks", "read"], ["plain", "read"]
    ]  # fmt: skip
    for secret in (token, reader, rows[0].token_hash, rows[1].token_hash):
        assert secret not in listed.stdout + listed.stderr


def test_token_create_makes_admin_tokens_and_tokens_limited_to_one_experiment(
    sqlite_url: str,
) -> None:
    limited = lab("token", "create", "helper", "--scope", "write", "--experiment", "my exp",
                  "--store", sqlite_url)  # fmt: skip
    assert limited.returncode == 0, limited.stderr
    assert limited.stderr == (
        "made write token 'helper' limited to experiment 'my exp'; it is shown this once, "
        "keep it (e.g. LAB_TOKEN)\n"
    )
    admin = lab("token", "create", "root", "--scope", "admin", "--store", sqlite_url)
    assert admin.stderr.startswith("made admin token 'root';"), admin.stderr
    both = lab("token", "create", "x", "--scope", "admin", "--experiment", "e",
               "--store", sqlite_url)  # fmt: skip
    assert (both.returncode, both.stdout, both.stderr) == (
        1, "", "error: an admin token reads and writes every experiment; leave --experiment "
        "out, or make a write token limited to it\n",
    )  # fmt: skip
    rows = lab("token", "list", "--store", sqlite_url).stdout.splitlines()
    assert [r.split()[:4] for r in rows[1:]] == [
        ["helper", "write", "my", "exp"], ["root", "admin", *rows[2].split()[2:4]]
    ]  # fmt: skip
    assert rows[0].index("experiment") == rows[1].index("my exp")


def test_token_revoke_and_every_refusal_is_one_line(store_url: str) -> None:
    assert lab("token", "list", "--store", store_url).stdout == (
        "no tokens yet; make one: lab token create NAME --scope read|write|admin\n"
    )
    make_token(store_url, "ci")
    revoked = lab("token", "revoke", "ci", "--store", store_url)
    assert (revoked.returncode, revoked.stdout) == (0, "revoked token 'ci'\n")
    again = lab("token", "revoke", "ci", "--store", store_url)
    assert again.returncode == 0
    assert re.fullmatch(
        r"token 'ci' was already revoked at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\n", again.stdout
    )
    (row,) = lab("token", "list", "--store", store_url).stdout.splitlines()[1:]
    assert len(row.split()) == 6  # name, scope, created (2 words), revoked (2 words)

    for argv, line in [
        (("revoke", "nope"), "error: no token named 'nope'; lab token list shows the tokens"),
        (("create", "ci"), "error: a revoked token named 'ci' exists; pick another name"),
        (
            ("create", "x", "--scope", "owner"),
            "error: scope 'owner': use one of read, write, admin",
        ),
    ]:
        refused = lab("token", *argv, "--store", store_url)
        assert (refused.returncode, refused.stdout, refused.stderr) == (1, "", line + "\n")
    make_token(store_url, "live")
    taken = lab("token", "create", "live", "--store", store_url)
    assert taken.stderr == "error: a token named 'live' exists; pick another name\n"

    remote = lab("token", "create", "x", "--store", "http://127.0.0.1:9")
    assert (remote.returncode, remote.stdout) == (1, "")
    assert remote.stderr == (
        "error: tokens live in the database behind the server: give --store the sqlite:/// "
        "or postgresql:// URL that lab serve was started with, not http://127.0.0.1:9\n"
    ) or remote.stderr.startswith("error: store URL scheme 'http' is not supported")


# -- lab serve: where it binds ---------------------------------------------------------------


def test_is_loopback() -> None:
    for host in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.5", "192.168.1.2", "example.org", "lab-host"):
        assert not is_loopback(host), host


def test_lab_serve_binds_another_address_only_with_a_live_token(
    sqlite_url: str, tmp_path: Path
) -> None:
    refusal = (
        "error: lab serve --host 0.0.0.0: the store has no live token, so anyone who reaches "
        "the port could write; make one first: lab token create NAME --scope write "
        f"--store {sqlite_url}\n"
    )
    port = str(free_port())
    refused = lab("serve", "--store", sqlite_url, "--host", "0.0.0.0", "--port", port)
    assert (refused.returncode, refused.stdout, refused.stderr) == (1, "", refusal)
    page = (REPO / "docs" / "serve.md").read_text(encoding="utf-8")
    assert refusal.replace(sqlite_url, "URL") in page  # the docs quote it word for word
    make_token(sqlite_url, "gone")
    lab("token", "revoke", "gone", "--store", sqlite_url)
    refused = lab("serve", "--store", sqlite_url, "--host", "0.0.0.0", "--port", port)
    assert (refused.returncode, refused.stderr) == (1, refusal)  # a revoked token is none

    token = make_token(sqlite_url, "live")
    server = LabServe(sqlite_url, tmp_path / "serve.log", ("--host", "0.0.0.0")).start()
    try:
        answer = httpx.get(
            server.url + "/api/v1/token", headers={"Authorization": f"Bearer {token}"}
        )
        assert answer.json() == {"name": "live", "scope": "write", "experiment": None}
    finally:
        log = server.stop()
    assert log.splitlines()[0] == (
        f"lab serve: {sqlite_url} at http://0.0.0.0:{server.port} (bodies up to 67108864 bytes)"
    )


def test_lab_serve_refuses_bad_options_with_one_line(sqlite_url: str, tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    cases = [
        (("--ssl-certfile", str(junk)), "error: HTTPS needs both --ssl-certfile and --ssl-keyfile"),
        (
            ("--ssl-certfile", str(tmp_path / "none.pem"), "--ssl-keyfile", str(junk)),
            f"error: --ssl-certfile {tmp_path / 'none.pem'}: no such file",
        ),
        (("--max-body", "0"), "error: --max-body 0: use a number of bytes >= 1"),
        (("--port", "70000"), "error: --port 70000: use a TCP port from 0 to 65535"),
    ]
    for args, line in cases:
        refused = lab("serve", "--store", sqlite_url, *args)
        assert (refused.returncode, refused.stdout, refused.stderr) == (1, "", line + "\n")
    refused = lab("serve", "--store", sqlite_url, "--ssl-certfile", str(junk),
                  "--ssl-keyfile", str(junk))  # fmt: skip
    assert refused.returncode == 1
    assert refused.stderr.startswith(
        f"error: --ssl-certfile {junk} with --ssl-keyfile {junk}: not a PEM certificate and its "
        "private key ("
    )
    assert len(refused.stderr.splitlines()) == 1


# -- tokens on every endpoint ----------------------------------------------------------------


def test_every_endpoint_but_health_wants_a_live_token(lab_serve: Tokens) -> None:
    url, store_url = lab_serve.server.url, lab_serve.server.store_url
    operations = [op for op in _operations(url) if op[1] not in OPEN]
    assert ("GET", "/api/v1/token", ["health"]) in operations
    gone = make_token(store_url, "gone", "write")
    headers_of = {
        "no header": ({}, NO_TOKEN),
        "a bearer without a token": ({"Authorization": "Bearer"}, NO_TOKEN),
        "basic": ({"Authorization": "Basic dXNlcjpwdw=="}, NO_TOKEN),
        "the token without its scheme": ({"Authorization": lab_serve.write}, NO_TOKEN),
        "wrong": ({"Authorization": f"Bearer {lab_serve.write[:-1]}x"}, WRONG_TOKEN),
        "unknown": ({"Authorization": "Bearer lab_" + "A" * 43}, WRONG_TOKEN),
    }
    with httpx.Client(base_url=url, timeout=30) as client:
        live = client.get("/api/v1/token", headers={"Authorization": f"Bearer {gone}"})
        assert live.json() == {"name": "gone", "scope": "write", "experiment": None}
        assert lab("token", "revoke", "gone", "--store", store_url).returncode == 0
        headers_of["revoked"] = ({"Authorization": f"Bearer {gone}"}, WRONG_TOKEN)
        for method, path, _tags in [*operations, ("GET", "/api/v1/no/such/route", [])]:
            for why, (headers, detail) in headers_of.items():
                answer = client.request(method, path, headers=headers, content=b"{}")
                _shape(answer, 401, detail, "header.authorization")
                assert answer.headers["www-authenticate"] == "Bearer", (method, path, why)
        assert client.get(HEALTH).json()["status"] == "ok"
        reader = {"Authorization": f"Bearer {lab_serve.read}"}
        assert client.get("/api/v1/token", headers=reader).json() == {
            "name": "tests-read",
            "scope": "read",
            "experiment": None,
        }
        writes = [(m, p) for m, p, tags in operations if "write" in tags]
        for method, path in writes:  # the write API, once merged: every route of it
            answer = client.request(method, path, headers=reader, json={})
            _shape(answer, 403, "a read token cannot write; use a write token",
                   "header.authorization")  # fmt: skip
        answer = client.get("/api/v1/no/such/route", headers=reader)
        _shape(answer, 404, "no endpoint GET /api/v1/no/such/route; /openapi.json lists them",
               None)  # fmt: skip
        answer = client.delete(HEALTH)
        _shape(answer, 405, "DELETE is not allowed on /api/v1/health", None)


# -- secrets never leak ----------------------------------------------------------------------


@pytest.fixture
def pg_with_password(pg_url: str) -> Iterator[tuple[str, str]]:
    """`pg_url` reached as a role of its own whose password is distinctive, so that a grep
    for it means something: (the URL with the password, the password)."""
    password = "pw-" + secrets.token_hex(12)
    role = "lab_leak_" + secrets.token_hex(4)
    admin = sa.create_engine(
        sa.engine.make_url(pg_url).set(drivername="postgresql+psycopg"),
        isolation_level="AUTOCOMMIT",
    )
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
        conn.exec_driver_sql(f"GRANT ALL ON SCHEMA public TO {role}")
    url = sa.engine.make_url(pg_url).set(username=role, password=password)
    try:
        yield url.render_as_string(hide_password=False), password
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            conn.exec_driver_sql(f"REASSIGN OWNED BY {role} TO CURRENT_USER")
            conn.exec_driver_sql(f"DROP OWNED BY {role}")
            conn.exec_driver_sql(f"DROP ROLE {role}")
        admin.dispose()


def _train(run: Any) -> dict[str, float]:
    return {"loss": 0.5}


def test_tokens_and_passwords_never_leak(
    pg_with_password: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through every door: the server's log (stdout and stderr), its error bodies, `lab
    token`'s and `lab show`'s output, and every row the store holds."""
    from lab import Experiment

    store_url, password = pg_with_password
    made = lab("token", "create", "leak", "--scope", "write", "--store", store_url)
    token = made.stdout.strip()
    read = make_token(store_url, "leak-read", "read")
    seen: list[str] = [made.stderr]

    monkeypatch.setenv("LAB_TOKEN", token)  # a job's environment holds both
    monkeypatch.setenv("LAB_STORE_URL", store_url)
    Experiment("leaky", train=_train, repeats=1, store=store_url).run()

    server = LabServe(store_url, tmp_path / "serve.log").start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            bearer = {"Authorization": f"Bearer {token}"}
            answers = [
                client.get("/api/v1/token", headers=bearer),
                client.get(f"/api/v1/token?token={token}&password={password}", headers=bearer),
                client.get(f"/api/v1/no/{token}/{password}", headers=bearer),  # a 404 names it
                client.get(f"/api/v1/no/{token}"),  # no header: 401
                client.get("/api/v1/token", headers={"Authorization": f"Bearer {token}x"}),
                client.post(f"/api/v1/{token}", headers=bearer, content=b"x" * 100),
                client.get(f"/api/v1/token?{token}", headers={"Authorization": f"Bearer {read}"}),
            ]
            assert [a.status_code for a in answers] == [200, 200, 404, 401, 401, 404, 200]
            assert answers[2].json()["detail"] == (  # the server masks its own password
                "no endpoint GET /api/v1/no/***/***; /openapi.json lists them"
            )
            seen += [a.text + repr(dict(a.headers)) for a in answers]
    finally:
        log = server.stop()
    assert "GET /api/v1/token?token=***" in log  # the log was written, and masked
    seen.append(log)
    for argv in (("token", "list"), ("ls",), ("show", "leaky")):
        shown = lab(*argv, "--store", store_url)
        assert shown.returncode == 0, shown.stderr
        seen.append(shown.stdout + shown.stderr)
    assert "leaky" in seen[-1]

    engine = sa.create_engine(store_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            for table in sa.inspect(conn).get_table_names():
                seen.append(repr(conn.execute(sa.text(f'SELECT * FROM "{table}"')).all()))
    finally:
        engine.dispose()
    everything = "\n".join(seen)
    assert token not in everything and read not in everything
    assert token[4:20] not in everything  # not even a part of it
    leaks = [chunk[:300] for chunk in seen if password in chunk]
    assert leaks == [], "the database password leaked"


# -- the body limit --------------------------------------------------------------------------


@pytest.fixture
def echo_behind_limit() -> Iterator[str]:
    """`BodyLimit(100)` in front of an ASGI app that reads the whole body and answers its
    length, on a real uvicorn on loopback: the limit by itself, whatever routes exist."""
    import uvicorn

    async def echo(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        size, more = 0, True
        while more:
            message = await receive()
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(size).encode()})

    port = free_port()
    config = uvicorn.Config(BodyLimit(echo, 100), host="127.0.0.1", port=port, log_level="error",
                            lifespan="off")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def _chunks(data: bytes, size: int = 7) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def test_a_body_over_the_limit_is_413_declared_or_counted(echo_behind_limit: str) -> None:
    too_large = {
        "detail": "the request body is over the server's limit of 100 bytes; send smaller "
        "batches, or start the server with a larger --max-body",
        "field": "body",
    }
    with httpx.Client(base_url=echo_behind_limit, timeout=30) as client:
        for size in (0, 1, 99, 100):
            assert client.post("/", content=b"x" * size).text == str(size)
            chunked = client.post("/", content=_chunks(b"x" * size))  # no Content-Length
            assert chunked.text == str(size)
    for size in (101, 5000):  # a fresh connection each: a refused one is closed
        answer = httpx.post(echo_behind_limit, content=b"x" * size)
        assert (answer.status_code, answer.json()) == (413, too_large)
        assert answer.headers["connection"] == "close"
        answer = httpx.post(echo_behind_limit, content=_chunks(b"x" * size))
        assert (answer.status_code, answer.json()) == (413, too_large)


def test_lab_serve_max_body_is_configurable(sqlite_url: str, tmp_path: Path) -> None:
    token = make_token(sqlite_url, "w")
    server = LabServe(sqlite_url, tmp_path / "serve.log", ("--max-body", "1000")).start()
    try:
        bearer = {"Authorization": f"Bearer {token}"}
        answer = httpx.post(server.url + "/api/v1/token", headers=bearer, content=b"x" * 1001)
        _shape(answer, 413, "the request body is over the server's limit of 1000 bytes; send "
               "smaller batches, or start the server with a larger --max-body", "body")  # fmt: skip
        answer = httpx.post(server.url + "/api/v1/token", headers=bearer, content=b"x" * 1000)
        _shape(answer, 405, "POST is not allowed on /api/v1/token", None)  # under the limit
        paths = httpx.get(server.url + "/openapi.json").json()["paths"]
        if "post" in paths.get("/api/v1/batches/metrics", {}):  # a route that reads its body
            seq = {**bearer, "X-Lab-Client": "f" * 32, "X-Lab-Seq": "1"}
            answer = httpx.post(
                server.url + "/api/v1/batches/metrics", headers=seq, content=_chunks(b"x" * 1001)
            )  # no Content-Length: counted as it arrives, refused at byte 1001
            assert answer.status_code == 413
            assert answer.json()["detail"].startswith("the request body is over the server's")
    finally:
        log = server.stop()
    assert "(bodies up to 1000 bytes)" in log.splitlines()[0]


# -- HTTPS -----------------------------------------------------------------------------------


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, made by the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    warm.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def test_https_with_a_certificate_the_client_trusts(
    sqlite_url: str, tmp_path: Path, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    token = make_token(sqlite_url, "w")
    trusted = ssl.create_default_context(cafile=str(cert))
    tls = ("--ssl-certfile", str(cert), "--ssl-keyfile", str(key))
    server = LabServe(sqlite_url, tmp_path / "serve.log", tls, scheme="https")
    server.start(verify=trusted)
    try:
        bearer = {"Authorization": f"Bearer {token}"}
        answer = httpx.get(server.url + "/api/v1/token", headers=bearer, verify=trusted)
        assert answer.json() == {"name": "w", "scope": "write", "experiment": None}
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(server.url + HEALTH)  # not trusted by default
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{server.port}{HEALTH}")  # plain HTTP is not served
        # a client process told to trust it through the environment, as the docs say
        code = f"import httpx; print(httpx.get('{server.url}{HEALTH}').json())"
        probe = warm.run(
            [sys.executable, "-c", code],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "SSL_CERT_FILE": str(cert)},
        )  # fmt: skip
        assert probe.stdout.strip().startswith("{'status': 'ok', 'store': 'ok', 'schema': "), (
            probe.stderr
        )
    finally:
        log = server.stop()
    assert log.splitlines()[0].startswith(f"lab serve: {sqlite_url} at https://127.0.0.1:")


# -- the error shape -------------------------------------------------------------------------


def test_the_error_shape_over_the_served_fixture(served: Served) -> None:
    """The fixture the other server tests use answers in the same shape."""
    with served.client() as client:
        answer = client.get("/api/v1/nowhere")
        _shape(answer, 404, "no endpoint GET /api/v1/nowhere; /openapi.json lists them", None)
    answer = httpx.get(served.url + "/api/v1/token")
    _shape(answer, 401, NO_TOKEN, "header.authorization")


# -- hostile input on the write API ----------------------------------------------------------


def _rejected(answer: httpx.Response, *statuses: int) -> dict[str, Any]:
    """A rejection in the one shape, with one of `statuses`; returns its body."""
    assert answer.status_code in statuses, answer.text
    assert answer.headers["content-type"] == "application/json"
    body = answer.json()
    assert set(body) == {"detail", "field"} and "\n" not in body["detail"], body
    return body


def test_hostile_names_and_malformed_bodies_on_the_write_api(served: Served) -> None:
    """Names that look like paths or SQL are stored as names; bodies that are not JSON or not
    Arrow are a 4xx naming the body; nothing of a refused request is stored."""
    hostile = ["../../etc/passwd", "a'; DROP TABLE experiments; --", "runs/../lab.db"]

    def begin(name: Any) -> dict[str, Any]:
        return {"name": name, "config": {}, "seed": 0, "repeats": 1}

    with served.client() as client:
        for name in hostile:
            made = client.post("/api/v1/experiments", json=begin(name))
            assert made.status_code == 200, made.text
        listed = client.get("/api/v1/experiments").json()
        assert sorted(e["name"] for e in listed) == sorted(hostile)

        body = _rejected(
            client.post(
                "/api/v1/experiments",
                content=b'{"name": "x", ',
                headers={"content-type": "application/json"},
            ),
            422,
        )
        assert body["field"] == "body" and body["detail"].startswith("the body is not valid JSON")
        body = _rejected(client.post("/api/v1/experiments", json=begin(5)), 400, 422)
        assert body["field"] and "name" in body["field"]
        for name in ("", "x\x00y", "n" * 10_000):  # the Store's own name check, one line
            body = _rejected(client.post("/api/v1/experiments", json=begin(name)), 400, 422)
            assert body["field"] in ("body", "body.name"), body
        seq = {"X-Lab-Client": "f" * 32, "X-Lab-Seq": "1"}
        for junk in (b"", b"not arrow at all", b"\xff" * 64):
            answer = client.post("/api/v1/batches/metrics", content=junk, headers=seq)
            body = _rejected(answer, 400, 422)
            assert body["detail"].startswith("the body is not") and body["field"] == "body"
        bad_seq = {"X-Lab-Client": "f" * 32, "X-Lab-Seq": "0"}
        body = _rejected(client.post("/api/v1/batches/metrics", content=b"", headers=bad_seq), 400)
        assert body == {"detail": "X-Lab-seq must be a whole number >= 1",
                        "field": "header.x-lab-seq"}  # fmt: skip
        ops = {"client_id": "c", "seq": 1, "ops": [{"op": "nope", "args": {}}]}
        assert _rejected(client.post("/api/v1/batches/ops", json=ops), 400)["field"] == (
            "body.ops.0"
        )
        arm = {"name": "a", "overrides": {}, "config": {}}
        missing = client.post("/api/v1/experiments/999999/arms", json=arm)
        assert _rejected(missing, 404)["field"] == "path.experiment_id"
        assert sorted(e["name"] for e in client.get("/api/v1/experiments").json()) == sorted(
            hostile
        )
