"""A recorded run from a plain script, as `wandb.init` or `mlflow.start_run` give one.

``with lab.start_run("mnist", config={"lr": 0.01}) as run:`` creates the experiment, group
and run rows (through the same callbacks and store an `Experiment` uses), fires the
experiment-level hooks too, and hands back the `RunSpec` a `train(run)` function would get:
drive a `RunHandle` (or a `TrainingLoop`) with it. Leaving the block records the run as
`completed` (or `stopped`, when a callback stopped it); an exception records it as `failed`
with its traceback, and then goes on, so the script still fails.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pydantic

from lab.errors import CallbackError, ConfigError
from lab.experiment import Arm, Experiment
from lab.hooks import Callback
from lab.lifecycle import RunScope, close, experiment_scope, start_group
from lab.records import FINISHED, RunResult, RunSpec

#: Set to 1 (or true, yes) to silence the line `start_run` prints on stderr.
QUIET_ENV = "LAB_QUIET"


def script(run: RunSpec) -> None:
    """The train function a script's run is recorded under (its body is the `with` block)."""
    raise RuntimeError("a run started with lab.start_run trains in its with-block")


def _as_model(config: pydantic.BaseModel | Mapping[str, Any] | None) -> pydantic.BaseModel | None:
    if config is None or isinstance(config, pydantic.BaseModel):
        return config
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"config={config!r}: pass a dict of settings or a pydantic model instance"
        )
    fields: dict[str, Any] = {}
    for key, value in config.items():
        if not isinstance(key, str) or not key.isidentifier() or key.startswith("_"):
            raise ConfigError(
                f"config key {key!r}: use names that are Python identifiers without a leading "
                "underscore (run.config.<name> reads them)"
            )
        fields[key] = (Any, value)
    model = pydantic.create_model(
        "RunConfig", __config__=pydantic.ConfigDict(extra="forbid", frozen=True), **fields
    )
    return model()


@contextlib.contextmanager
def start_run(
    experiment: str,
    *,
    config: pydantic.BaseModel | Mapping[str, Any] | None = None,
    arm: str = "main",
    repeat: int = 0,
    seed: int = 0,
    callbacks: Sequence[Callback] = (),
    store: Any = None,
    output_dir: str | Path = "runs",
    tags: Sequence[str] = (),
    notes: str | None = None,
    fresh: bool = False,
    strict: bool | None = None,
    quiet: bool | None = None,
) -> Iterator[RunSpec]:
    """Record the `with` block as one run of `experiment`: arm `arm`, repeat `repeat`.

    The run is seeded with ``seed + repeat``, its folder is
    ``<output_dir>/<experiment>/<arm>-r<repeat>``, and `config` (a dict, or a pydantic model)
    is its config (``run.config.lr``). The store is the argument, else ``LAB_STORE_URL``,
    else ``sqlite:///lab.db`` (``store=False``: none). Running the script again continues
    the run when it did not finish (a `RunHandle` with checkpoints resumes it), and refuses
    one that finished, or whose config changed: pass ``fresh=True`` to train it again (the
    old run is kept as superseded), or another `repeat` for another seed.

    As the block starts, one line on stderr says where the run is recorded and the command
    that shows it (``lab: recording run main-r0 of mnist in sqlite:///lab.db; look at it:
    lab show mnist``), as wandb prints its run's address; ``quiet=True`` (default: the
    environment variable ``LAB_QUIET=1``) leaves it out. Nothing is printed without a store.

    >>> import lab, torch  # doctest: +SKIP
    >>> with lab.start_run("sketch", config={"lr": 0.1}) as run:  # doctest: +SKIP
    ...     model = torch.nn.Linear(2, 1)
    ...     opt = torch.optim.SGD(model.parameters(), lr=run.config.lr)
    ...     with lab.RunHandle(run, model, opt, num_steps=3) as loop:
    ...         for step in loop.steps():
    ...             loop.end_step({"loss": 1.0 / step})
    """
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 0:
        raise ConfigError(f"repeat={repeat!r}: use an int >= 0")
    exp = Experiment(
        experiment, script, arms=[Arm(arm)], repeats=repeat + 1, base_config=_as_model(config),
        callbacks=callbacks, store=store, output_dir=output_dir, seed=seed, strict=strict,
        tags=tags, notes=notes, fresh=fresh,
    )  # fmt: skip
    with _recorded(exp, repeat, quiet) as spec:
        yield spec


@contextlib.contextmanager
def _recorded(exp: Experiment, repeat: int, quiet: bool | None) -> Iterator[RunSpec]:
    """The one run of a script's experiment, from `on_experiment_start` to `close`, around
    the `with` block; a run that finished before is refused."""
    experiment = exp.name
    exp._only_repeat = repeat
    exp.n_runs = 1
    hooks, ctx, result = exp._open()
    arm_result = result.arms[0]
    run_key = exp._plan()[0][0]
    prior = exp._prior.get(run_key)
    if prior is not None and prior["status"] in FINISHED:
        close(hooks)
        raise ConfigError(
            f"run {run_key!r} of experiment {experiment!r} {prior['status']} "
            "before; pass fresh=True to train it again (the old run is kept, superseded), "
            f"or repeat={repeat + 1} for another run"
        )
    with experiment_scope(hooks, ctx, result, interrupted=_interrupted):
        start_group(hooks, ctx, exp.group(ctx, exp.chains()[0]))
        job = exp._job(ctx, exp.arms[0], repeat, 0, None)
        assert not isinstance(job, RunResult)  # a finished run was refused above
        scope = RunScope(job, hooks, arm_result)
        error: BaseException | None = None
        try:
            spec = scope.open()
            if exp._sink is not None and not _quiet(quiet):
                _say_where(exp._sink.open(), experiment, run_key)
            yield spec
            scope.trained(scope.spec.artifacts)
        except CallbackError:
            raise
        except BaseException as exc:
            error = exc
            scope.failed(exc)
        run_result = scope.close()
        exp.release(job.run_key, run_result.error)
        if error is not None:
            raise error


def _interrupted(exc: BaseException) -> str | None:
    """The experiment's error when the block raised `exc`: none for a run that failed (the
    run records it), the interrupt's for Ctrl-C or SIGTERM."""
    return None if isinstance(exc, Exception) else f"interrupted ({type(exc).__name__})"


def _quiet(quiet: bool | None) -> bool:
    if quiet is not None:
        return quiet
    return os.environ.get(QUIET_ENV, "").lower() in {"1", "true", "yes"}


def _say_where(store: Any, experiment: str, run_key: str) -> None:
    """The line on stderr: the store (its password hidden), the run, and how to look at it;
    ``--store`` is named when the store is not the one `lab show` opens by default."""
    from lab.store.engine import resolve_url

    url = getattr(store, "url", None)
    if url is None:  # a store of the program's own, without a URL
        return
    url = resolve_url(url)
    show = ["lab", "show", experiment]
    if str(url) != str(resolve_url(None)):
        show += ["--store", url.shown]
    print(
        f"lab: recording run {run_key} of {experiment} in {url.shown}; look at it: "
        f"{shlex.join(show)}",
        file=sys.stderr,
        flush=True,
    )
