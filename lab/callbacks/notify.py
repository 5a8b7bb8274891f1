"""`Notifier`: posts a Slack-compatible message to a webhook when runs fail or an experiment ends.

A notification is a convenience, never part of the record: a webhook that answers 500, times
out or refuses the connection is logged as a warning and the run goes on, even in strict
mode (the error is caught inside the callback, so the dispatcher never sees it). `httpx` is
imported when the first message is sent, so the module imports without it
(``pip install 'lab[notify]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit

import pydantic

from lab._imports import require
from lab._secrets import logger, mask, register_url
from lab._table import plural
from lab.callbacks.params import PositiveFloat
from lab.callbacks.registry import register
from lab.hooks import Callback, LogContext, Phase
from lab.records import FAILED

if TYPE_CHECKING:
    from lab.records import ArmResult, ExperimentResult, RunResult

log = logger("lab.notify")

NotifyOn = Literal["end", "failure", "both"]
ON_CHOICES: tuple[str, ...] = ("end", "failure", "both")


def _webhook_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError("give an http(s) webhook URL")
    return url


#: An http(s) URL with a host.
WebhookUrl = Annotated[str, pydantic.AfterValidator(_webhook_url)]


@register("notifier")
class Notifier(Callback):
    """Posts ``{"text": ...}`` to a webhook (Slack, Mattermost, Discord's /slack endpoint).

    `on` chooses the messages: ``"failure"`` posts once per failed run, at its `on_run_end`,
    so a long sweep tells you as soon as something breaks; ``"end"`` posts once at
    `on_experiment_end`, whatever the status, with the run counts and the failed runs;
    ``"both"`` (the default) does both. Each post waits at most `timeout_s` seconds, so a
    dead webhook costs a sweep seconds, not hours. It runs in `Phase.NOTIFY`, after the
    store has recorded what the message reports. A bare `TrainingLoop.fit` (no Experiment)
    is an experiment of one run (``loop-<time>-<hex6>``), so it gets the same messages.
    """

    phase = Phase.NOTIFY

    def __init__(
        self, url: WebhookUrl, on: NotifyOn = "both", timeout_s: PositiveFloat = 5.0
    ) -> None:
        require("httpx", "notify", "Notifier")
        register_url(url)  # httpx logs each request's URL: its path is the token
        self.url = url
        self.on: NotifyOn = on
        self.timeout_s = float(timeout_s)
        self.sent = 0  # messages the webhook accepted (2xx)
        self.failed = 0  # messages that did not get through

    def __repr__(self) -> str:
        # The webhook URL is a secret (its path is the token): show the host only.
        return f"Notifier(host={urlsplit(self.url).netloc!r}, on={self.on!r})"

    # -- hooks ---------------------------------------------------------------------------
    def on_run_end(self, ctx: LogContext, run_result: RunResult, arm: ArmResult) -> None:
        if self.on == "end" or run_result.status not in FAILED:
            return
        where = f" (arm {run_result.arm}, repeat {run_result.repeat})"
        self.post(
            f":x: lab: run {run_result.run_key} of {ctx.experiment} failed after "
            f"{run_result.seconds:.1f}s{where}: {run_result.error or 'no error recorded'}"
        )

    def on_experiment_end(self, ctx: LogContext, result: ExperimentResult) -> None:
        if self.on == "failure":
            return
        self.post(experiment_message(result))

    # -- sending -------------------------------------------------------------------------
    def post(self, text: str) -> bool:
        """Send `text` (credentials masked); True if the webhook accepted it. Never raises for
        a webhook problem."""
        import httpx  # lazily: only a configured notifier needs it

        register_url(self.url)  # again: a copy unpickled in a worker process skips __init__
        payload: dict[str, Any] = {"text": mask(text)}  # a run's error may quote a password
        try:
            response = httpx.post(self.url, json=payload, timeout=self.timeout_s)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            self.failed += 1
            # Only the host: the URL's path is the webhook's token.
            log.warning(
                "Notifier: the webhook at %s did not take the message (%s: %s); the run goes on",
                urlsplit(self.url).netloc,
                type(exc).__name__,
                _short(exc, self.url),
            )
            return False
        self.sent += 1
        return True


def experiment_message(result: ExperimentResult) -> str:
    """The end-of-experiment text: status, run counts by status, wall time, failed runs."""
    runs = result.runs
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.status] = counts.get(r.status, 0) + 1
    statuses = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no runs"
    icon = ":white_check_mark:" if result.status == "completed" else ":x:"
    lines = [
        f"{icon} lab: experiment {result.name} {result.status} in {result.seconds:.1f}s: "
        f"{plural(len(runs), 'run')} ({statuses})"
    ]
    if result.error:
        lines.append(f"interrupted: {result.error}")
    lines += [f"- {r.run_key}: {r.error}" for r in runs if r.status in FAILED]
    return "\n".join(lines)


def _short(exc: BaseException, url: str) -> str:
    """The first line of `exc`, with the webhook URL (a secret) blanked out."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return mask(text.replace(url, "<webhook>"))
