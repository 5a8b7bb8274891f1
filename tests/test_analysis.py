"""`lab.inspect`'s analysis functions: hand-chosen stores, checked against scipy and by hand."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
import pytest
from matplotlib.figure import Figure
from scipy import stats

import lab.inspect
from lab import Arm, EvalResult, Experiment, RunSpec
from lab.errors import ConfigError
from lab.store import Store

NAN = math.nan


@dataclass
class Run:
    """One run to record: its points per key ({step: value}), status, seed and evals."""

    arm: str
    repeat: int
    points: dict[str, dict[int, float]] = field(default_factory=dict)
    status: str = "completed"
    seed: int | None = None  # default: the repeat, as Experiment seeds them (seed + i)
    stage: int = 0
    evals: list[tuple[EvalResult, list[dict[str, Any]]]] = field(default_factory=list)

    @property
    def run_key(self) -> str:
        return f"{self.arm}-r{self.repeat}" + (f"-s{self.stage}" if self.stage else "")


def finals(**values: float) -> dict[str, dict[int, float]]:
    """Points that end at step 10 with these values."""
    return {key: {1: 100.0, 10: value} for key, value in values.items()}


def record(url: str, runs: list[Run], name: str = "exp", arms: tuple[str, ...] = ()) -> None:
    """Record `runs` (and any extra `arms`) through the Store API, as SqlLogger would."""
    store = Store(url)
    try:
        eid = store.begin_experiment(name, config={}, seed=0, repeats=1)
        ids = {}
        for arm in arms or tuple(dict.fromkeys(r.arm for r in runs)):
            arm_id = store.add_arm(eid, arm, overrides={}, config={})
            ids[arm] = (arm_id, store.add_group(eid, arm, arm_id=arm_id))
        for run in runs:
            arm_id, group_id = ids[run.arm]
            run_id = store.start_run(
                eid, group_id, run_key=run.run_key, arm_id=arm_id, repeat=run.repeat,
                stage=run.stage, seed=run.repeat if run.seed is None else run.seed,
                config={}, output_dir=None,
            )  # fmt: skip
            for step in sorted({s for series in run.points.values() for s in series}):
                row = {k: v[step] for k, v in run.points.items() if step in v}
                store.log_metrics(run_id, step, row)
            for result, preds in run.evals:
                store.write_eval(run_id, result, predictions=preds)
            store.flush()
            if run.status != "running":
                store.finish_run(run_id, status=run.status)
    finally:
        store.close()


def t_interval(values: list[float]) -> tuple[float, float]:
    """scipy's 95% t interval of the mean of `values`."""
    mean, sem = statistics.fmean(values), stats.sem(values)
    return stats.t.interval(0.95, len(values) - 1, loc=mean, scale=sem)


def close(a: float | None, b: float | None) -> bool:
    if a is None or b is None or (isinstance(a, float) and math.isnan(a)):
        return (a is None or math.isnan(a)) and (b is None or math.isnan(b))
    return a == pytest.approx(b, rel=1e-9, abs=1e-12)


def rows(rel: Any) -> list[dict[str, Any]]:
    return [dict(zip(rel.columns, r, strict=True)) for r in rel.fetchall()]


# -- summary ----------------------------------------------------------------------------------

SUMMARY_VALUES = {
    "a": [1.0, 2.0, 4.0],
    "b": [0.5, 0.7, 0.6, 0.9],  # the last one stopped: it counts
    "c": [3.0],  # one repeat: no spread
    "d": [NAN, 1.0],  # a diverged run: NaN mean, no rank
}


def summary_runs() -> list[Run]:
    runs = [
        Run(arm, i, finals(loss=v), status="stopped" if (arm, i) == ("b", 3) else "completed")
        for arm, values in SUMMARY_VALUES.items()
        for i, v in enumerate(values)
    ]
    runs.append(Run("a", 3, finals(loss=-50.0), status="failed"))  # left out
    runs.append(Run("a", 4, finals(loss=-50.0), status="running"))  # left out
    runs.append(Run("a", 5, finals(loss=-50.0), status="crashed"))  # left out
    runs.append(Run("e", 0, finals(loss=-50.0), status="failed"))  # arm e: nothing counts
    return runs


@pytest.mark.parametrize("mode", ["attach", "arrow"])
def test_summary_matches_scipy(store_url: str, mode: str) -> None:
    record(store_url, summary_runs())
    con = lab.inspect.connect(store_url, mode=mode)  # type: ignore[arg-type]
    rel = lab.inspect.summary(con, "exp", "loss")
    assert rel.columns == [
        "arm", "n", "mean", "std", "ci_low", "ci_high", "rank", "is_best", "margin"
    ]  # fmt: skip
    got = rows(rel)
    assert [r["arm"] for r in got] == ["a", "b", "c", "d", "e"]  # the experiment's order
    for row in got[:3]:
        values = SUMMARY_VALUES[row["arm"]]
        assert row["n"] == len(values)
        assert close(row["mean"], statistics.fmean(values))
        if len(values) > 1:
            low, high = t_interval(values)
            assert close(row["std"], statistics.stdev(values))
            assert close(row["ci_low"], low) and close(row["ci_high"], high)
        else:
            assert row["std"] is None and row["ci_low"] is None and row["ci_high"] is None
    d, e = got[3], got[4]
    assert d["n"] == 2 and math.isnan(d["mean"]) and math.isnan(d["std"]) and d["rank"] is None
    assert (e["n"], e["mean"], e["rank"], e["is_best"]) == (0, None, None, False)
    assert [(r["arm"], r["rank"], r["is_best"]) for r in got] == [
        ("a", 2, False), ("b", 1, True), ("c", 3, False), ("d", None, False), ("e", None, False)
    ]  # fmt: skip
    assert close(got[1]["margin"], statistics.fmean(SUMMARY_VALUES["a"]) - 0.675)
    assert [r["margin"] for r in got if r["arm"] != "b"] == [None] * 4

    by_max = {r["arm"]: r for r in rows(lab.inspect.summary(con, "exp", "loss", mode="max"))}
    assert [by_max[a]["rank"] for a in "abcde"] == [2, 3, 1, None, None]
    assert close(by_max["c"]["margin"], 3.0 - statistics.fmean(SUMMARY_VALUES["a"]))
    assert lab.inspect.summary(con, "exp", "loss").df()["arm"].tolist() == list("abcde")


class Cfg(pydantic.BaseModel):
    scale: float = 1.0


def train(run: RunSpec) -> dict[str, float]:
    """Logs a loss through the real hooks and returns the same final value."""
    from lab.hooks import LoopState

    state = LoopState(ctx=run.ctx, model=None, optimizer=None, num_steps=3)  # type: ignore[arg-type]
    value = 0.0
    for step in range(1, 4):
        value = run.config.scale * (1 + (run.repeat * 7919 % 5)) / step
        state.step = step
        run.dispatcher.fire("on_step_end", state, step, None, {"loss": value})
    return {"loss": value}


def test_summary_equals_the_in_memory_summary(sqlite_url: str, tmp_path: Path) -> None:
    result = Experiment(
        "mem", train, base_config=Cfg(), repeats=4, store=sqlite_url,
        arms=[Arm("x", scale=1.0), Arm("y", scale=0.5), Arm("z", scale=0.8)],
        output_dir=tmp_path / "runs",
    ).run()  # fmt: skip
    want = result.summary("loss")
    got = rows(lab.inspect.summary(lab.inspect.connect(sqlite_url), "mem", "loss"))
    assert [r["arm"] for r in got] == ["x", "y", "z"]
    for row in got:
        mem = want.row(row["arm"], "loss")
        for name in ("n", "mean", "std", "ci_low", "ci_high"):
            assert close(row[name], getattr(mem, name)), (row["arm"], name)
    assert [r["arm"] for r in got if r["is_best"]] == [want.best_arm]
    assert close(next(r["margin"] for r in got if r["is_best"]), want.margin)


# -- curves -----------------------------------------------------------------------------------


def test_curves_of_ragged_runs(store_url: str) -> None:
    record(
        store_url,
        [
            Run("a", 0, {"loss": {1: 4.0, 2: 3.0, 3: 2.0, 4: 1.5, 5: 1.0}}),
            Run("a", 1, {"loss": {1: 5.0, 2: 3.5, 3: 2.5}}),  # stopped early
            Run("a", 2, {"loss": {1: 4.5, 2: 2.0, 3: 1.0, 4: 0.5}}),
            Run("b", 0, {"loss": {1: 9.0, 2: 8.0}}),
        ],
    )
    con = lab.inspect.connect(store_url)
    rel = lab.inspect.curves(con, "exp", "loss")
    assert rel.columns == ["arm", "step", "n", "mean", "std", "ci_low", "ci_high"]
    got = rows(rel)
    assert [(r["arm"], r["step"], r["n"]) for r in got] == [
        ("a", 1, 3), ("a", 2, 3), ("a", 3, 3), ("a", 4, 2), ("a", 5, 1), ("b", 1, 1), ("b", 2, 1)
    ]  # fmt: skip
    series = {1: [4.0, 5.0, 4.5], 2: [3.0, 3.5, 2.0], 3: [2.0, 2.5, 1.0], 4: [1.5, 0.5]}
    for row in got[:4]:
        values = series[row["step"]]
        low, high = t_interval(values)
        assert close(row["mean"], statistics.fmean(values))
        assert close(row["std"], statistics.stdev(values))
        assert close(row["ci_low"], low) and close(row["ci_high"], high)
    assert (got[4]["mean"], got[4]["std"], got[4]["ci_low"], got[4]["ci_high"]) == (
        1.0, None, None, None
    )  # fmt: skip


def test_curves_of_repeats_logging_at_different_intervals(sqlite_url: str) -> None:
    every_step = {s: 10.0 - s for s in range(0, 11)}  # steps 0..10
    every_fifth = {0: 12.0, 5: 6.0, 10: 1.5}
    record(sqlite_url, [Run("a", 0, {"loss": every_step}), Run("a", 1, {"loss": every_fifth})])
    con = lab.inspect.connect(sqlite_url)

    raw = rows(lab.inspect.curves(con, "exp", "loss"))  # each logged step on its own
    assert [(r["step"], r["n"]) for r in raw] == [(s, 2 if s % 5 == 0 else 1) for s in range(11)]
    assert close(raw[5]["mean"], (5.0 + 6.0) / 2)

    binned = rows(lab.inspect.curves(con, "exp", "loss", every=5))
    assert [(r["step"], r["n"]) for r in binned] == [(0, 2), (5, 2), (10, 2)]
    # each run's mean over its points in (0, 5] and (5, 10], then the mean across runs
    fine = [statistics.fmean([9.0, 8.0, 7.0, 6.0, 5.0]), statistics.fmean([4.0, 3, 2, 1, 0])]
    for row, mine, theirs in zip(binned[1:], fine, [6.0, 1.5], strict=True):
        low, high = t_interval([mine, theirs])
        assert close(row["mean"], (mine + theirs) / 2)
        assert close(row["ci_low"], low) and close(row["ci_high"], high)
    assert close(binned[0]["mean"], (10.0 + 12.0) / 2)

    odd = rows(lab.inspect.curves(con, "exp", "loss", every=4))  # (0, 4], (4, 8], (8, 12]
    assert [(r["step"], r["n"]) for r in odd] == [(0, 2), (4, 1), (8, 2), (12, 2)]


def test_non_finite_values_give_nan_spread_not_an_error(sqlite_url: str) -> None:
    record(
        sqlite_url,
        [Run("a", 0, {"loss": {1: math.inf, 2: 1.0}}), Run("a", 1, {"loss": {1: 1.0, 2: NAN}})],
    )
    con = lab.inspect.connect(sqlite_url)
    step1, step2 = rows(lab.inspect.curves(con, "exp", "loss"))
    assert step1["mean"] == math.inf and math.isnan(step1["std"])
    assert math.isnan(step2["mean"]) and math.isnan(step2["ci_low"])


# -- compare ----------------------------------------------------------------------------------

A = [1.0, 2.0, 4.0, 3.5]
B = [0.8, 1.9, 3.1, 3.6]


def test_compare_paired_by_seed_matches_ttest_rel(store_url: str) -> None:
    runs = [Run("a", i, finals(acc=v), seed=40 + i) for i, v in enumerate(A)]
    # b's repeats were recorded in another order: pairing goes by seed, not by row order
    runs += [Run("b", i, finals(acc=B[i]), seed=40 + i) for i in (2, 0, 3, 1)]
    record(store_url, runs)
    con = lab.inspect.connect(store_url)
    rel = lab.inspect.compare(con, "exp", "a", "b", "acc")
    assert rel.columns == [
        "metric", "arm_a", "arm_b", "n", "n_a", "n_b", "mean_a", "mean_b", "diff", "df",
        "ci_low", "ci_high", "paired",
    ]  # fmt: skip
    (row,) = rows(rel)
    want = stats.ttest_rel(A, B).confidence_interval(0.95)
    assert (row["metric"], row["arm_a"], row["arm_b"], row["n"], row["paired"]) == (
        "acc", "a", "b", 4, True
    )  # fmt: skip
    assert close(row["diff"], statistics.fmean(A) - statistics.fmean(B))
    assert close(row["mean_a"], statistics.fmean(A)) and close(row["mean_b"], statistics.fmean(B))
    assert close(row["ci_low"], want.low) and close(row["ci_high"], want.high)
    assert row["df"] == 3.0

    (flipped,) = rows(lab.inspect.compare(con, "exp", "b", "a", "acc"))
    assert close(flipped["diff"], -row["diff"]) and close(flipped["ci_low"], -row["ci_high"])


def test_compare_without_shared_seeds_is_welch(store_url: str) -> None:
    runs = [Run("a", i, finals(acc=v)) for i, v in enumerate(A)]
    runs += [Run("b", i, finals(acc=v)) for i, v in enumerate(B[:3])]
    runs.append(Run("b", 3, finals(acc=B[3]), status="failed"))  # b lacks seed 3: no pairs
    record(store_url, runs)
    con = lab.inspect.connect(store_url)
    (row,) = rows(lab.inspect.compare(con, "exp", "a", "b", "acc"))
    welch = stats.ttest_ind(A, B[:3], equal_var=False)
    want = welch.confidence_interval(0.95)
    assert (row["paired"], row["n"], row["n_a"], row["n_b"]) == (False, 7, 4, 3)
    assert close(row["diff"], statistics.fmean(A) - statistics.fmean(B[:3]))
    assert close(row["df"], welch.df)
    assert close(row["ci_low"], want.low) and close(row["ci_high"], want.high)


def test_compare_with_one_pair_has_no_interval(sqlite_url: str) -> None:
    record(sqlite_url, [Run("a", 0, finals(acc=1.0)), Run("b", 0, finals(acc=0.25))])
    (row,) = rows(lab.inspect.compare(lab.inspect.connect(sqlite_url), "exp", "a", "b", "acc"))
    assert (row["n"], row["diff"], row["df"], row["ci_low"], row["paired"]) == (
        1, 0.75, None, None, True
    )  # fmt: skip


# -- predictions, disagreements, breakdowns ---------------------------------------------------


def preds(*items: tuple[str | None, str, str, float | None]) -> list[dict[str, Any]]:
    """(example_id, output, target, score) per example; the input is 'q:<example_id>'."""
    out = []
    for example_id, output, target, score in items:
        p = {"input": f"q:{example_id}", "output": output, "target": target, "score": score}
        if example_id is not None:
            p["example_id"] = example_id
        out.append(p)
    return out


def test_predictions_join_runs_and_evals(store_url: str) -> None:
    mid = EvalResult("test", {"acc": 0.0}, step=5)
    end = EvalResult("test", {"acc": 1.0})
    record(
        store_url,
        [
            Run("a", 0, finals(loss=1.0), seed=7, evals=[
                (end, preds(("x1", "A", "A", 1.0), (None, "B", "C", 0.0))),
                (mid, [{"example_id": "x1", "output": "Z", "target": "A", "note": "early"}]),
            ]),
            Run("b", 0, finals(loss=1.0), seed=7, evals=[(end, preds(("x1", "Q", "A", 0.0)))]),
            Run("b", 1, finals(loss=1.0), seed=8, status="failed",
                evals=[(end, preds(("x1", "A", "A", 1.0)))]),
            Run("b", 2, finals(loss=1.0), seed=9,
                evals=[(EvalResult("other", {}), preds(("x1", "A", "A", 1.0)))]),
        ],
    )  # fmt: skip
    con = lab.inspect.connect(store_url)
    rel = lab.inspect.predictions(con, "exp", "test")
    assert rel.columns == [
        "experiment", "arm", "repeat", "run_key", "seed", "eval", "step", "idx", "example_id",
        "input", "output", "target", "score", "extras",
    ]  # fmt: skip
    got = [
        (*r[:-1], None if r[-1] is None else str(r[-1]).replace(" ", "")) for r in rel.fetchall()
    ]
    assert got == [
        ("exp", "a", 0, "a-r0", 7, "test", 5, 0, "x1", None, "Z", "A", None, '{"note":"early"}'),
        ("exp", "a", 0, "a-r0", 7, "test", None, 0, "x1", "q:x1", "A", "A", 1.0, None),
        ("exp", "a", 0, "a-r0", 7, "test", None, 1, None, "q:None", "B", "C", 0.0, None),
        ("exp", "b", 0, "b-r0", 7, "test", None, 0, "x1", "q:x1", "Q", "A", 0.0, None),
    ]


def test_disagreements_order_by_the_largest_difference(store_url: str) -> None:
    # scores: a is right on e1 always, b never (|diff| 1); e2 differs by 0.5; e3 agrees
    a = [("e1", "yes", "yes", 1.0), ("e2", "no", "yes", 0.5), ("e3", "x", "y", 0.0)]
    record(
        store_url,
        [
            Run("a", 0, finals(loss=1.0), evals=[(EvalResult("test", {}), preds(*a))]),
            Run("a", 1, finals(loss=1.0), evals=[
                (EvalResult("test", {}, step=3), preds(("e1", "junk", "yes", -9.0))),  # older
                (EvalResult("test", {}), preds(*a)),
            ]),
            Run("b", 0, finals(loss=1.0), evals=[(EvalResult("test", {}), preds(
                ("e1", "no", "yes", 0.0), ("e2", "yes", "yes", 1.0), ("e3", "x", "y", 0.0),
                ("e4", "only in b", "z", 1.0),
            ))]),
            Run("b", 1, finals(loss=1.0), evals=[(EvalResult("test", {}), preds(
                ("e1", "maybe", "yes", 0.0), ("e2", "no", "yes", 0.0), ("e3", "x", "y", 0.0),
                ("e4", "only in b", "z", 1.0),
            ))]),
        ],
    )  # fmt: skip
    con = lab.inspect.connect(store_url)
    rel = lab.inspect.disagreements(con, "exp", "test", "a", "b")
    assert rel.columns == [
        "example_id", "input", "target", "output_a", "output_b", "score_a", "score_b",
        "correct_a", "correct_b", "diff",
    ]  # fmt: skip
    assert rel.fetchall() == [
        # b's outputs on e1 tie (one each): the smallest, "maybe", is shown
        ("e1", "q:e1", "yes", "yes", "maybe", 1.0, 0.0, 1.0, 0.0, 1.0),
        ("e2", "q:e2", "yes", "no", "no", 0.5, 0.5, 0.0, 0.5, 0.0),
        ("e3", "q:e3", "y", "x", "x", 0.0, 0.0, 0.0, 0.0, 0.0),
    ]
    assert [
        r[0] for r in lab.inspect.disagreements(con, "exp", "test", "a", "b", 1).fetchall()
    ] == ["e1"]
    reverse = lab.inspect.disagreements(con, "exp", "test", "b", "a", limit=None).fetchall()
    assert [(r[0], r[-1]) for r in reverse] == [("e1", -1.0), ("e2", 0.0), ("e3", 0.0)]


def test_disagreements_without_scores_use_correctness_and_idx(sqlite_url: str) -> None:
    def run(arm: str, repeat: int, outputs: list[str]) -> Run:
        items = [{"output": o, "target": t} for o, t in zip(outputs, "ABC", strict=True)]
        return Run(arm, repeat, finals(loss=1.0), evals=[(EvalResult("qa", {}), items)])

    record(
        sqlite_url,
        [
            run("a", 0, ["A", "B", "C"]), run("a", 1, ["A", "X", "C"]),
            run("b", 0, ["A", "X", "X"]), run("b", 1, ["A", "X", "X"]),
        ],
    )  # fmt: skip
    con = lab.inspect.connect(sqlite_url)
    got = lab.inspect.disagreements(con, "exp", "qa", "a", "b").fetchall()
    assert [(r[0], r[3], r[4], r[5], r[7], r[8], r[9]) for r in got] == [
        ("2", "C", "X", None, 1.0, 0.0, 1.0),  # example_id falls back to idx
        ("1", "B", "X", None, 0.5, 0.0, 0.5),  # a's outputs tie: "B" < "X"
        ("0", "A", "A", None, 1.0, 1.0, 0.0),
    ]


def test_breakdown_of_the_latest_eval(store_url: str) -> None:
    def ev(step: int | None, easy: float, hard: float) -> tuple[EvalResult, list]:
        slices = {"easy": {"acc": easy}, "hard": {"acc": hard, "f1": hard / 2}}
        return EvalResult("test", {"acc": 0.0}, breakdowns=slices, step=step), []

    record(
        store_url,
        [
            Run("a", 0, finals(loss=1.0), evals=[ev(None, 0.9, 0.4), ev(50, 0.1, 0.1)]),
            Run("a", 1, finals(loss=1.0), evals=[ev(10, 0.0, 0.0), ev(20, 0.7, 0.2)]),  # max step
            Run("a", 2, finals(loss=1.0), evals=[
                ev(None, 0.8, 0.3),
                (EvalResult("test", {}, step=99, error="RuntimeError: boom"), []),  # failed
            ]),
            Run("b", 0, finals(loss=1.0), evals=[ev(None, 0.5, math.inf)]),
        ],
    )  # fmt: skip
    con = lab.inspect.connect(store_url)
    rel = lab.inspect.breakdown(con, "exp", "test")
    assert rel.columns == ["arm", "slice", "metric", "n", "mean", "std", "ci_low", "ci_high"]
    got = rel.fetchall()
    assert [r[:4] for r in got] == [
        ("a", "easy", "acc", 3), ("a", "hard", "acc", 3), ("a", "hard", "f1", 3),
        ("b", "easy", "acc", 1), ("b", "hard", "acc", 1), ("b", "hard", "f1", 1),
    ]  # fmt: skip
    want = {"easy": [0.9, 0.7, 0.8], "hard": [0.4, 0.2, 0.3]}
    for (_, slice_, metric, _, mean, std, low, high), values in zip(
        got[:3], [want["easy"], want["hard"], [v / 2 for v in want["hard"]]], strict=True
    ):
        t_low, t_high = t_interval(values)
        assert close(mean, statistics.fmean(values)), (slice_, metric)
        assert close(std, statistics.stdev(values))
        assert close(low, t_low) and close(high, t_high)
    assert got[3][4:] == (0.5, None, None, None)
    assert got[4][4] == math.inf  # written to JSON as "Infinity", read back as inf


def test_breakdown_with_a_slice_missing_from_a_run(sqlite_url: str) -> None:
    full = EvalResult("test", {}, breakdowns={"easy": {"acc": 1.0}, "hard": {"acc": 0.5}})
    part = EvalResult("test", {}, breakdowns={"easy": {"acc": 1.0}})
    record(sqlite_url, [Run("a", 0, evals=[(full, [])]), Run("a", 1, evals=[(part, [])])])
    con = lab.inspect.connect(sqlite_url)
    with pytest.raises(ConfigError) as err:
        lab.inspect.breakdown(con, "exp", "test")
    assert str(err.value) == (
        "breakdowns of eval 'test' differ across the runs of experiment 'exp'; missing: "
        "a-r1 (hard/acc); query the evals view to choose the runs yourself"
    )


# -- stages -----------------------------------------------------------------------------------


def test_arms_with_stages_use_the_last_stage_unless_told(sqlite_url: str) -> None:
    record(
        sqlite_url,
        [
            Run("chain", 0, finals(loss=5.0)), Run("chain", 1, finals(loss=6.0)),
            Run("chain", 0, finals(loss=1.0), stage=1), Run("chain", 1, finals(loss=2.0), stage=1),
            Run("flat", 0, finals(loss=3.0)),
        ],
    )  # fmt: skip
    con = lab.inspect.connect(sqlite_url)
    default = lab.inspect.summary(con, "exp", "loss").fetchall()
    assert [r[:3] for r in default] == [("chain", 2, 1.5), ("flat", 1, 3.0)]
    first = lab.inspect.summary(con, "exp", "loss", stage=0).fetchall()
    assert [r[:3] for r in first] == [("chain", 2, 5.5), ("flat", 1, 3.0)]
    assert [r[:3] for r in lab.inspect.curves(con, "exp", "loss", stage=1).fetchall()] == [
        ("chain", 1, 2), ("chain", 10, 2)
    ]  # fmt: skip


# -- printing ---------------------------------------------------------------------------------


def test_every_relation_prints(store_url: str) -> None:
    """A notebook shows a relation through its repr; DuckDB 1.5 cannot print an attached
    store's relation whose CTE is read twice unless the CTE is materialized."""
    ev = EvalResult("test", {}, breakdowns={"all": {"acc": 0.5}})
    items = preds(("e1", "A", "A", 1.0), ("e2", "B", "A", 0.0))
    runs = [Run(arm, i, finals(loss=i + 1.0), evals=[(ev, items)]) for arm in "ab" for i in (0, 1)]
    runs.append(Run("c", 5, finals(loss=2.0), evals=[(ev, items)]))  # no shared seed: Welch
    record(store_url, runs)
    con = lab.inspect.connect(store_url)
    relations = [
        lab.inspect.summary(con, "exp", "loss"),
        lab.inspect.curves(con, "exp", "loss", every=5),
        lab.inspect.compare(con, "exp", "a", "b", "loss"),
        lab.inspect.compare(con, "exp", "a", "c", "loss"),
        lab.inspect.predictions(con, "exp", "test"),
        lab.inspect.disagreements(con, "exp", "test", "a", "b"),
        lab.inspect.breakdown(con, "exp", "test"),
    ]
    for rel in relations:
        assert rel.columns[0] in str(rel) and rel.columns[0] in repr(rel.limit(1))
    assert [r[-1] for r in relations[2].fetchall() + relations[3].fetchall()] == [True, False]


# -- bad input --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_input_con(tmp_path_factory: pytest.TempPathFactory) -> Any:
    url = f"sqlite:///{tmp_path_factory.mktemp('bad') / 'lab.db'}"
    test = EvalResult("test", {}, breakdowns={"all": {"acc": 1.0}})
    record(
        url,
        [
            Run("a", 0, finals(loss=1.0, **{"val/loss": 2.0}), evals=[(test, [])]),
            Run("a", 1, finals(loss=1.0, **{"val/loss": 2.0}), evals=[(test, [])]),
            Run("b", 0, finals(loss=1.0, **{"val/loss": 2.0}), evals=[(test, [])]),
            Run("b", 1, finals(loss=1.0)),  # no val/loss, no eval
            Run("c", 0, finals(loss=1.0), status="failed"),
            Run("d", 0, finals(loss=1.0, **{"val/loss": 3.0}), evals=[(test, [])]),
            Run("d", 1, finals(loss=1.0, **{"val/loss": 3.0}), evals=[(test, [])]),
        ],
    )
    record(url, [Run("a", 0, status="failed")], name="dead")
    return lab.inspect.connect(url)


BAD_INPUTS = [
    (lambda con: lab.inspect.summary(con, "nope", "loss"),
     "no experiment named 'nope' in the store; known: dead, exp"),
    (lambda con: lab.inspect.summary(con, "dead", "loss"),
     "experiment 'dead' has no completed or stopped runs to analyse; "
     "`lab show dead` lists its runs and their statuses"),
    (lambda con: lab.inspect.summary(con, "exp", "loss", stage=3),
     "experiment 'exp' has no completed or stopped runs at stage 3 to analyse; "
     "`lab show exp` lists its runs and their statuses"),
    (lambda con: lab.inspect.summary(con, "exp", "acc"),
     "experiment 'exp' has no metric 'acc'; known: loss, val/loss"),
    (lambda con: lab.inspect.summary(con, "exp", "val/loss"),
     "metric 'val/loss' is missing from 1 of 6 runs of experiment 'exp': b-r1; analyse a "
     "metric every run logged, or choose the runs yourself in SQL over the final_metrics view"),
    (lambda con: lab.inspect.summary(con, "exp", "loss", mode="best"),
     "mode='best': use 'min' or 'max'"),
    (lambda con: lab.inspect.curves(con, "exp", "lr"),
     "experiment 'exp' has no metric 'lr'; known: loss, val/loss"),
    (lambda con: lab.inspect.curves(con, "exp", "val/loss"),
     "metric 'val/loss' is missing from 1 of 6 runs of experiment 'exp': b-r1; analyse a "
     "metric every run logged, or choose the runs yourself in SQL over the final_metrics view"),
    (lambda con: lab.inspect.curves(con, "exp", "loss", every=0),
     "every=0: give a bucket width in steps, an int >= 1, or None"),
    (lambda con: lab.inspect.compare(con, "exp", "a", "z", "loss"),
     "experiment 'exp' has no arm 'z'; arms: a, b, c, d"),
    (lambda con: lab.inspect.compare(con, "exp", "a", "c", "loss"),
     "arm 'c' of experiment 'exp' has no completed or stopped runs to compare; "
     "`lab show exp` lists its runs"),
    (lambda con: lab.inspect.compare(con, "exp", "a", "a", "loss"),
     "compare needs two different arms, got 'a' twice"),
    (lambda con: lab.inspect.compare(con, "exp", "a", "b", "val/loss"),
     "metric 'val/loss' is missing from 1 of 4 runs of experiment 'exp': b-r1; analyse a "
     "metric every run logged, or choose the runs yourself in SQL over the final_metrics view"),
    (lambda con: lab.inspect.predictions(con, "exp", "dev"),
     "experiment 'exp' has no eval 'dev'; known: test"),
    (lambda con: lab.inspect.disagreements(con, "exp", "dev", "a", "b"),
     "experiment 'exp' has no eval 'dev'; known: test"),
    (lambda con: lab.inspect.disagreements(con, "exp", "test", "a", "b"),
     "eval 'test' is missing (or failed) in 1 of 4 runs of experiment 'exp': b-r1; query the "
     "evals and predictions views to choose the runs yourself"),
    (lambda con: lab.inspect.disagreements(con, "exp", "test", "a", "b", limit=0),
     "limit=0: give a number of rows, an int >= 1, or None"),
    (lambda con: lab.inspect.breakdown(con, "exp", "dev"),
     "experiment 'exp' has no eval 'dev'; known: test"),
    (lambda con: lab.inspect.breakdown(con, "exp", "test"),
     "eval 'test' is missing (or failed) in 1 of 6 runs of experiment 'exp': b-r1; query the "
     "evals and predictions views to choose the runs yourself"),
    (lambda con: lab.inspect.plot_summary(con, "exp", "acc"),
     "experiment 'exp' has no metric 'acc'; known: loss, val/loss"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "message"), BAD_INPUTS)
def test_bad_input_is_one_line_naming_the_choices(
    bad_input_con: Any, call: Any, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        call(bad_input_con)
    assert str(err.value) == message


def test_only_the_compared_arms_need_the_metric_or_eval(bad_input_con: Any) -> None:
    # b-r1 lacks val/loss and the eval, but a and d have both in every run
    (row,) = rows(lab.inspect.compare(bad_input_con, "exp", "a", "d", "val/loss"))
    assert (row["n"], row["diff"], row["paired"]) == (2, -1.0, True)
    assert lab.inspect.disagreements(bad_input_con, "exp", "test", "a", "d").fetchall() == []


# -- plots ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plot_con(tmp_path_factory: pytest.TempPathFactory) -> Any:
    url = f"sqlite:///{tmp_path_factory.mktemp('plot') / 'lab.db'}"
    runs = [
        Run(arm, i, {"loss": {s: scale * (i + 1) / s for s in range(1, 6)}})
        for arm, scale in [("small", 1.0), ("large", 2.0), ("solo", 3.0)]
        for i in range(1 if arm == "solo" else 3)
    ]
    record(url, runs)
    return lab.inspect.connect(url)


def test_plot_curves_draws_a_line_and_a_band_per_arm(plot_con: Any) -> None:
    fig = lab.inspect.plot_curves(plot_con, "exp", "loss")
    assert isinstance(fig, Figure)
    (ax,) = fig.axes
    assert [line.get_label() for line in ax.lines] == ["small", "large", "solo"]
    assert len(ax.collections) == 3  # one CI band per arm (solo's is empty: one repeat)
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("step", "loss")
    assert list(ax.lines[0].get_xdata()) == [1, 2, 3, 4, 5]
    assert ax.lines[0].get_ydata()[0] == pytest.approx(2.0)  # mean of 1, 2, 3

    given = Figure()
    _, right = given.subplots(1, 2)
    assert lab.inspect.plot_curves(plot_con, "exp", "loss", right, every=2) is given
    assert len(right.lines) == 3 and not given.axes[0].lines


def test_plot_summary_draws_means_with_error_bars(plot_con: Any) -> None:
    fig = lab.inspect.plot_summary(plot_con, "exp", "loss")
    assert isinstance(fig, Figure)
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["small", "large", "solo"]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("arm", "loss")
    (bars,) = ax.containers
    assert list(bars.lines[0].get_ydata()) == pytest.approx([0.4, 0.8, 0.6])
    assert "best (min): small" in ax.get_title()
    assert (
        "best (max): large"
        in lab.inspect.plot_summary(plot_con, "exp", "loss", "max").axes[0].get_title()
    )


# -- intervals for bounded metrics ------------------------------------------------------------

ACCS = {"x": [0.98, 0.99, 1.0], "y": [0.55, 0.61, 0.58, 0.6]}


def train_acc(run: RunSpec) -> dict[str, float]:
    """Logs an accuracy through the real hooks and returns the same final value."""
    from lab.hooks import LoopState

    value = ACCS[run.arm][run.repeat] if run.repeat < len(ACCS[run.arm]) else math.nan
    state = LoopState(ctx=run.ctx, model=None, optimizer=None, num_steps=1)  # type: ignore[arg-type]
    state.step = 1
    run.dispatcher.fire("on_step_end", state, 1, None, {"acc": value})
    return {"acc": value}


@pytest.mark.parametrize("interval", ["t", "bootstrap"])
def test_bounded_summary_is_the_in_memory_one(
    store_url: str, tmp_path: Path, interval: str
) -> None:
    def train(run: RunSpec) -> dict[str, float]:
        if run.arm == "x" and run.repeat == 3:
            raise RuntimeError("x has three repeats")
        return train_acc(run)

    result = Experiment(
        "acc", train, repeats=4, store=store_url, arms=[Arm("x"), Arm("y")],
        output_dir=tmp_path / "runs",
    ).run()  # fmt: skip
    want = result.summary("acc", "max", interval=interval, bounds={"acc": (0, 1)})  # type: ignore[arg-type]
    con = lab.inspect.connect(store_url)
    rel = lab.inspect.summary(con, "acc", "acc", "max", interval=interval, bounds=(0, 1))  # type: ignore[arg-type]
    got = rows(rel)
    assert [r["arm"] for r in got] == ["x", "y"]
    for row in got:
        mem = want.row(row["arm"], "acc")
        assert (row["n"], row["mean"], row["std"], row["ci_low"], row["ci_high"]) == (
            mem.n, mem.mean, mem.std, mem.ci_low, mem.ci_high
        )  # fmt: skip
        assert 0.0 <= row["ci_low"] <= row["ci_high"] <= 1.0
    x = got[0]
    if interval == "t":  # scipy's interval, clipped at 1
        low, high = t_interval(ACCS["x"])
        assert high > 1.0 and close(x["ci_low"], low) and x["ci_high"] == 1.0
    else:  # the exact bootstrap: the means of all 27 resamples of three values
        import itertools

        import numpy as np

        means = [np.mean(c) for c in itertools.product(ACCS["x"], repeat=3)]
        low, high = np.quantile(means, [0.025, 0.975], method="inverted_cdf")
        assert close(x["ci_low"], float(low)) and close(x["ci_high"], float(high))
    assert [r["arm"] for r in got if r["is_best"]] == [want.best_arm] == ["x"]
    assert close(got[0]["margin"], want.margin)
    with pytest.raises(ConfigError, match=r"metric 'acc' has 0\.98 outside bounds=\(0, 0\.5\)"):
        lab.inspect.summary(con, "acc", "acc", bounds=(0, 0.5))
    with pytest.raises(ConfigError, match="interval='normal': use 't'"):
        lab.inspect.summary(con, "acc", "acc", interval="normal")  # type: ignore[arg-type]


def test_curves_band_is_clipped_to_bounds(sqlite_url: str) -> None:
    record(sqlite_url, [Run("a", i, {"acc": {1: v, 2: 0.5}}) for i, v in enumerate(ACCS["x"])])
    con = lab.inspect.connect(sqlite_url)
    step1, step2 = rows(lab.inspect.curves(con, "exp", "acc", bounds=(0, 1)))
    low, high = t_interval(ACCS["x"])
    assert close(step1["ci_low"], low) and step1["ci_high"] == 1.0 and high > 1.0
    assert (step2["ci_low"], step2["ci_high"]) == (0.5, 0.5)
    plain = rows(lab.inspect.curves(con, "exp", "acc"))[0]
    assert close(plain["ci_high"], high)


def _ema(values: list[float], weight: float) -> list[float]:
    out = [values[0]]
    for v in values[1:]:
        out.append(weight * out[-1] + (1 - weight) * v)
    return out


def test_plot_curves_log_y_smoothing_and_seeds(plot_con: Any) -> None:
    fig = lab.inspect.plot_curves(plot_con, "exp", "loss", log_y=True, smooth=0.6, seeds=True)
    (ax,) = fig.axes
    assert ax.get_yscale() == "log"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["small", "large", "solo"]  # raw and seed lines stay out of the legend
    by_label: dict[str, list[Any]] = {}
    for line in ax.lines:
        by_label.setdefault(line.get_label(), []).append(line)
    # the small arm: runs i = 0, 1, 2 log (i + 1) / s at s = 1..5; the mean is 2 / s
    raw_mean = [2.0 / s for s in range(1, 6)]
    assert list(by_label["small"][0].get_ydata()) == pytest.approx(_ema(raw_mean, 0.6))
    assert list(by_label["_raw"][0].get_ydata()) == pytest.approx(raw_mean)
    seeds = {line.get_gid(): line for line in by_label["_seed"]}
    assert sorted(seeds) == [f"{arm}-r{i}" for arm in ("large", "small") for i in range(3)] + [
        "solo-r0"
    ]
    for i in range(3):
        line = seeds[f"small-r{i}"]
        assert list(line.get_xdata()) == [1, 2, 3, 4, 5]
        assert list(line.get_ydata()) == pytest.approx(
            _ema([(i + 1) / s for s in range(1, 6)], 0.6)
        )
        assert line.get_color() == by_label["small"][0].get_color()
    assert "EMA 0.6" in ax.get_title()

    plain = lab.inspect.plot_curves(plot_con, "exp", "loss").axes[0]
    assert plain.get_yscale() == "linear"
    assert [line.get_label() for line in plain.lines] == ["small", "large", "solo"]
    for smooth in (1.0, -0.1, True, "0.5"):
        with pytest.raises(ConfigError, match=r"smooth=.*: give the moving average's weight"):
            lab.inspect.plot_curves(plot_con, "exp", "loss", smooth=smooth)  # type: ignore[arg-type]


def test_plot_summary_error_bars_respect_bounds(sqlite_url: str) -> None:
    record(sqlite_url, [Run("a", i, finals(acc=v)) for i, v in enumerate(ACCS["x"])])
    con = lab.inspect.connect(sqlite_url)
    (ax,) = lab.inspect.plot_summary(con, "exp", "acc", "max", bounds=(0, 1)).axes
    (bars,) = ax.containers
    mean = statistics.fmean(ACCS["x"])
    low, _high = t_interval(ACCS["x"])
    (segment,) = bars.lines[2][0].get_segments()
    assert [y for _x, y in segment] == pytest.approx([low, 1.0])
    assert list(bars.lines[0].get_ydata()) == pytest.approx([mean])
    (ax,) = lab.inspect.plot_summary(con, "exp", "acc", "max", interval="bootstrap").axes
    assert "95% bootstrap CI" in ax.get_title()
