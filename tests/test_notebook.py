"""notebooks/quickstart.ipynb runs top to bottom on a fresh store, and says what it should."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from lab.demo import quickstart

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


def _text(cell: nbformat.NotebookNode) -> str:
    """What a cell showed: its plain-text and HTML outputs, joined."""
    parts = []
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        parts += [data.get("text/plain", ""), data.get("text/html", ""), out.get("text", "")]
    return "\n".join(parts)


def test_the_notebook_is_stored_without_outputs() -> None:
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)


@pytest.mark.slow
def test_the_notebook_runs_on_a_fresh_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAB_STORE_URL", f"sqlite:///{tmp_path / 'lab.db'}")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()  # fmt: skip
    cells = {
        c["source"].split("(")[0].split("\n")[-1]: c for c in nb.cells if c.cell_type == "code"
    }
    by_call = {k.split("lab.inspect.")[-1]: _text(c) for k, c in cells.items()}
    arms = ("sgd-lr0.01", "sgd-lr0.1")
    for call in ("summary", "curves", "breakdown", "predictions"):
        assert all(arm in by_call[call] for arm in arms), call
    assert "True" in by_call["summary"]  # one arm is marked best
    assert "sgd-lr0.1" in by_call["compare"] and "paired" in by_call["compare"]
    assert "small" in by_call["breakdown"] and "large" in by_call["breakdown"]
    assert "example_id" in by_call["disagreements"]
    figures = [c for c in nb.cells if "plot_" in c.get("source", "")]
    assert len(figures) == 2
    assert all("image/png" in o.get("data", {}) for c in figures for o in c["outputs"])
    assert (tmp_path / "lab.db").exists()
    # it said which store it read, and that it ran the quickstart there, as the CLI would
    first = _text(next(c for c in nb.cells if "open_quickstart()" in c.get("source", "")))
    assert f"store: sqlite:///{tmp_path / 'lab.db'} (from $LAB_STORE_URL)" in first
    assert "it holds no quickstart experiment: running it now, as `lab quickstart` does" in first


@pytest.mark.slow
def test_the_notebook_started_in_notebooks_reads_the_store_lab_quickstart_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jupyter starts the kernel in the notebook's folder; `lab quickstart` ran one above."""
    monkeypatch.delenv("LAB_STORE_URL", raising=False)
    db = tmp_path / "lab.db"
    quickstart(f"sqlite:///{db}", output_dir=tmp_path / "runs", steps=60)
    folder = tmp_path / "notebooks"
    folder.mkdir()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(folder)}}).execute()  # fmt: skip
    first = _text(next(c for c in nb.cells if "open_quickstart()" in c.get("source", "")))
    assert f"store: sqlite:///{db} (in a folder above)" in first
    assert "running it" not in first
    assert sorted(p.name for p in folder.iterdir()) == []  # no store, no runs of its own
    con = sqlite3.connect(db)
    try:  # what it showed is what the store held: 6 runs of 60 steps, none added
        assert con.execute("select count(*), min(status), max(status) from runs").fetchone() == (
            6, "completed", "completed",
        )  # fmt: skip
        assert con.execute("select max(step) from metrics").fetchone() == (60,)
    finally:
        con.close()
    summary = _text(next(c for c in nb.cells if "lab.inspect.summary(" in c.get("source", "")))
    assert "sgd-lr0.1" in summary
