"""A built wheel works on its own: `lab db upgrade` finds the migrations shipped inside it."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from lab.store.migrations import head_revision

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_db_upgrade_from_a_non_editable_install(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), str(ROOT)],
        check=True, timeout=300,
    )  # fmt: skip
    (wheel,) = wheels.glob("lab-*.whl")
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
         str(wheel)],
        check=True, timeout=300,
    )  # fmt: skip
    assert (target / "lab" / "_migrations" / "env.py").exists()
    # the notebook that `lab quickstart` names ships inside, for `lab quickstart --notebook`
    shipped = target / "lab" / "_notebooks" / "quickstart.ipynb"
    assert shipped.read_bytes() == (ROOT / "notebooks" / "quickstart.ipynb").read_bytes()
    # the dashboard's files ship inside: the pages, and uPlot with its licence
    static = target / "lab" / "server" / "ui" / "static"
    for name in ("index.html", "app.js", "app.css", "vendor/uPlot.iife.min.js",
                 "vendor/uPlot.min.css", "vendor/uPlot.LICENSE"):  # fmt: skip
        assert (static / name).read_bytes() == (ROOT / "lab/server/ui/static" / name).read_bytes()
    # Run from an unrelated folder, with the installed copy first on the path: no source tree.
    env = {**os.environ, "PYTHONPATH": str(target)}
    work = tmp_path / "elsewhere"
    work.mkdir()
    code = (
        "import lab, lab.store.migrations as m, sys; "
        "print(lab.__file__); print(m.migrations_dir()); "
        "sys.argv = ['lab', 'db', 'upgrade', '--store', 'sqlite:///x.db']; "
        "from lab.cli import main; main()"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    module_file, migrations, message = out.stdout.strip().splitlines()
    assert Path(module_file).is_relative_to(target)
    assert Path(migrations) == target / "lab" / "_migrations"
    assert message == f"upgraded sqlite:///x.db from empty to {head_revision()}"
    assert (work / "x.db").exists()
    code = "from lab.demo import notebook_text; print(len(notebook_text()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(shipped.read_text(encoding="utf-8"))


@pytest.mark.slow
def test_the_sdist_holds_the_notebook(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-t", "sdist", "-d", str(tmp_path)],
        cwd=ROOT, check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    (sdist,) = tmp_path.glob("lab-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert "notebooks/quickstart.ipynb" in names
    assert "examples/mnist.py" in names  # tests/test_examples.py runs them
    assert "examples/_lab.py" in names  # what the examples share, imported by each
