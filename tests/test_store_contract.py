"""The store's edges: nothing outside `lab.store` reaches into its private names, and
`lab.store` and `lab.server` read one way, even counting the imports made inside functions
and under TYPE_CHECKING."""

from __future__ import annotations

import ast
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


def _union(annotation: str) -> set[str]:
    """The members of a return annotation's top-level union (``int | None``: int, None)."""
    members, depth, start = set(), 0, 0
    for i, char in enumerate(annotation):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "|" and depth == 0:
            members.add(annotation[start:i].strip())
            start = i + 1
    return members | {annotation[start:].strip()}


def test_both_stores_implement_the_one_store_contract(tmp_path: Path) -> None:
    """`Store` and `HttpStore` are each a `StoreAPI`, and every public method they share is
    in it, with the same parameter names and the same return type (or some of its union's
    members): the typed records of `lab.store.records`, never a bare dict."""
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
            returned = inspect.signature(getattr(cls, name)).return_annotation
            promised = inspect.signature(getattr(StoreAPI, name)).return_annotation
            # (a store may promise less: `Store.write_eval` gives the eval's id, `HttpStore`
            # None, as it queues the write)
            assert _union(returned) <= _union(promised), (cls.__name__, name, returned)
            assert "dict[str, Any]" not in promised, name


_DECLARING = {"NamedTuple", "TypedDict", "Protocol"}  # bases whose annotations are fields


def _bases(cls: ast.ClassDef) -> list[str]:
    names = []
    for base in cls.bases:
        base = base.value if isinstance(base, ast.Subscript) else base
        names.append(base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", ""))
    return names


def _own_names(cls: ast.ClassDef) -> set[str]:
    """What a class gives itself: its methods and class attributes (a bare annotation only
    where it declares a field: a NamedTuple's, a TypedDict's, a dataclass's), and every
    ``self.x`` its methods assign."""
    fields = bool(set(_bases(cls)) & _DECLARING) or any(
        "dataclass" in ast.unparse(d) for d in cls.decorator_list
    )
    names = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and (node.value is not None or fields)
        ):
            names.add(node.target.id)
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {
                sub.attr
                for target in targets
                for sub in ast.walk(target)
                if isinstance(sub, ast.Attribute) and ast.unparse(sub.value) == "self"
            }
    return names


def _borrowed_attributes(paths: list[Path]) -> list[str]:
    """Each ``self.x`` read in a class of `paths` that neither the class nor a base of its
    own in `paths` sets: state a mixin expects from the class that mixes it in. A class
    with a base from elsewhere (an exception, a thread) is left out."""
    classes = {
        node.name: (path, node)
        for path in paths
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    borrowed = []
    for name, (path, cls) in classes.items():
        bases = [b for b in _bases(cls) if b not in _DECLARING]
        if any(b not in classes for b in bases):
            continue
        have = _own_names(cls)
        while bases:
            base = classes[bases.pop()][1]
            have |= _own_names(base)
            bases += [b for b in _bases(base) if b in classes]
        borrowed += [
            f"{path.name}:{node.lineno}: {name} reads self.{node.attr}"
            for node in ast.walk(cls)
            if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load)
            and ast.unparse(node.value) == "self"
            and node.attr not in have
            and not node.attr.startswith("__")
        ]
    return sorted(borrowed)


def test_the_store_holds_its_parts_and_no_part_borrows_another_s_state() -> None:
    """`Store` inherits nothing: it builds its parts (the writes, the reads, the listing,
    the crash judgement) and hands each the engine, the dialect and the sets it uses. No
    class in `lab.store` reads an attribute off ``self`` that it never sets itself, so a
    part's state is all in its constructor, not spread over the classes mixed together."""
    from lab.store.reader import Reader
    from lab.store.store import Store

    assert Store.__mro__ == (Store, object)
    assert Reader.__mro__ == (Reader, object)
    assert _borrowed_attributes(sorted((ROOT / "store").glob("*.py"))) == []


def test_the_borrowed_attribute_check_finds_a_mixin(tmp_path: Path) -> None:
    """The check above finds a mixin's read of its host's state, and accepts state a class
    sets itself, inherits from its own base, or declares as a NamedTuple's field."""
    source = tmp_path / "parts.py"
    source.write_text(
        "from typing import NamedTuple\n"
        "class Part:\n    engine: object\n"
        "    def go(self):\n        return self.engine, self.flush()\n"
        "class Own:\n    def __init__(self):\n        self.a, self.b = 1, 2\n"
        "    def go(self):\n        return self.a + self.b + self.more()\n"
        "    def more(self):\n        return 0\n"
        "class Child(Own):\n    def go2(self):\n        return self.a\n"
        "class Row(NamedTuple):\n    x: int\n    def y(self):\n        return self.x\n"
    )
    assert _borrowed_attributes([source]) == [
        "parts.py:5: Part reads self.engine",
        "parts.py:5: Part reads self.flush",
    ]
