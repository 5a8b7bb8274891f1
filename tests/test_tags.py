"""Tags and notes on experiments and runs: from Python, from `train(run)`, from an experiment
file and from ``lab tag``; read back by `Store`, the DuckDB views, ``lab ls`` and ``lab show``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import lab.inspect
from lab import Experiment, RunSpec
from lab._names import check_tags
from lab.errors import ConfigError, NoExperiment, NoRun
from lab.experiment_file import load_experiment
from lab.store import Store
from tests import warm


def _train(run: RunSpec) -> dict[str, float]:
    if run.repeat == 1:
        run.tag("odd", "second")
        run.tag("odd")  # each tag once
        run.notes = "the second repeat"
    return {"loss": float(run.repeat)}


def lab_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return warm.run(
        [sys.executable, "-m", "lab.cli", *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip


def _tags(store: Store, name: str) -> tuple[list[str], str | None, dict[str, tuple]]:
    exp = store.get_experiment(name)
    return exp["tags"], exp["notes"], {r["run_key"]: (r["tags"], r["notes"]) for r in exp["runs"]}


def test_tags_and_notes_from_python_and_from_train(store: Store, store_url: str) -> None:
    Experiment(
        "t", _train, repeats=2, tags=["sweep", "v1"], notes="first try", store=store_url
    ).run()
    assert _tags(store, "t") == (
        ["sweep", "v1"],
        "first try",
        {"base-r0": ([], None), "base-r1": (["odd", "second"], "the second repeat")},
    )
    store.tag("t", add=["by-hand"])
    # a second attempt: its tags join the stored ones, its notes replace them
    Experiment("t", _train, repeats=3, tags=["v2", "sweep"], notes="more repeats",
               store=store_url).run()  # fmt: skip
    tags, notes, runs = _tags(store, "t")
    assert (tags, notes) == (["sweep", "v1", "by-hand", "v2"], "more repeats")
    assert runs["base-r2"] == ([], None)


def test_store_tag_adds_removes_and_sets_notes(store: Store) -> None:
    Experiment("t", _train, repeats=2, tags=["draft"], store=store.url).run()
    assert store.tag("t", add=["best", "best", "v1"], remove=["draft"], notes="why") == {
        "tags": ["best", "v1"],
        "notes": "why",
    }
    assert store.tag("t", remove=["best", "absent"]) == {"tags": ["v1"], "notes": "why"}
    assert store.tag("t", notes="") == {"tags": ["v1"], "notes": None}  # "" clears
    assert store.tag("t", "base-r1", add=["keep"], remove=["odd"]) == {
        "tags": ["second", "keep"],
        "notes": "the second repeat",
    }
    assert store.tag("t", "base-r0", remove=["x"]) == {"tags": [], "notes": None}
    assert store.list_experiments()[0]["tags"] == ["v1"]


def test_unknown_names_and_bad_tags_are_one_line(store: Store) -> None:
    Experiment("t", _train, store=store.url).run()
    with pytest.raises(NoExperiment, match=r"^no experiment named 'nope' in the store; known: t$"):
        store.tag("nope", add=["x"])
    with pytest.raises(NoRun, match=r"^experiment 't' has no run 'x-r9'; its runs: base-r0$"):
        store.tag("t", "x-r9", add=["x"])
    message = "tag {!r}: use 1 to 64 printable characters, no spaces, not starting with + or -"
    for bad in ("", "two words", "-x", "+x", "a" * 65, "tab\there"):
        with pytest.raises(ConfigError) as info:
            store.tag("t", add=[bad])
        assert str(info.value) == message.format(bad)
    with pytest.raises(ConfigError, match=r"^tags='best': give a list of tags, e.g. \['best'\]$"):
        Experiment("t", _train, tags="best")  # type: ignore[arg-type]
    assert store.get_experiment("t")["tags"] == []  # nothing written


def test_a_bad_tag_in_train_fails_that_run_only(sqlite_url: str) -> None:
    def train(run: RunSpec) -> dict[str, float]:
        if run.repeat == 0:
            run.tag("no spaces please")
        return {"loss": 1.0}

    result = Experiment("bad", train, repeats=2, store=sqlite_url).run()
    assert [(r.status, r.error) for r in result.runs] == [
        ("failed", "ConfigError: tag 'no spaces please': use 1 to 64 printable characters, no "
                   "spaces, not starting with + or -"),
        ("completed", None),
    ]  # fmt: skip


def test_the_views_find_experiments_and_runs_by_tag(store_url: str) -> None:
    Experiment("a", _train, repeats=2, tags=["baseline"], store=store_url).run()
    Experiment("b", _train, repeats=2, tags=["baseline", "big"], store=store_url).run()
    con = lab.inspect.connect(store_url)
    assert con.sql("select experiment from experiment_tags where tag = 'big'").fetchall() == [
        ("b",)
    ]
    assert con.sql(
        "select experiment, run_key from run_tags where tag = 'odd' order by experiment"
    ).fetchall() == [("a", "base-r1"), ("b", "base-r1")]
    # the runs of experiments tagged baseline whose own tags include 'second'
    assert con.sql(
        "select e.name, r.run_key from runs r join experiments e using (experiment_id) "
        "where list_contains(from_json(e.tags, '[\"VARCHAR\"]'), 'baseline') "
        "and list_contains(from_json(r.tags, '[\"VARCHAR\"]'), 'second') order by 1"
    ).fetchall() == [("a", "base-r1"), ("b", "base-r1")]
    assert con.sql("select notes from runs where notes is not null").fetchall() == [
        ("the second repeat",),
        ("the second repeat",),
    ]


def test_an_experiment_file_takes_tags_and_notes(tmp_path: Path, sqlite_url: str) -> None:
    (tmp_path / "tagged_lib.py").write_text("def train(run):\n    return {'loss': 1.0}\n")
    path = tmp_path / "exp.yaml"
    path.write_text(
        "name: filed\ntrain: tagged_lib:train\ntags: [baseline, lr]\nnotes: from the file\n"
    )
    exp = load_experiment(path, store=sqlite_url)
    assert (exp.tags, exp.notes) == (["baseline", "lr"], "from the file")
    exp.run()
    store = Store(sqlite_url)
    try:
        assert _tags(store, "filed")[:2] == (["baseline", "lr"], "from the file")
    finally:
        store.close()
    path.write_text("name: filed\ntrain: tagged_lib:train\ntags: ['two words']\n")
    with pytest.raises(ConfigError) as info:
        load_experiment(path, store=sqlite_url)
    assert str(info.value) == (
        f"{path}: tag 'two words': use 1 to 64 printable characters, no spaces, not starting "
        "with + or -"
    )


def test_lab_tag_then_ls_and_show(sqlite_url: str) -> None:
    Experiment("cli", _train, repeats=2, tags=["draft"], store=sqlite_url).run()
    out = lab_cli("tag", "cli", "+baseline", "-draft", "--note", "kept", "--store", sqlite_url)
    assert (out.returncode, out.stdout, out.stderr) == (
        0, "cli: tags: baseline; notes: kept\n", ""
    )  # fmt: skip
    out = lab_cli("tag", "cli", "base-r0", "+best", "--store", sqlite_url)
    assert out.stdout == "cli base-r0: tags: best; notes: -\n"
    out = lab_cli("tag", "cli", "--store", sqlite_url)  # no change: prints them
    assert out.stdout == "cli: tags: baseline; notes: kept\n"

    ls = lab_cli("ls", "--store", sqlite_url)
    header, row = ls.stdout.splitlines()
    assert header.split()[-1] == "tags" and row.split()[-1] == "baseline"

    show = lab_cli("show", "cli", "--store", sqlite_url).stdout.splitlines()
    assert show[1:3] == ["tags: baseline", "notes: kept"]
    runs = show[show.index("runs") + 1 : show.index("runs") + 4]
    assert runs[0].split()[-2:] == ["tags", "error"]
    assert runs[1].split()[-1] == "best" and runs[2].split()[-2:] == ["odd", "second"]
    at = show.index("run notes")
    assert show[at + 2].split() == ["base-r1", "the", "second", "repeat"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("cli", "base-r0", "best"),
         "error: 'best': after the run key, write +TAG to add a tag and -TAG to remove one\n"),
        (("cli", "nope", "+x"), "error: experiment 'cli' has no run 'nope'; its runs: base-r0\n"),
        (("gone", "+x"), "error: no experiment named 'gone' in the store; known: cli\n"),
        (("cli", "+a b"), "error: tag 'a b': use 1 to 64 printable characters, no spaces, not "
                          "starting with + or -\n"),
    ],
)  # fmt: skip
def test_lab_tag_errors_are_one_line(sqlite_url: str, args: tuple[str, ...], message: str) -> None:
    Experiment("cli", _train, store=sqlite_url).run()
    out = lab_cli("tag", *args, "--store", sqlite_url)
    assert (out.returncode, out.stdout, out.stderr) == (1, "", message)


@pytest.mark.parametrize(
    ("changes", "tags"),
    [
        (("+x", "-x"), "a b"),  # added, then removed: gone
        (("-x", "+x"), "a b x"),
        (("-a", "+a"), "b a"),  # removed, then added again: last
        (("+a", "-a", "+a"), "b a"),
        (("-b", "+c", "+b", "-c"), "a b"),
        (("+c", "+c", "-a"), "b c"),
        (("+a",), "a b"),  # there already: where it was
    ],
)
def test_lab_tag_applies_its_changes_in_order(
    sqlite_url: str, changes: tuple[str, ...], tags: str
) -> None:
    Experiment("order", _train, tags=["a", "b"], store=sqlite_url).run()
    out = lab_cli("tag", "order", *changes, "--store", sqlite_url)
    assert (out.returncode, out.stdout, out.stderr) == (0, f"order: tags: {tags}; notes: -\n", "")
    store = Store(sqlite_url)
    try:
        assert store.get_experiment("order")["tags"] == tags.split()
    finally:
        store.close()


def test_a_tag_is_checked_by_one_rule_that_the_server_states() -> None:
    """`lab._names.TAG`: no whitespace, control, format or private-use character, written
    out, so a code point this Python's Unicode tables do not name yet is taken like any
    other, and the OpenAPI document states the very rule the store checks."""
    from lab._names import TAG
    from lab.server.ingest import ExperimentIn

    for bad in ("zero\u200bwidth", "right\u202eleft", "private\ue000", "del\x7f", "wide\u3000"):
        with pytest.raises(ConfigError, match=r"^tag .*: use 1 to 64 printable characters"):
            check_tags([bad])
    assert check_tags(["\U0007ca79", "é", "v1.2"]) == ["\U0007ca79", "é", "v1.2"]
    declared = ExperimentIn.model_json_schema()["properties"]["tags"]["items"]["pattern"]
    assert declared == TAG.pattern
