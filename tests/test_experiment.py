"""Experiments: arm configs, repeats and seeds, failures, run folders, and the summary."""

from __future__ import annotations

import doctest
import importlib
import math
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import pytest
import torch
from scipy import stats

import lab
from lab import Arm, Callback, Experiment
from lab._stats import spread, t_ppf
from lab.errors import ConfigError
from lab.experiment import safe_name
from tests import warm
from tests.recorder import Labels


class ModelConfig(pydantic.BaseModel):
    width: int = 4
    depth: int = 1


class Config(pydantic.BaseModel):
    lr: float = 0.1
    steps: int = 3
    name: str = "base"
    model: ModelConfig = ModelConfig()


class Seen(Callback):
    """Records what the experiment-level hooks saw."""

    def __init__(self) -> None:
        self.groups: list[tuple[str, str | None]] = []
        self.runs: list[tuple[str | None, str | None, dict | None]] = []
        self.errors: list[tuple[str | None, BaseException]] = []
        self.ended: list[tuple[str, str]] = []

    def on_group_start(self, ctx: lab.LogContext, group_name: str) -> None:
        self.groups.append((group_name, ctx.group_name))

    def on_run_start(self, ctx: lab.LogContext) -> None:
        self.runs.append((ctx.run_key, ctx.group_name, ctx.run_config))

    def on_error(self, ctx: lab.LogContext, exc: BaseException) -> None:
        self.errors.append((ctx.run_key, exc))

    def on_run_end(self, ctx: lab.LogContext, run_result: lab.RunResult, arm: Any) -> None:
        self.ended.append((run_result.run_key, run_result.status))


# --------------------------------------------------------------------------------------------
# arms and their configs


def test_arm_overrides_apply_to_the_base_config() -> None:
    configs: dict[str, Config] = {}

    def train(run: lab.RunSpec) -> None:
        configs[run.arm] = run.config

    seen = Seen()
    base = Config()
    Experiment(
        "arms",
        train,
        base_config=base,
        arms=[Arm("plain"), Arm("fast", lr=0.5, steps=2), Arm("wide", **{"model.width": 16})],
        callbacks=[seen],
        store=False,
    ).run()

    assert configs["plain"] == Config()
    assert configs["fast"] == Config(lr=0.5, steps=2)
    assert configs["wide"] == Config(model=ModelConfig(width=16))
    assert all(type(c) is Config for c in configs.values())
    assert type(configs["wide"].model) is ModelConfig
    assert base == Config()  # the base is not modified
    assert [r[2] for r in seen.runs] == [
        {"lr": 0.1, "steps": 3, "name": "base", "model": {"width": 4, "depth": 1}},
        {"lr": 0.5, "steps": 2, "name": "base", "model": {"width": 4, "depth": 1}},
        {"lr": 0.1, "steps": 3, "name": "base", "model": {"width": 16, "depth": 1}},
    ]


def test_override_values_are_validated_and_coerced() -> None:
    exp = Experiment(
        "coerce", lambda run: None, base_config=Config(), arms=[Arm("s", steps="5")], store=False
    )
    assert exp.configs["s"].steps == 5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"lrr": 0.1}, "arm 'bad': 'lrr' is not a field of Config; valid fields: lr, steps,"),
        ({"model.wdth": 3}, "'wdth' is not a field of ModelConfig"),
        ({"lr.x": 3}, "'lr' of Config is not a nested config, so 'lr.x' cannot be set"),
        ({"lr": "fast"}, "arm 'bad': lr='fast' is invalid: Input should be a valid number"),
        ({"model.width": "wide"}, "arm 'bad': model.width='wide' is invalid"),
    ],
)
def test_bad_override_fails_at_construction(overrides: dict[str, Any], message: str) -> None:
    calls: list[Any] = []
    with pytest.raises(ConfigError) as info:
        Experiment(
            "bad",
            calls.append,
            base_config=Config(),
            arms=[Arm("ok"), Arm("bad", **overrides)],
            store=False,
        )
    assert message in str(info.value)
    assert calls == []


def test_overrides_without_base_config_fail() -> None:
    with pytest.raises(ConfigError, match=r"arm 'x' overrides \['lr'\] but the experiment has no"):
        Experiment("nobase", lambda run: None, arms=[Arm("x", lr=0.1)], store=False)


def test_duplicate_arm_names_fail() -> None:
    with pytest.raises(ConfigError, match=r"duplicate arm names \['a'\]"):
        Experiment(
            "dup", lambda run: None, base_config=Config(), arms=[Arm("a"), Arm("b"), Arm("a")]
        )


@pytest.mark.parametrize("name", ["", "   ", None, 3])
def test_arm_needs_a_name(name: Any) -> None:
    with pytest.raises(ConfigError, match="an arm needs a non-empty name"):
        Arm(name)


@pytest.mark.parametrize("repeats", [0, -1, 1.5, True, "2"])
def test_repeats_must_be_a_positive_int(repeats: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"repeats={repeats!r}: use an int >= 1")):
        Experiment("rep", lambda run: None, repeats=repeats, store=False)


def test_other_construction_errors() -> None:
    with pytest.raises(ConfigError, match="non-empty name"):
        Experiment("", lambda run: None, store=False)
    with pytest.raises(ConfigError, match="train must be a function"):
        Experiment("x", "not callable", store=False)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="base_config must be a pydantic model instance"):
        Experiment("x", lambda run: None, base_config={"lr": 1}, store=False)  # type: ignore


# --------------------------------------------------------------------------------------------
# repeats, seeds and groups


def test_each_repeat_is_seeded_with_seed_plus_repeat() -> None:
    draws: dict[str, tuple[int, int, float, float, float]] = {}

    def train(run: lab.RunSpec) -> dict[str, float]:
        draws[run.run_key] = (
            run.seed,
            run.ctx.seed,
            random.random(),
            float(np.random.rand()),
            torch.rand(1).item(),
        )
        return {}

    result = Experiment(
        "seeds", train, arms=[Arm("a"), Arm("b")], repeats=3, seed=10, store=False
    ).run()

    assert [r.seed for r in result.runs] == [10, 11, 12, 10, 11, 12]
    for arm in ("a", "b"):
        for repeat in range(3):
            seed = 10 + repeat
            expected = (
                seed,
                seed,
                random.Random(seed).random(),
                float(np.random.RandomState(seed).rand()),
                torch.rand(1, generator=torch.Generator().manual_seed(seed)).item(),
            )
            assert draws[f"{arm}-r{repeat}"] == expected
    # a different seed gives different draws (the comparison above can fail)
    assert draws["a-r0"][2:] != draws["a-r1"][2:]


def test_a_group_per_arm_even_with_one_repeat() -> None:
    seen = Seen()
    result = Experiment(
        "groups",
        lambda run: None,
        arms=[Arm("a"), Arm("b"), Arm("c")],
        callbacks=[seen],
        store=False,
    ).run()
    assert seen.groups == [("a", "a"), ("b", "b"), ("c", "c")]
    assert [(key, group) for key, group, _ in seen.runs] == [
        ("a-r0", "a"),
        ("b-r0", "b"),
        ("c-r0", "c"),
    ]
    assert [(a.name, len(a.runs)) for a in result.arms] == [("a", 1), ("b", 1), ("c", 1)]


def test_runs_have_their_own_ids_and_order() -> None:
    result = Experiment(
        "order", lambda run: {"r": run.repeat}, arms=[Arm("x"), Arm("y")], repeats=2, store=False
    ).run()
    assert [(r.arm, r.repeat, r.run_key, r.stage, r.metrics) for r in result.runs] == [
        ("x", 0, "x-r0", 0, {"r": 0.0}),
        ("x", 1, "x-r1", 0, {"r": 1.0}),
        ("y", 0, "y-r0", 0, {"r": 0.0}),
        ("y", 1, "y-r1", 0, {"r": 1.0}),
    ]


# --------------------------------------------------------------------------------------------
# failures


def test_a_failing_run_is_recorded_and_the_others_continue() -> None:
    seen = Seen()

    def train(run: lab.RunSpec) -> dict[str, float]:
        if run.arm == "b" and run.repeat == 0:
            raise ValueError(f"bad {run.run_key}")
        return {"loss": 1.0 + run.repeat}

    result = Experiment(
        "fail", train, arms=[Arm("a"), Arm("b")], repeats=2, callbacks=[seen], store=False
    ).run()

    assert [(r.run_key, r.status) for r in result.runs] == [
        ("a-r0", "completed"),
        ("a-r1", "completed"),
        ("b-r0", "failed"),
        ("b-r1", "completed"),
    ]
    failed = result.runs[2]
    assert failed.error == "ValueError: bad b-r0"
    assert failed.metrics == {}
    assert failed.traceback is not None
    assert failed.traceback.startswith("Traceback (most recent call last):")
    assert 'raise ValueError(f"bad {run.run_key}")' in failed.traceback
    assert failed.traceback.rstrip().endswith("ValueError: bad b-r0")
    assert all(r.error is None and r.traceback is None for i, r in enumerate(result.runs) if i != 2)

    assert len(seen.errors) == 1
    key, exc = seen.errors[0]
    assert key == "b-r0"
    assert type(exc) is ValueError and str(exc) == "bad b-r0"
    assert seen.ended == [(r.run_key, r.status) for r in result.runs]
    assert result.status == "failed"
    s = result.summary()
    assert (s.row("a", "loss").n, s.row("b", "loss").n) == (2, 1)
    assert s.runs_by_status == {"completed": 3, "failed": 1}


def test_train_returning_a_bad_type_fails_the_run() -> None:
    result = Experiment("badret", lambda run: "oops", store=False).run()
    (run,) = result.runs
    assert run.status == "failed"
    assert run.error == (
        "TypeError: train returned str; return loop.fit(run), a dict of final metrics, or None"
    )


def test_loss_error_inside_train_fails_only_that_run() -> None:
    def train(run: lab.RunSpec) -> lab.LoopArtifacts:
        model = torch.nn.Linear(2, 1)
        loop = lab.TrainingLoop(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            [torch.ones(8, 2)],
            lambda m, x: m(x).squeeze(1) if run.repeat == 0 else m(x).mean(),
            2,
        )
        return loop.fit(run)

    result = Experiment("lossfail", train, repeats=2, store=False).run()
    assert [r.status for r in result.runs] == ["failed", "completed"]
    assert result.runs[0].error == (
        "LossError: loss_fn returned a tensor of shape (8,); "
        "reduce it to a scalar first, e.g. loss.mean()"
    )


# --------------------------------------------------------------------------------------------
# run keys and folders


_NASTY = ["../../x", "a b", "a/b", "..", ".", "x", "a-b", "a\\b", "ü", "-x-", "a" * 200]


def test_run_keys_and_folders_are_path_safe_and_distinct(tmp_path: Path) -> None:
    dirs: dict[str, Path] = {}

    def train(run: lab.RunSpec) -> None:
        dirs[run.arm] = run.dir
        (run.dir / "marker").write_text(run.arm)

    out = tmp_path / "out"
    result = Experiment(
        "../../evil name", train, arms=[Arm(n) for n in _NASTY], store=False, output_dir=out
    ).run()

    keys = [r.run_key for r in result.runs]
    assert len(set(keys)) == len(_NASTY)
    exp_dir = (out / safe_name("../../evil name")).resolve()
    assert exp_dir.parent == out.resolve()
    for run in result.runs:
        assert re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", run.run_key), run.run_key
        assert len(run.run_key) <= 80
        folder = dirs[run.arm].resolve()
        assert folder.parent == exp_dir
        assert folder.name == run.run_key
        assert (folder / "marker").read_text() == run.arm
    assert keys[_NASTY.index("x")] == "x-r0"  # safe names are kept as they are
    assert keys[_NASTY.index("a-b")] == "a-b-r0"
    # everything written stayed inside output_dir
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_safe_name_examples() -> None:
    assert safe_name("small") == "small"
    assert safe_name("../../x") == "x-9bdbf20b"
    assert safe_name("..").startswith("x-")
    assert safe_name("a b") != safe_name("a-b") == "a-b"


def test_arms_whose_folders_would_collide_are_rejected() -> None:
    # "../../x" becomes "x-9bdbf20b": an arm literally named that would share its folder
    with pytest.raises(ConfigError, match="would share the run folder 'x-9bdbf20b'"):
        Experiment("clash", lambda run: None, arms=[Arm("../../x"), Arm("x-9bdbf20b")])
    # folders that differ only in case collide on case-insensitive filesystems
    with pytest.raises(ConfigError, match="arms 'Adam' and 'adam' would share the run folder"):
        Experiment("clash", lambda run: None, arms=[Arm("Adam"), Arm("adam")])


# --------------------------------------------------------------------------------------------
# the summary

_ACC = {"a": [0.70, 0.72, 0.75], "b": [0.80, 0.81, 0.85]}
_LOSS = {"a": [0.50, 0.40, 0.45], "b": [0.30, 0.35, 0.20]}


def _summary_result() -> lab.ExperimentResult:
    def train(run: lab.RunSpec) -> dict[str, float]:
        return {"acc": _ACC[run.arm][run.repeat], "loss": _LOSS[run.arm][run.repeat]}

    return Experiment("summ", train, arms=[Arm("a"), Arm("b")], repeats=3, store=False).run()


def test_summary_matches_scipy() -> None:
    summary = _summary_result().summary("acc", mode="max")
    assert [(r.arm, r.metric) for r in summary.rows] == [
        ("a", "acc"),
        ("a", "loss"),
        ("b", "acc"),
        ("b", "loss"),
    ]
    for arm, metric, values in [
        (arm, metric, table[arm])
        for arm in ("a", "b")
        for metric, table in (("acc", _ACC), ("loss", _LOSS))
    ]:
        row = summary.row(arm, metric)
        vals = np.array(values)
        low, high = stats.t.interval(0.95, df=len(vals) - 1, loc=vals.mean(), scale=stats.sem(vals))
        assert row.n == 3
        assert row.mean == pytest.approx(vals.mean(), rel=1e-12)
        assert row.std == pytest.approx(vals.std(ddof=1), rel=1e-12)
        assert row.ci_low == pytest.approx(low, rel=1e-9)
        assert row.ci_high == pytest.approx(high, rel=1e-9)
    assert summary.metric == "acc"
    assert summary.best_arm == "b"
    assert summary.runner_up == "a"
    assert summary.margin == pytest.approx(np.mean(_ACC["b"]) - np.mean(_ACC["a"]), rel=1e-12)
    assert summary.runs == 6
    assert summary.runs_by_status == {"completed": 6}
    assert summary.to_dicts()[0] == {
        "arm": "a",
        "metric": "acc",
        "n": 3,
        "mean": summary.rows[0].mean,
        "std": summary.rows[0].std,
        "ci_low": summary.rows[0].ci_low,
        "ci_high": summary.rows[0].ci_high,
    }


def test_summary_best_arm_by_mode() -> None:
    result = _summary_result()
    assert result.summary("acc", mode="max").best_arm == "b"
    assert result.summary("acc", mode="min").best_arm == "a"
    assert result.summary("loss", mode="max").best_arm == "a"
    default = result.summary()  # loss, min
    assert (default.metric, default.mode, default.best_arm, default.runner_up) == (
        "loss",
        "min",
        "b",
        "a",
    )


def test_summary_text_is_a_readable_table() -> None:
    text = str(_summary_result().summary("acc", mode="max"))
    lines = text.splitlines()
    assert lines[0] == "summ: 6 runs (6 completed)"
    assert lines[1].split() == ["arm", "metric", "n", "mean", "std", "95%", "CI"]
    body = [line.split()[:4] for line in lines[2:6]]
    assert body == [
        ["a", "acc", "3", "0.7233"],
        ["a", "loss", "3", "0.45"],
        ["b", "acc", "3", "0.82"],
        ["b", "loss", "3", "0.2833"],
    ]
    # columns line up: each row's metric cell starts under the "metric" header
    at = lines[1].index("metric")
    assert [line[at:].split()[0] for line in lines[2:6]] == ["acc", "loss", "acc", "loss"]
    assert lines[6] == "best arm by acc (max): b (0.82), ahead of a by 0.09667"
    assert len(lines) == 7


def test_summary_errors_and_single_repeat() -> None:
    result = _summary_result()
    with pytest.raises(ConfigError, match="no run has a final metric 'f1'; known: acc, loss"):
        result.summary("f1")
    with pytest.raises(ConfigError, match="mode='best'"):
        result.summary("acc", mode="best")  # type: ignore[arg-type]

    single = Experiment("one", lambda run: {"loss": 0.25}, store=False).run().summary()
    row = single.row("base", "loss")
    assert (row.n, row.mean) == (1, 0.25)
    assert math.isnan(row.std) and math.isnan(row.ci_low) and math.isnan(row.ci_high)
    assert single.best_arm == "base"
    assert single.runner_up is None and single.margin is None
    with pytest.raises(KeyError):
        single.row("base", "acc")


def test_summary_without_loss_names_no_best_arm() -> None:
    s = Experiment("noloss", lambda run: {"acc": 0.5}, store=False).run().summary()
    assert s.metric is None
    assert s.best_arm is None
    assert "best arm" not in str(s)


# --------------------------------------------------------------------------------------------
# statistics


@pytest.mark.parametrize("q", [0.0005, 0.025, 0.05, 0.5, 0.6, 0.9, 0.95, 0.975, 0.995])
def test_t_ppf_matches_scipy(q: float) -> None:
    for df in range(1, 61):
        expected = stats.t.ppf(q, df)
        assert t_ppf(q, df) == pytest.approx(expected, rel=1e-9, abs=1e-9), df


def test_t_ppf_known_values_and_bounds() -> None:
    assert t_ppf(0.975, 1) == pytest.approx(12.706204736174698, rel=1e-10)
    assert t_ppf(0.975, 30) == pytest.approx(2.0422724563012373, rel=1e-10)
    for q in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            t_ppf(q, 5)


def test_spread_matches_scipy_and_handles_small_n() -> None:
    values = [1.0, 2.0, 4.0, 8.0]
    s = spread(values)
    low, high = stats.t.interval(0.95, df=3, loc=np.mean(values), scale=stats.sem(values))
    assert (s.n, s.mean) == (4, 3.75)
    assert s.std == pytest.approx(np.std(values, ddof=1), rel=1e-12)
    assert (s.ci_low, s.ci_high) == (pytest.approx(low, rel=1e-9), pytest.approx(high, rel=1e-9))
    assert s.half_width == pytest.approx((high - low) / 2, rel=1e-9)
    s90 = spread(values, confidence=0.9)
    assert s90.ci_high == pytest.approx(
        stats.t.interval(0.9, df=3, loc=3.75, scale=stats.sem(values))[1], rel=1e-9
    )
    empty = spread([])
    assert empty.n == 0 and math.isnan(empty.mean)
    same = spread([2.0, 2.0, 2.0])
    assert (same.std, same.ci_low, same.ci_high) == (0.0, 2.0, 2.0)


@pytest.mark.parametrize("module", ["lab.experiment", "lab.loop.training", "lab.loop.evals"])
def test_docstring_examples_run(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0
    assert result.failed == 0


# --------------------------------------------------------------------------------------------
# the store is checked before anything runs; interrupts close the record


class Everything(
    Labels,
    hooks=("on_experiment_start", "on_run_start", "on_error", "on_run_end",
           "on_experiment_end", "close"),
):  # fmt: skip
    """Records every experiment-level hook by name; an error by its class alone."""

    def note(self, hook: str, *args: Any, **kwargs: Any) -> str:
        if hook == "on_error":
            return f"{hook}:{type(args[1]).__name__}"
        return super().note(hook, *args, **kwargs)


def test_an_unreachable_store_stops_the_experiment_before_any_hook(tmp_path: Path) -> None:
    from lab.errors import StoreUnreachable

    calls: list[Any] = []
    seen = Everything()
    exp = Experiment("u", calls.append, callbacks=[seen], output_dir=tmp_path,
                     store="postgresql://postgres:lab@127.0.0.1:1/x", strict=False)  # fmt: skip
    with pytest.raises(StoreUnreachable) as info:
        exp.run()
    assert "\n" not in str(info.value) and "start the server" in str(info.value)
    assert calls == [] and seen.calls == []


def test_a_newer_schema_stops_the_experiment_and_keeps_the_data(tmp_path: Path) -> None:
    import sqlite3

    from lab.errors import SchemaTooNew

    url = f"sqlite:///{tmp_path / 'lab.db'}"
    Experiment("old", lambda run: {"loss": 1.0}, store=url, output_dir=tmp_path).run()
    con = sqlite3.connect(tmp_path / "lab.db")
    con.execute("UPDATE alembic_version SET version_num = 'ffff'")
    con.commit()
    calls: list[Any] = []
    with pytest.raises(SchemaTooNew, match="pip install -U lab"):
        Experiment("new", calls.append, store=url, output_dir=tmp_path).run()
    assert calls == []
    assert con.execute("SELECT name, status FROM experiments").fetchall() == [("old", "completed")]
    assert con.execute("SELECT count(*) FROM runs").fetchone() == (1,)
    con.close()


def test_an_interrupt_records_the_run_and_experiment_as_failed_then_propagates(
    tmp_path: Path,
) -> None:
    import sqlite3

    def train(run: lab.RunSpec) -> dict[str, float]:
        if run.repeat == 1:
            raise KeyboardInterrupt
        return {"loss": 1.0}

    seen = Everything()
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    with pytest.raises(KeyboardInterrupt):
        Experiment("ctrl-c", train, repeats=3, callbacks=[seen], store=url,
                   output_dir=tmp_path).run()  # fmt: skip
    assert seen.calls == [
        "on_experiment_start",
        "on_run_start:base-r0",
        "on_run_end:base-r0:completed",
        "on_run_start:base-r1",
        "on_error:KeyboardInterrupt",
        "on_run_end:base-r1:failed",
        "on_experiment_end:failed",
        "close",
    ]
    con = sqlite3.connect(tmp_path / "lab.db")
    assert con.execute("SELECT status FROM experiments").fetchall() == [("failed",)]
    assert con.execute("SELECT run_key, status, error FROM runs ORDER BY run_id").fetchall() == [
        ("base-r0", "completed", None),
        ("base-r1", "failed", "interrupted (KeyboardInterrupt)"),
    ]
    con.close()


def test_summary_keys_limit_the_rows() -> None:
    result = Experiment(
        "keys", lambda run: {"loss": 1.0 + run.repeat, "acc": 0.5, "lr": 0.1}, repeats=2,
        store=False,
    ).run()  # fmt: skip
    summary = result.summary("loss", keys=("loss", "acc"))
    assert [(r.arm, r.metric) for r in summary.rows] == [("base", "loss"), ("base", "acc")]
    assert summary.best_arm == "base"
    with pytest.raises(ConfigError, match="no run has a final metric 'nope'; known: acc, loss, lr"):
        result.summary(keys=("nope",))


# --------------------------------------------------------------------------------------------
# running an experiment again: finished runs (completed or stopped) are skipped


class StopAtStep(Callback):
    """Stops training early, as `EarlyStopping` does, once `step` is done."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(
        self, state: lab.LoopState, step_idx: int, batch: lab.TrainingBatch, metrics: dict
    ) -> None:
        if step_idx == self.step:
            state.request_stop("no improvement")


class Trained(Callback):
    """Records the run and training hooks it gets."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_run_start(self, ctx: lab.LogContext) -> None:
        self.calls.append(f"on_run_start:{ctx.run_key}")

    def on_train_start(self, state: lab.LoopState) -> None:
        self.calls.append(f"on_train_start:{state.ctx.run_key}:{state.step}")

    def on_run_end(self, ctx: lab.LogContext, run_result: lab.RunResult, arm: Any) -> None:
        self.calls.append(f"on_run_end:{run_result.run_key}:{run_result.status}")


def _train_stopping(run: lab.RunSpec) -> lab.LoopArtifacts:
    g = torch.Generator().manual_seed(run.seed)
    x = torch.randn(8, 2, generator=g)
    model = torch.nn.Linear(2, 1)
    loop = lab.TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        [(x, x.sum(1, keepdim=True))],
        lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        10,
        callbacks=[StopAtStep(3 + run.repeat)],
        checkpoint=lab.CheckpointConfig(every=2, save_at_end=True),
    )
    return loop.fit(run)


def _checkpoint_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "checkpoints" in p.parts
    }


def test_a_run_stopped_early_is_not_trained_again(sqlite_url: str, tmp_path: Path) -> None:
    import sqlite3

    def experiment(seen: Trained) -> lab.ExperimentResult:
        return Experiment("stops", _train_stopping, repeats=2, callbacks=[seen],
                          store=sqlite_url, output_dir=tmp_path / "out").run()  # fmt: skip

    first_seen = Trained()
    first = experiment(first_seen)
    assert [(r.run_key, r.status, r.artifacts.step) for r in first.runs] == [  # type: ignore[union-attr]
        ("base-r0", "stopped", 3),
        ("base-r1", "stopped", 4),
    ]
    assert first_seen.calls == [
        "on_run_start:base-r0", "on_train_start:base-r0:0", "on_run_end:base-r0:stopped",
        "on_run_start:base-r1", "on_train_start:base-r1:0", "on_run_end:base-r1:stopped",
    ]  # fmt: skip
    files = _checkpoint_files(tmp_path / "out")
    assert sorted(k for k in files if k.endswith("training_info.json")) == [
        "stops/base-r0/checkpoints/step_000002/training_info.json",
        "stops/base-r0/checkpoints/step_000003/training_info.json",
        "stops/base-r1/checkpoints/step_000002/training_info.json",
        "stops/base-r1/checkpoints/step_000004/training_info.json",
    ]
    con = sqlite3.connect(tmp_path / "lab.db")
    rows = "SELECT run_key, status, summary FROM runs ORDER BY run_id"
    stored = con.execute(rows).fetchall()
    metric_rows = con.execute("SELECT count(*) FROM metrics").fetchone()

    second_seen = Trained()
    second = experiment(second_seen)
    assert second_seen.calls == []  # nothing trains again: no run hook fires at all
    assert [(r.run_key, r.status, r.seconds) for r in second.runs] == [
        ("base-r0", "stopped", 0.0),
        ("base-r1", "stopped", 0.0),
    ]
    assert [r.metrics for r in second.runs] == [r.metrics for r in first.runs]
    assert second.status == "completed"
    assert second.summary().runs_by_status == {"stopped": 2}
    assert second.summary().row("base", "loss").n == 2  # their results join the summary
    assert _checkpoint_files(tmp_path / "out") == files  # the same checkpoints, untouched
    assert con.execute(rows).fetchall() == stored  # statuses and summaries unchanged
    assert con.execute("SELECT count(*) FROM metrics").fetchone() == metric_rows
    con.close()


# --------------------------------------------------------------------------------------------
# the caller's generators


def _draw_all() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_a_run_puts_the_callers_generators_back() -> None:
    seen: list[tuple[float, float, float]] = []

    def train(run: lab.RunSpec) -> dict[str, float]:
        seen.append(_draw_all())  # the run draws from its own seed, and moves every generator
        return {}

    _seed_all(123)
    _draw_all()
    expected = _draw_all()  # what the caller draws next without an experiment in between
    _seed_all(123)
    _draw_all()
    Experiment("rng", train, repeats=2, seed=5, store=False).run()
    assert _draw_all() == expected
    # the runs kept their own seeding: seed + repeat, whatever the caller had drawn
    for repeat, draws in enumerate(seen):
        _seed_all(5 + repeat)
        assert draws == _draw_all()


def test_a_random_search_gets_a_fresh_draw_after_each_run() -> None:
    def train(run: lab.RunSpec) -> dict[str, float]:
        return {"loss": run.config.lr * torch.rand(1).item()}

    random.seed(0)
    without_runs = [10 ** random.uniform(-3, -0.5) for _ in range(4)]
    random.seed(0)
    drawn = []
    for i in range(4):
        lr = 10 ** random.uniform(-3, -0.5)
        drawn.append(lr)
        Experiment(f"search-{i}", train, base_config=Config(lr=lr), store=False).run()
    assert drawn == without_runs
    assert len(set(drawn)) == 4


def test_a_failing_run_also_puts_the_callers_generators_back() -> None:
    def train(run: lab.RunSpec) -> None:
        random.random()
        raise RuntimeError("boom")

    _seed_all(9)
    expected = _draw_all()
    _seed_all(9)
    result = Experiment("rng-fail", train, store=False).run()
    assert result.runs[0].status == "failed"
    assert _draw_all() == expected


# --------------------------------------------------------------------------------------------
# intervals for bounded metrics


def _numpy_bootstrap(values: list[float]) -> tuple[float, float]:
    """The exact percentile bootstrap: the mean of every one of the n**n ordered resamples."""
    import itertools

    n = len(values)
    means = [np.mean([values[i] for i in idx]) for idx in itertools.product(range(n), repeat=n)]
    low, high = np.quantile(means, [0.025, 0.975], method="inverted_cdf")
    return float(low), float(high)


@pytest.mark.parametrize(
    "values",
    [[0.5, 0.7], [0.5, 0.7, 0.65], [0.1, 0.2, 0.4, 0.35], [0.91, 0.93, 0.97, 0.99, 1.0]],
)
def test_bootstrap_over_few_repeats_is_exact(values: list[float]) -> None:
    s = spread(values, interval="bootstrap")
    low, high = _numpy_bootstrap(values)
    assert (s.ci_low, s.ci_high) == (pytest.approx(low, rel=1e-12), pytest.approx(high, rel=1e-12))
    assert s.mean == pytest.approx(np.mean(values), rel=1e-12)
    assert s.std == pytest.approx(np.std(values, ddof=1), rel=1e-12)
    assert min(values) <= s.ci_low <= s.ci_high <= max(values)
    assert spread(values[::-1], interval="bootstrap") == s  # the order of the runs is no matter


def test_bootstrap_over_many_repeats_is_seeded_and_leaves_the_callers_rng() -> None:
    values = [0.6 + 0.013 * ((7 * i) % 23) for i in range(30)]
    random.seed(4)
    expected = random.random()
    random.seed(4)
    s = spread(values, interval="bootstrap")
    assert random.random() == expected
    assert spread(values, interval="bootstrap") == s  # the same every time
    theirs = stats.bootstrap(
        (values,), np.mean, method="percentile", n_resamples=10_000, random_state=0
    ).confidence_interval
    sem = stats.sem(values)
    assert s.ci_low == pytest.approx(theirs.low, abs=0.1 * sem)
    assert s.ci_high == pytest.approx(theirs.high, abs=0.1 * sem)


def test_t_interval_is_clipped_to_declared_bounds() -> None:
    values = [0.98, 0.99, 1.0]
    low, high = stats.t.interval(0.95, df=2, loc=np.mean(values), scale=stats.sem(values))
    assert high > 1.0  # the plain t interval leaves [0, 1]
    plain = spread(values)
    assert (plain.ci_low, plain.ci_high) == (pytest.approx(low), pytest.approx(high))
    bounded = spread(values, bounds=(0, 1))
    assert (bounded.ci_low, bounded.ci_high) == (pytest.approx(low), 1.0)
    assert (bounded.mean, bounded.std) == (plain.mean, plain.std)
    nan = spread([0.5, math.nan], bounds=(0, 1))  # NaN is data: no interval, no error
    assert math.isnan(nan.mean) and math.isnan(nan.ci_low) and math.isnan(nan.ci_high)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval": "wilson"}, "interval='wilson': use 't' (Student's t) or 'bootstrap' "
                                 "(percentile bootstrap over repeats, for bounded metrics such "
                                 "as accuracies)"),
        ({"bounds": (1, 0)}, "bounds of 'acc'=(1, 0): give (low, high) with low < high, e.g. "
                             "(0, 1) for an accuracy or (0, inf) for a loss"),
        ({"bounds": (0, 1, 2)}, "bounds of 'acc'=(0, 1, 2): give (low, high)"),
        ({"bounds": (0, 0.5)}, "metric 'acc' has 0.7 outside bounds=(0, 0.5); declare the "
                               "metric's real range, or leave bounds out"),
    ],
)  # fmt: skip
def test_bad_interval_or_bounds_is_one_line(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        spread([0.7, 0.72], metric="acc", **kwargs)
    assert str(err.value).startswith(message)


def test_experiment_summary_with_bootstrap_and_bounds() -> None:
    result = _summary_result()
    summary = result.summary("acc", "max", interval="bootstrap", bounds={"acc": (0, 1)})
    for arm in ("a", "b"):
        row = summary.row(arm, "acc")
        assert (row.ci_low, row.ci_high) == pytest.approx(_numpy_bootstrap(_ACC[arm]), rel=1e-12)
        loss = summary.row(arm, "loss")  # no bounds declared for loss: bootstrap all the same
        assert (loss.ci_low, loss.ci_high) == pytest.approx(_numpy_bootstrap(_LOSS[arm]), rel=1e-12)
    assert str(summary).splitlines()[1].split()[-3:] == ["95%", "CI", "(bootstrap)"]
    assert summary.best_arm == "b"
    with pytest.raises(ConfigError, match="no run has a final metric 'acc '; known: acc, loss"):
        result.summary(bounds={"acc ": (0, 1)})
    with pytest.raises(ConfigError, match=r"bounds=\(0, 1\): give a dict of metric ranges"):
        result.summary(bounds=(0, 1))  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_run_puts_the_callers_cuda_generator_back() -> None:
    def train(run: lab.RunSpec) -> dict[str, float]:
        return {"x": torch.rand(1, device="cuda").item()}

    torch.cuda.manual_seed_all(11)
    torch.rand(1, device="cuda")  # CUDA is initialized and its generator has moved
    state = torch.cuda.get_rng_state_all()
    expected = torch.rand(1, device="cuda").item()
    torch.cuda.set_rng_state_all(state)
    Experiment("cuda-rng", train, repeats=2, store=False).run()
    assert torch.rand(1, device="cuda").item() == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_run_that_initializes_cuda_leaves_the_callers_seed(tmp_path: Path) -> None:
    """CUDA not yet initialized by the caller: afterwards its generator starts from the seed
    the caller gave torch.manual_seed, as if no run had happened (a fresh process)."""
    import sys

    script = (
        "import torch, lab\n"
        "torch.manual_seed(21)\n"
        "if {run}:\n"
        "    lab.Experiment('c', lambda run: {{'x': torch.rand(1, device='cuda').item()}},\n"
        "                   store=False, output_dir={out!r}).run()\n"
        "print(repr(torch.rand(1, device='cuda').item()))\n"
    )
    draws = [
        warm.run(
            [sys.executable, "-c", script.format(run=run, out=str(tmp_path))],
            capture_output=True, text=True, check=True, timeout=300,
        ).stdout.strip()
        for run in (False, True)
    ]  # fmt: skip
    assert draws[0] == draws[1]
