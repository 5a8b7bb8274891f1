"""notebooks/quickstart.ipynb runs top to bottom on a fresh store, and says what it should."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

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
