"""The store's edges: nothing outside `lab.store` reaches into its private names, and
`lab.store` and `lab.server` read one way, even counting the imports made inside functions
and under TYPE_CHECKING."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_architecture import _cycle, _imports, _modules

ROOT = Path(__file__).resolve().parent.parent / "lab"


def _module(path: Path) -> str:
    return next(name for name, p in _modules().items() if p == path)


@pytest.mark.parametrize("part", ["lab.store", "lab.server"])
def test_a_part_has_no_import_circle_even_inside_functions(part: str) -> None:
    """Inside `part`, no module imports back a module that imports it, however late: an
    import inside a function (`create_app`'s) or under TYPE_CHECKING still counts. A
    package's ``__init__`` is left out (it gathers its modules' names)."""
    paths = _modules()
    graph = {
        name: {d for d in _imports(name, path, everywhere=True) if d.startswith(part + ".")}
        for name, path in paths.items()
        if name.startswith(part + ".") and path.name != "__init__.py"
    }
    assert _cycle(graph) is None


def _outside_store() -> list[Path]:
    return [p for p in ROOT.rglob("*.py") if not _module(p).startswith("lab.store")]


#: the store's private names, which no module outside `lab.store` may use
PRIVATE = ("_experiment_id", "_gone_runs", "_beat", "_active", "_insert", "_HELD", "_DRIVING")


def test_nothing_outside_the_store_uses_its_private_names() -> None:
    pattern = re.compile(r"\b(?:store|self\._store|s)\.(_[a-z_A-Z]+)|\b(_HELD|_DRIVING)\b")
    found = sorted(
        f"{p.relative_to(ROOT.parent)}: {m.group(1) or m.group(2)}"
        for p in _outside_store()
        for m in pattern.finditer(p.read_text())
        if (m.group(1) or m.group(2)) in PRIVATE
    )
    assert found == []


def test_the_writer_process_writes_without_the_store_class(tmp_path: Path) -> None:
    """The writer process opens the metric rows of a store alone (`MetricRows`), the code
    a `Store`'s writer thread writes with, and never imports `lab.store.store` back."""
    from lab.store import Store

    url = f"sqlite:///{tmp_path / 'lab.db'}"
    store = Store(url, writer="thread")
    exp = store.begin_experiment("e", config={}, seed=0, repeats=1)
    group = store.add_group(exp, "g")
    run = store.start_run(exp, group, run_key="r", arm_id=None, repeat=0, stage=0, seed=0,
                          config={}, output_dir=None)  # fmt: skip
    store.close()
    code = (
        "import sys\n"
        "from lab.store import writer_process\n"
        f"rows = writer_process._open({url!r})\n"
        f"rows.write([({run}, 1, {{'loss': 0.5}}, 1.0)])\n"
        "print(type(rows).__name__, 'lab.store.store' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["MetricRows", "False"]
    store = Store(url, writer="thread")
    try:
        assert store.metric_values(run, "loss") == [(1, 0.5)]
        assert store.last_step(run) == 1
    finally:
        store.close()


def test_both_stores_implement_the_one_store_contract(tmp_path: Path) -> None:
    """`Store` and `HttpStore` are each a `StoreAPI`, and every public method they share is
    in it, with the same parameter names."""
    import inspect

    from lab.store.api import StoreAPI
    from lab.store.http import HttpStore
    from lab.store.store import Store

    shared = {n for n in dir(Store) if not n.startswith("_")} & {
        n for n in dir(HttpStore) if not n.startswith("_")
    }
    named = {n for n in dir(StoreAPI) if not n.startswith("_")}
    assert shared == named
    store = Store(f"sqlite:///{tmp_path / 'lab.db'}")
    try:
        assert isinstance(store, StoreAPI)
    finally:
        store.close()
    for cls in (Store, HttpStore):
        for name in named - {"writer"}:
            ours = inspect.signature(getattr(cls, name)).parameters
            theirs = inspect.signature(getattr(StoreAPI, name)).parameters
            positional = [p for p, v in theirs.items() if v.kind <= v.POSITIONAL_OR_KEYWORD]
            assert [p for p in ours if p in positional] == positional, (cls.__name__, name)
