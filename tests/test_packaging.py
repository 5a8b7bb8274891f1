"""A built wheel works on its own: `lab db upgrade` finds the migrations shipped inside it."""

from __future__ import annotations

import os
import subprocess
import sys
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
