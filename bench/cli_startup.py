"""How long the `lab` command takes to answer: `lab --help`, `lab ls` and `lab show`.

Each command runs as a fresh process, as a user runs it, against a baseline measured in the
same run and alternated with it: ``python -c pass`` (the interpreter alone). For context it
also times ``python -c "import torch"``, which every command paid before `lab` imported its
public names lazily. The store for `ls` and `show` holds the quickstart experiment (a short
one, made once before timing). Prints one JSON line; the target is under 0.5 s for
`lab --help` and `lab ls`.

    python bench/cli_startup.py            # 10 rounds
    python bench/cli_startup.py --quick    # 3 rounds
    python bench/cli_startup.py --before /path/to/older/checkout   # + its help, ls, show

With ``--before``, the same commands also run from another source tree of `lab` (put first
on ``PYTHONPATH``), alternating with this one in every round: a before/after in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import alternate, log, machine


def _timed(argv: list[str], env: dict[str, str], cwd: str) -> float:
    """Seconds for one fresh process of `argv`, from start to exit."""
    started = time.perf_counter()
    subprocess.run(argv, env=env, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    parser.add_argument("--before", type=Path, help="an older lab source tree to time too")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds

    script = Path(sys.executable).with_name("lab")  # the console script, as a user runs it
    lab = [str(script)] if script.exists() else [sys.executable, "-m", "lab.cli"]
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "LAB_STORE_URL": f"sqlite:///{folder}/lab.db"}
        log("making the store: lab quickstart --steps 50")
        subprocess.run([*lab, "quickstart", "--steps", "50", "--output-dir", f"{folder}/runs"],
                       env=env, cwd=folder, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        commands = {
            "python_pass": [sys.executable, "-c", "pass"],
            "lab_help": [*lab, "--help"],
            "lab_ls": [*lab, "ls"],
            "lab_show": [*lab, "show", "quickstart"],
            "import_torch": [sys.executable, "-c", "import torch"],
        }
        arms = {
            name: (lambda i, a=argv: {"s": _timed(a, env, folder)})
            for name, argv in commands.items()
        }
        if args.before is not None:
            old = {**env, "PYTHONPATH": str(args.before.resolve())}
            for name in ("lab_help", "lab_ls", "lab_show"):
                arms[f"{name}_before"] = lambda i, a=commands[name]: {"s": _timed(a, old, folder)}
        results = alternate(rounds, arms)
    medians = {n: round(statistics.median(r["s"] for r in rs), 4) for n, rs in results.items()}
    print(
        json.dumps(
            {
                "bench": "cli_startup",
                "rounds": rounds,
                "seconds_median": medians,
                "seconds_min": {n: round(min(r["s"] for r in rs), 4) for n, rs in results.items()},
                "over_python_median": {
                    n: round(medians[n] - medians["python_pass"], 4) for n in medians
                },
                "target_met": medians["lab_help"] < 0.5 and medians["lab_ls"] < 0.5,
                "machine": machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
