"""`Notifier` against a real HTTP server on loopback: exact payloads, and a webhook that
fails (500, too slow, nobody listening) never fails the run, even in strict mode."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import lab
from lab import Arm, Experiment
from lab.callbacks import build
from lab.callbacks.notify import Notifier
from lab.errors import ConfigError


class Webhook:
    """A loopback HTTP server that records each POSTed JSON body and answers as told."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.status = 200
        self.delay_s = 0.0
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                hook.bodies.append(json.loads(self.rfile.read(length)))
                time.sleep(hook.delay_s)
                try:
                    self.send_response(hook.status)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                except OSError:  # the client gave up (timeout) and closed the socket
                    pass

            def log_message(self, *args: Any) -> None:  # keep pytest output clean
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/T0/B0/secret"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def texts(self) -> list[str]:
        return [b["text"] for b in self.bodies]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    yield hook
    hook.stop()


def _train(run: lab.RunSpec) -> dict[str, float]:
    if run.arm == "bad" and run.repeat == 1:
        raise RuntimeError("diverged")
    return {"loss": 0.5 + run.repeat}


def _experiment(notifier: Notifier, name: str = "sweep") -> lab.ExperimentResult:
    return Experiment(
        name,
        _train,
        arms=[Arm("good"), Arm("bad")],
        repeats=2,
        callbacks=[notifier],
        store=False,
        strict=True,
    ).run()


def test_both_posts_each_failed_run_and_the_experiment_end(webhook: Webhook) -> None:
    notifier = Notifier(webhook.url, on="both")
    result = _experiment(notifier)
    assert result.status == "failed"
    texts = webhook.texts()
    assert len(texts) == 2, texts
    assert all(set(b) == {"text"} for b in webhook.bodies)  # Slack's minimal payload
    assert texts[0].startswith(":x: lab: run bad-r1 of sweep failed after ")
    assert texts[0].endswith("(arm bad, repeat 1): RuntimeError: diverged")
    first, *rest = texts[1].splitlines()
    assert first.startswith(":x: lab: experiment sweep failed in ")
    assert first.endswith(": 4 runs (3 completed, 1 failed)")
    assert rest == ["- bad-r1: RuntimeError: diverged"]
    assert notifier.sent == 2 and notifier.failed == 0


def test_failure_only_and_end_only(webhook: Webhook) -> None:
    _experiment(Notifier(webhook.url, on="failure"))
    assert [t.split(" failed")[0] for t in webhook.texts()] == [":x: lab: run bad-r1 of sweep"]
    webhook.bodies.clear()
    _experiment(Notifier(webhook.url, on="end"), name="sweep2")
    assert len(webhook.texts()) == 1
    assert webhook.texts()[0].startswith(":x: lab: experiment sweep2 failed")


def test_a_completed_experiment_says_so(webhook: Webhook) -> None:
    def ok(run: lab.RunSpec) -> dict[str, float]:
        return {"loss": 1.0}

    Experiment("fine", ok, repeats=2, callbacks=[Notifier(webhook.url)], store=False).run()
    (text,) = webhook.texts()  # no failure, so only the end message
    assert text.startswith(":white_check_mark: lab: experiment fine completed in ")
    assert text.endswith(": 2 runs (2 completed)")


def test_a_500_does_not_fail_the_run(webhook: Webhook, caplog: pytest.LogCaptureFixture) -> None:
    webhook.status = 500
    notifier = Notifier(webhook.url, on="both")
    with caplog.at_level(logging.WARNING, logger="lab.notify"):
        result = _experiment(notifier)  # strict: a callback error would raise here
    assert [r.status for r in result.runs] == ["completed", "completed", "completed", "failed"]
    assert all(not r.callback_errors for r in result.runs) and not result.callback_errors
    assert len(webhook.bodies) == 2  # both were sent; neither was accepted
    assert notifier.sent == 0 and notifier.failed == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "lab.notify"]
    assert len(warnings) == 2 and "HTTPStatusError" in warnings[0]
    assert all("secret" not in w for w in warnings)  # the token stays out of the log


def test_a_slow_webhook_times_out_without_failing_the_run(webhook: Webhook) -> None:
    webhook.delay_s = 1.0
    notifier = Notifier(webhook.url, on="end", timeout_s=0.2)
    started = time.perf_counter()
    result = _experiment(notifier)
    assert time.perf_counter() - started < 0.9  # it gave up, it did not wait for the answer
    assert len(result.runs) == 4 and not result.callback_errors
    assert len(webhook.bodies) == 1 and notifier.failed == 1 and notifier.sent == 0


def test_a_refused_connection_does_not_fail_the_run() -> None:
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    notifier = Notifier(f"http://127.0.0.1:{port}/hook", on="both", timeout_s=1)
    result = _experiment(notifier)
    assert len(result.runs) == 4 and notifier.failed == 2 and notifier.sent == 0


def test_config_is_checked_and_registered(webhook: Webhook) -> None:
    (built,) = build([{"kind": "notifier", "params": {"url": webhook.url, "on": "failure"}}])
    assert isinstance(built, Notifier) and built.on == "failure" and built.timeout_s == 5.0
    assert "secret" not in repr(built)
    with pytest.raises(ConfigError, match="on"):
        build([{"kind": "notifier", "params": {"url": webhook.url, "on": "always"}}])
    with pytest.raises(ConfigError, match="http"):
        Notifier("hooks.slack.com/services/x")
    with pytest.raises(ConfigError, match="timeout_s"):
        Notifier(webhook.url, timeout_s=0)


def test_a_bare_loop_posts_as_an_experiment_of_one_run(webhook: Webhook) -> None:
    import torch

    from lab import TrainingLoop

    def fit(notifier: Notifier, fail_at: int | None, run_dir: str) -> None:
        model = torch.nn.Linear(2, 1)

        def loss_fn(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
            loss_fn.calls += 1  # type: ignore[attr-defined]
            if loss_fn.calls == fail_at:  # type: ignore[attr-defined]
                raise RuntimeError("nan in the batch")
            return m(b).pow(2).mean()

        loss_fn.calls = 0  # type: ignore[attr-defined]
        loop = TrainingLoop(
            model, torch.optim.SGD(model.parameters(), lr=0.1), [torch.ones(4, 2)], loss_fn, 3,
            callbacks=[notifier],
        )  # fmt: skip
        loop.fit(run_dir=run_dir)

    fit(Notifier(webhook.url, on="both"), None, "ok-run")
    with pytest.raises(RuntimeError, match="nan in the batch"):
        fit(Notifier(webhook.url, on="both"), 2, "bad-run")
    fit(Notifier(webhook.url, on="failure"), None, "quiet")  # nothing: it did not fail
    with pytest.raises(RuntimeError):
        fit(Notifier(webhook.url, on="end"), 1, "quiet-too")  # only its end
    # a bare fit is an experiment of one run: the messages are an Experiment's
    exp = r"loop-\d{8}-\d{6}-[0-9a-f]{6}"
    texts = webhook.texts()
    assert len(texts) == 4
    assert re.fullmatch(
        rf":white_check_mark: lab: experiment {exp} completed in [\d.]+s: 1 run \(1 completed\)",
        texts[0],
    )
    assert re.fullmatch(
        rf":x: lab: run bad-run of {exp} failed after [\d.]+s \(arm loop, repeat 0\): "
        "RuntimeError: nan in the batch",
        texts[1],
    )
    for text, run_key in ((texts[2], "bad-run"), (texts[3], "quiet-too")):
        assert re.fullmatch(
            rf":x: lab: experiment {exp} failed in [\d.]+s: 1 run \(1 failed\)\n"
            rf"- {run_key}: RuntimeError: nan in the batch",
            text,
        )
