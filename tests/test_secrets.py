"""Credentials never reach output: each failing path runs for real (a wrong PostgreSQL
password, a closed port, an ATTACH the server refuses, `lab ls --store` in a subprocess, a
Notifier posting to a loopback webhook whose path is its token), and everything it printed or
logged, at DEBUG on every logger, is searched for the secret."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import traceback
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import torch

import lab.inspect
from lab import Callback, Experiment, TrainingLoop
from lab._secrets import MaskSecrets, mask
from lab.callbacks.notify import Notifier
from lab.errors import LabError, StoreError, StoreUnreachable
from lab.loggers.console import ConsoleLogger
from lab.store import Store
from tests import warm
from tests.postgres import admin_url

LAB = str(Path(sys.executable).with_name("lab"))
ROOT = str(Path(lab.inspect.__file__).resolve().parents[1])  # this checkout, for subprocesses


def _everything(caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> str:
    """All a test printed and logged: stdout, stderr, and each record, formatted."""
    out, err = capfd.readouterr()
    records = [r.getMessage() for r in caplog.records]
    return "\n".join([out, err, caplog.text, *records])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with(url: str, **parts: Any) -> str:
    return sa.engine.make_url(url).set(**parts).render_as_string(hide_password=False)


@pytest.fixture
def debug_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)
    for name in ("lab", "httpx", "httpcore", "sqlalchemy", "duckdb"):
        caplog.set_level(logging.DEBUG, logger=name)
    return caplog


@pytest.mark.postgres
@pytest.mark.parametrize("where", ["bad password", "closed port"])
def test_a_store_that_refuses_the_password_never_shows_it(
    where: str, debug_logs: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    secret = f"Wr0ng-pw-{uuid.uuid4().hex[:8]}"
    url = _with(admin_url(), password=secret)
    if where == "closed port":
        url = _with(url, port=_closed_port())
    with pytest.raises(StoreUnreachable) as info:
        lab.inspect.connect(url)
    shown = "".join(traceback.format_exception(info.value))
    assert "postgresql+psycopg://postgres:***@127.0.0.1:" in str(info.value)
    cli = warm.run([LAB, "ls", "--store", url], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT},
                         timeout=120)  # fmt: skip
    assert cli.returncode == 1 and cli.stdout == ""
    assert cli.stderr.startswith("error: cannot reach the store at postgresql+psycopg://postgres:")
    everything = "\n".join([shown, cli.stdout, cli.stderr, _everything(debug_logs, capfd)])
    assert secret not in everything


@pytest.fixture
def limited_url(pg_url: str) -> Iterator[str]:
    """A store whose owner may hold one connection: the store's own, so DuckDB's ATTACH (a
    second one) is refused by the server, with a message that quotes its connection string."""
    role = f"lab_sec_{uuid.uuid4().hex[:8]}"
    secret = f"Att4ch-s3cret-{uuid.uuid4().hex[:8]}"
    database = sa.engine.make_url(pg_url).database
    admin = sa.create_engine(_with(pg_url, database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(
            f"CREATE ROLE {role} LOGIN PASSWORD '{secret}' CONNECTION LIMIT 1 NOSUPERUSER"
        )
        conn.exec_driver_sql(f'ALTER DATABASE "{database}" OWNER TO {role}')
    try:
        yield _with(pg_url, username=role, password=secret)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            conn.exec_driver_sql(f"DROP ROLE IF EXISTS {role}")
        admin.dispose()


@pytest.mark.postgres
def test_a_refused_attach_never_shows_the_password(
    limited_url: str, debug_logs: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    secret = sa.engine.make_url(limited_url).password
    assert secret is not None
    Store(limited_url).close()  # lab.inspect only reads: the schema is made first
    con = lab.inspect.connect(limited_url)  # auto: ATTACH is refused, Arrow copies it in
    assert con.sql("select mode from lab_source").fetchone() == ("arrow",)
    con.close()
    attached = [r.getMessage() for r in debug_logs.records if r.name == "lab.inspect"]
    assert len(attached) == 1 and "password=***" in attached[0]
    assert "too many connections for role" in attached[0]
    with pytest.raises(StoreError) as info:
        lab.inspect.connect(limited_url, mode="attach")
    message = str(info.value)
    assert message.startswith("DuckDB cannot attach the store at postgresql+psycopg://")
    assert "password=***" in message and "\n" not in message
    assert message.endswith("fix what it says, or read it through Arrow with mode='arrow'")
    shown = "".join(traceback.format_exception(info.value))
    assert secret not in shown + _everything(debug_logs, capfd)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgresql://lab:Sekr1t-pw@db:notaport/lab",
         "store URL 'postgresql://lab:***@db:notaport/lab' is not a URL; use "
         "sqlite:///path/to/lab.db or postgresql://user:password@host/dbname"),
        ("lab:Sekr1t-pw@db/lab",
         "store URL 'lab:***@db/lab' is not a URL; use sqlite:///path/to/lab.db or "
         "postgresql://user:password@host/dbname"),
        ("postgresql://lab:Sekr1t-pw@127.0.0.1:1/lab?bogus=1",
         'cannot connect to the store at postgresql+psycopg://lab:***@127.0.0.1:1/lab?bogus=1 '
         '(invalid connection option "bogus"); fix LAB_STORE_URL / the store URL'),
    ],
    ids=["bad port", "no scheme", "unknown option"],
)  # fmt: skip
def test_a_malformed_store_url_is_one_line_without_its_password(
    url: str, message: str, capfd: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(LabError) as info:
        lab.inspect.connect(url)
    assert str(info.value) == message
    cli = warm.run([LAB, "ls", "--store", url], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)  # fmt: skip
    assert (cli.returncode, cli.stdout, cli.stderr) == (1, "", f"error: {message}\n")


class _Webhook:
    """A loopback webhook whose path is its token, as Slack's are."""

    def __init__(self, status: int) -> None:
        self.token = f"T0/B0/{uuid.uuid4().hex}"
        self.bodies: list[dict[str, Any]] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                hook.bodies.append(json.loads(self.rfile.read(length)))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/{self.token}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("status", [200, 500])
def test_the_notifier_never_shows_its_webhook_token(
    status: int, debug_logs: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    hook = _Webhook(status)
    try:
        notifier = Notifier(hook.url, on="both")
        assert notifier.post("run r0 failed") is (status == 200)
    finally:
        hook.stop()
    refused = Notifier(f"http://127.0.0.1:{_closed_port()}/services/{hook.token}x")
    assert refused.post("nobody listens") is False
    assert hook.bodies == [{"text": "run r0 failed"}]
    everything = _everything(debug_logs, capfd) + repr(notifier) + repr(refused)
    port = hook.server.server_address[1]
    assert f"HTTP Request: POST http://127.0.0.1:{port}/*** " in everything  # httpx logs it
    assert hook.token not in everything


def test_mask_hides_each_kind_of_credential() -> None:
    cases = {
        "postgresql+psycopg://lab:pw%40x@db:5432/lab": "postgresql+psycopg://lab:***@db:5432/lab",
        "host=db port=5432 password='a b\\'c' dbname=x": "host=db port=5432 password=*** dbname=x",
        'ATTACH "host=h password=hunter2 user=u"': 'ATTACH "host=h password=*** user=u"',
        "{'password': 'hunter2'}": "{'password': '***'}",
        "Authorization: Bearer eyJhbGciOi.x-y": "Authorization: Bearer ***",
        "authorization: Basic dXNlcjpwYXNz": "authorization: Basic ***",
        "GET https://api.x/v1?token=abc123&page=2": "GET https://api.x/v1?token=***&page=2",
        "POST https://hooks.slack.com/services/T1/B2/xyz": "POST https://hooks.slack.com/services/***",
        "https://discord.com/api/webhooks/1/abc": "https://discord.com/api/webhooks/***",
        "http://chat.example.com/hooks/q1w2e3": "http://chat.example.com/hooks/***",
        "store URL 'lab:hunter2@db/lab'": "store URL 'lab:***@db/lab'",
        '{"token": "abc", "api_key": "k"}': '{"token": "***", "api_key": "***"}',
        "401 for hf_" + "a1B2" * 9 + " at the hub": "401 for *** at the hub",
        "git: ghp_" + "Z9y8" * 9 + " expired": "git: *** expired",
        "aws AKIAIOSFODNN7EXAMPLE denied": "aws *** denied",
        # secret-named name=value and name: value pairs, as a command line or a config has them
        "train.py --api-key=abc token=xyz": "train.py --api-key=*** token=***",
        "WANDB_API_KEY=k HF_TOKEN='a b' db.password=\"p w\"": (
            "WANDB_API_KEY=*** HF_TOKEN=*** db.password=***"
        ),
        "passwd: zz pwd=p1 passphrase=p2": "passwd: *** pwd=*** passphrase=***",
        "aws_access_key_id=AK1 private_key=k2": "aws_access_key_id=*** private_key=***",
        "x-auth-token: Bearer t1 credentials=c2": "x-auth-token: Bearer *** credentials=***",
        "--hub hf_abcdefghijklmnop ghp_0123456789abcdef": "--hub *** ***",
    }
    assert {text: mask(text) for text in cases} == cases
    plain = [
        "sqlite:////tmp/lab.db, http://host:8080/x@y",
        "a basic token budget; password reset",
        "use postgresql://user:password@host/dbname",  # a usage hint's placeholder
        "hf_hub_download failed; task-sk-1 ran",
        "python train.py --epochs 3 arms.lr=0.1 --author=me --tokenizer=gpt2 --tokens 8",
        "token budget: 8 tokens; secrets are masked; hf_transfer is on",
    ]
    assert [mask(text) for text in plain] == plain


def test_mask_leaves_the_words_of_a_sentence_and_masks_values() -> None:
    where = "lab serve at http://127.0.0.1:8765"
    sentences = [
        f"{where} needs a token: set LAB_TOKEN (make one on the server's store with: lab "
        "token create NAME --scope write)",
        f"{where} refused the token in LAB_TOKEN: it is wrong or revoked; make one with lab "
        "token create NAME --scope write on the server's store",
        "no token: every endpoint but /api/v1/health needs Authorization: Bearer <token> (make "
        "one with lab token create NAME --scope read|write)",
    ]
    assert [mask(text) for text in sentences] == sentences
    values = {  # a value stays masked: a pair after it, a longer word, a digit, a capital
        "passwd: zz pwd=p1": "passwd: *** pwd=***",
        "token: hunter2 for db": "token: *** for db",
        "token: hunter for db": "token: *** for db",
        "LAB_TOKEN: Set it": "LAB_TOKEN: *** it",
        "token: it": "token: ***",
        "password=set it": "password=*** it",
        "Authorization: Bearer <token>x": "Authorization: Bearer ***",
    }
    assert {text: mask(text) for text in values} == values


def test_the_cli_says_what_a_token_needs_in_whole_words(tmp_path: Path) -> None:
    from tests.served import serve

    served = serve(f"sqlite:///{tmp_path / 'lab.db'}")
    try:
        env = {k: v for k, v in os.environ.items() if k != "LAB_TOKEN"}
        env["PYTHONPATH"] = ROOT
        where, argv = f"lab serve at {served.url}", [LAB, "ls", "--store", served.url]
        none = warm.run(argv, capture_output=True, text=True, env=env, timeout=120)
        assert (none.returncode, none.stdout, none.stderr) == (1, "", (
            f"error: {where} needs a token: set LAB_TOKEN (make one on the server's store "
            "with: lab token create NAME --scope write)\n"
        ))  # fmt: skip
        wrong = "lab_" + "x" * 43  # the form of a token, but none the server made
        env["LAB_TOKEN"] = wrong
        refused = warm.run(argv, capture_output=True, text=True, env=env, timeout=120)
        assert (refused.returncode, refused.stdout, refused.stderr) == (1, "", (
            f"error: {where} refused the token in LAB_TOKEN: it is wrong or revoked; make one "
            "with lab token create NAME --scope write on the server's store\n"
        ))  # fmt: skip
    finally:
        served.stop()


class _Leaky(Callback):
    """A callback whose failure quotes a credential, as a driver's error would."""

    def on_train_start(self, state: Any) -> None:
        raise RuntimeError("cannot post to https://api.example.com/v1?token=cb-s3cret-tok")


def test_a_run_error_quoting_a_password_is_masked_everywhere_it_goes(
    store_url: str, debug_logs: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    secret = "run-s3cret-pw"

    def train(run: Any) -> Any:
        model = torch.nn.Linear(1, 1)
        loop = TrainingLoop(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            [torch.ones(1, 1)], lambda m, b: m(b).sum(), 1,
                            callbacks=[_Leaky()], checkpoint=None)  # fmt: skip
        loop.fit(run)
        raise ConnectionError(f"cannot open postgresql://me:{secret}@db.internal/x")

    hook = _Webhook(200)
    try:
        result = Experiment(
            "leak",
            train,
            store=store_url,
            strict=False,
            callbacks=[ConsoleLogger(), Notifier(hook.url, on="failure")],
        ).run()
    finally:  # fmt: skip
        hook.stop()
    assert (
        result.runs[0].error
        == f"ConnectionError: cannot open postgresql://me:{secret}@db.internal/x"
    )
    store = Store(store_url)
    try:
        [run] = store.get_experiment("leak")["runs"]
    finally:
        store.close()
    assert run["error"] == "ConnectionError: cannot open postgresql://me:***@db.internal/x"
    assert [f["error"] for f in run["callback_errors"]] == [
        "RuntimeError: cannot post to https://api.example.com/v1?token=***"
    ]
    stored = json.dumps(run, default=str)
    assert secret not in stored and "cb-s3cret-tok" not in stored
    [body] = hook.bodies
    assert body["text"].startswith(":x: lab: run base-r0 of leak failed after ")
    assert body["text"].endswith("(arm base, repeat 0): ConnectionError: cannot open "
                                 "postgresql://me:***@db.internal/x")  # fmt: skip
    everything = _everything(debug_logs, capfd)
    assert "error: ConnectionError: cannot open postgresql://me:***@db.internal/x" in everything
    assert secret not in everything and "cb-s3cret-tok" not in everything


def test_every_lab_logger_masks() -> None:
    """A filter applies only to the logger it is on, not to its children: each lab module's
    logger must come from `lab._secrets.logger`, or its records would go out unmasked."""
    import importlib
    import pkgutil

    for module in pkgutil.walk_packages(lab.__path__, "lab."):
        importlib.import_module(module.name)
    names = [n for n in logging.root.manager.loggerDict if n == "lab" or n.startswith("lab.")]
    loggers = [logging.getLogger(n) for n in names if not isinstance(
        logging.root.manager.loggerDict[n], logging.PlaceHolder)]  # fmt: skip
    assert len(loggers) >= 10
    unmasked = sorted(g.name for g in loggers if not any(isinstance(f, MaskSecrets)
                                                         for f in g.filters))  # fmt: skip
    assert unmasked == [], f"log through lab._secrets.logger(...) in: {unmasked}"
    source = Path(lab.__file__).parent
    files = [p for p in source.rglob("*.py") if p.name != "_secrets.py"]
    assert [str(p) for p in files if "logging.getLogger(" in p.read_text()] == []
