"""Metric names, checked before training: who declares a name, who needs it, and typos.

A metric name that something needs (``EarlyStopping("val/loss")``, a checkpoint's
``CheckpointConfig(metric=...)``, an experiment file's ``summary.metric``) but nothing logs
would otherwise fail silently (early stopping that never fires) or late (a summary that
fails after every run has trained). So the sources of metrics declare what they log:

- the loop: ``loss``, ``lr``, ``grad_norm``, ``step_time`` (`LOOP_METRICS`), and the keys of
  the dict its `loss_fn` returns when ``TrainingLoop(loss_metrics=[...])`` names them;
- an evaluator: ``Evaluator("val", fn, metrics=["loss", "acc"])``, stored as ``val/loss``...;
- a callback: its `metrics_logged` (exact keys or glob patterns such as ``throughput/*``).

and whoever needs a name says so in `metrics_needed` ({name: who needs it}).

When the fit starts, each needed name is looked up. Declared: fine. No source could log it
(a name ``<eval>/<key>`` whose evaluator declares its keys; another name when the loss
function declares its keys too): a `ConfigError` before the first step, naming the close
matches. A source that
did not declare its keys might log it: the name is watched, and the first eval of its
evaluator (or, for a step metric, the first step) that lacks it logs one WARNING with the
close matches; after that first look the watch is gone, so a step pays nothing for it.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lab._secrets import logger
from lab.errors import ConfigError

log = logger("lab.loop")

__all__ = ["LOOP_METRICS", "MetricWatch", "check_metric_names", "close_matches", "logged_by",
           "needed_by", "watch_names"]  # fmt: skip

#: The step metrics the loop itself logs at every step.
LOOP_METRICS: tuple[str, ...] = ("loss", "lr", "grad_norm", "step_time")


def needed_by(sources: Iterable[Any]) -> dict[str, str]:
    """{metric name: who needs it} from the `metrics_needed` of each source (a callback)."""
    out: dict[str, str] = {}
    for source in sources:
        needed = getattr(source, "metrics_needed", None) or {}
        if not isinstance(needed, Mapping):
            needed = {name: type(source).__name__ for name in needed}
        for name, who in needed.items():
            out.setdefault(name, who)
    return out


def logged_by(sources: Iterable[Any]) -> list[str]:
    """The names and patterns the sources (callbacks) declare in `metrics_logged`."""
    return [p for source in sources for p in getattr(source, "metrics_logged", ()) or ()]


def close_matches(name: str, known: Iterable[str]) -> list[str]:
    """The known names closest to `name` (difflib), best first: what a typo probably meant."""
    return difflib.get_close_matches(name, sorted(set(known)), n=3, cutoff=0.6)


def _did_you_mean(name: str, known: Iterable[str], otherwise: str) -> str:
    """``did you mean 'val/loss'?`` when a known name is close, else `otherwise`."""
    matches = close_matches(name, known)
    return f"did you mean {' or '.join(repr(m) for m in matches)}?" if matches else otherwise


def check_metric_names(
    needed: Mapping[str, str],
    *,
    step_metrics: Sequence[str],
    step_open: bool,
    evals: Mapping[str, Sequence[str] | None],
) -> MetricWatch | None:
    """Check each needed name against what the sources declare, before the first step.

    `step_metrics` are the declared step keys and patterns (the loop's, the loss function's,
    the callbacks'); `step_open` says the loss function did not declare its keys, so any
    name may still be one of them. `evals` maps each in-loop evaluator to its declared keys
    (None: not declared). Raises `ConfigError` for a name nothing could log; returns a
    `MetricWatch` for the names only a run can settle, or None when there are none.
    """
    declared = [*step_metrics, *(f"{e}/{k}" for e, keys in evals.items() for k in keys or ())]
    later: dict[str, str] = {}
    for name, who in needed.items():
        if any(fnmatch.fnmatchcase(name, p) for p in declared):
            continue
        prefix, _, key = name.partition("/")
        if key and prefix in evals:  # an eval's metric: its evaluator alone logs it
            if evals[prefix] is None:
                later[name] = who
                continue
        elif step_open:  # a step metric the loss function may log
            later[name] = who
            continue
        fix = _did_you_mean(name, declared, "fix the name, or declare its source")
        raise ConfigError(
            f"{who}: no evaluator, loss function or callback logs metric {name!r}; {fix} "
            f"(declared: {', '.join(sorted(set(declared)))})"
        )
    return MetricWatch(later, evals) if later else None


class MetricWatch:
    """Needed names that no source declared: each is looked for once, at the first step (a
    step metric) or the first eval of its evaluator, and a WARNING says when it is absent.

    The loop calls `after_step` only while `at_step` holds names (the first step), and
    `after_eval` for each eval; neither allocates when there is nothing to check.
    """

    def __init__(self, names: Mapping[str, str], evals: Mapping[str, Any]) -> None:
        self.at_step: dict[str, str] = {}
        self.at_eval: dict[str, dict[str, str]] = {}
        for name, who in names.items():
            prefix, _, key = name.partition("/")
            if key and prefix in evals:
                self.at_eval.setdefault(prefix, {})[name] = who
            else:
                self.at_step[name] = who

    def after_step(self, step_idx: int, metrics: Mapping[str, float]) -> None:
        """Look for the step metrics in the first step's metrics (callbacks' keys included)."""
        names, self.at_step = self.at_step, {}
        for name, who in names.items():
            if name not in metrics:
                log.warning(
                    "%s: step %d logged no metric %r (it logged: %s); %s",
                    who, step_idx, name, ", ".join(sorted(metrics)),
                    _did_you_mean(name, metrics, "fix the name, or log it"),
                )  # fmt: skip

    def after_eval(
        self, eval_name: str, step_idx: int, metrics: Mapping[str, float], steps: Mapping[str, Any]
    ) -> None:
        """Look for the names of eval `eval_name` in its first result (or the step's
        metrics, where a loss function may log such a name too)."""
        names = self.at_eval.pop(eval_name, None)
        if not names:
            return
        for name, who in names.items():
            key = name.partition("/")[2]
            if key in metrics or name in steps:
                continue
            stored = [f"{eval_name}/{k}" for k in metrics]
            log.warning(
                "%s: eval %r at step %d logged no %r (it logged: %s); %s",
                who, eval_name, step_idx, key, ", ".join(sorted(metrics)),
                _did_you_mean(name, stored, "fix the name, or log it"),
            )  # fmt: skip


def watch_names(
    callbacks: Sequence[Any],
    checkpoint: Any,
    declared: Sequence[str] | None,
    step_open: bool,
    evaluators: Sequence[Any],
) -> MetricWatch | None:
    """Look up every metric name the callbacks and the checkpoint config need in what the
    loop (`declared`, and others when `step_open`), the evaluators and the callbacks
    declare; the watch for what only a step or an eval can tell, or None."""
    needed = needed_by(callbacks)
    if checkpoint is not None and checkpoint.metric is not None:
        metric = checkpoint.metric
        needed.setdefault(metric, f"CheckpointConfig(metric={metric!r})")
    if not needed:
        return None
    return check_metric_names(
        needed,
        step_metrics=[*(declared or ()), *logged_by(callbacks)],
        step_open=step_open,
        evals={ev.name: ev.metrics for ev in evaluators},
    )
