"""How much the `lab` command costs to answer: CPU seconds (user + sys of the process) and
wall seconds, for every command that only reads, and for ``lab run FILE --dry-run``.

Each command runs as a fresh process of the `lab` console script, as a user runs it,
against a baseline measured in the same run and alternated with it: ``python -c pass`` (the
interpreter alone). CPU time is the child's own (``os.wait4``), so other processes on the
machine inflate it far less than the wall time. The store holds the quickstart experiment (a
short one, made once before timing) and one read token. Prints one JSON line.

The commands: ``lab --help``; ``lab ls``, ``lab show quickstart``, ``lab show quickstart
--run KEY``, ``lab db current``, ``lab token list`` on the SQLite store; ``lab ls`` through
a ``lab serve`` in front of it; and ``lab run FILE --dry-run`` for docs/experiment-files.md's
``lr-sweep.yaml``, whose module imports torch and lab's loop at its top (timed beside
``python -c "import train_lib"``, the module alone, and ``python -c "import torch"``), and
for the same file over a module that imports torch inside ``train`` only (lab's own share).
Targets: every command that only reads a SQLite store under 0.3 s of CPU; ``lab --help``
under 0.1 s and ``lab ls`` under 0.25 s (``lab ls`` through ``lab serve`` is reported).

    python bench/cli_startup.py                # 10 rounds, on a quiet machine
    python bench/cli_startup.py --load 2       # the same with 2 busy processes meanwhile
    python bench/cli_startup.py --quick        # 3 rounds
    python bench/cli_startup.py --before /path/to/older/checkout   # + its commands

With ``--before``, the commands that only read and the two dry runs also run from another
source tree of `lab` (put first on ``PYTHONPATH``), alternating with this one in every round:
a before/after in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import alternate, busy, log, machine, stop

ROOT = Path(__file__).resolve().parents[1]
#: CPU seconds (user + sys) that each command must stay under.
TARGET_CPU_S = 0.3
TARGET_HELP_CPU_S = 0.1
TARGET_LS_CPU_S = 0.25


def _timed(argv: list[str], env: dict[str, str], cwd: str) -> dict[str, float]:
    """Wall seconds and CPU seconds (user + sys) of one fresh process of `argv`."""
    started = time.perf_counter()
    child = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {child.returncode}")
    return {"s": wall, "cpu": usage.ru_utime + usage.ru_stime}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(lab: list[str], env: dict[str, str], folder: str) -> tuple[subprocess.Popen, str]:
    """A `lab serve` in front of the bench's store, and its URL, once it answers."""
    import httpx

    port = _free_port()
    server = subprocess.Popen(
        [*lab, "serve", "--port", str(port)], env=env, cwd=folder,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/api/v1/health", timeout=1.0).status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("lab serve did not start")
        time.sleep(0.1)


def _experiment_files(folder: Path) -> None:
    """docs/experiment-files.md's train_lib.py and lr-sweep.yaml, and the same file over a
    module that imports torch (and lab's loop) inside `train` only."""
    page = (ROOT / "docs" / "experiment-files.md").read_text()
    blocks = dict(re.findall(r"```\w+\n# ([\w.-]+)\n(.*?)```", page, re.S))
    module, sweep = blocks["train_lib.py"], blocks["lr-sweep.yaml"]
    (folder / "train_lib.py").write_text(module)
    (folder / "lr-sweep.yaml").write_text(sweep)
    inside = module.replace("import torch\n", "", 1).replace(
        "from lab import Evaluator, TrainingLoop\n", "", 1
    )
    inside = inside.replace(
        "def mse(model, batch):\n", "def mse(model, batch):\n    import torch\n\n", 1
    ).replace(
        "def train(run):\n",
        "def train(run):\n    import torch\n\n    from lab import Evaluator, TrainingLoop\n\n",
        1,
    )
    (folder / "light_lib.py").write_text(inside)
    (folder / "light.yaml").write_text(sweep.replace("train_lib", "light_lib"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    parser.add_argument("--load", type=int, default=0, metavar="N",
                        help="N busy-loop processes run while the commands are timed")  # fmt: skip
    parser.add_argument("--before", type=Path, help="an older lab source tree to time too")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds

    script = Path(sys.executable).with_name("lab")  # the console script, as a user runs it
    lab = [str(script)] if script.exists() else [sys.executable, "-m", "lab.cli"]
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "LAB_STORE_URL": f"sqlite:///{folder}/lab.db"}
        log("making the store: lab quickstart --steps 50, and a read token")
        subprocess.run([*lab, "quickstart", "--steps", "50", "--output-dir", f"{folder}/runs"],
                       env=env, cwd=folder, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        token = subprocess.run(
            [*lab, "token", "create", "bench"], env=env, cwd=folder, check=True,
            capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        run_key = "sgd-lr0.01-r0"
        _experiment_files(Path(folder))
        server, served = _serve(lab, env, folder)
        reads = {
            "lab_help": [*lab, "--help"],
            "lab_ls": [*lab, "ls"],
            "lab_show": [*lab, "show", "quickstart"],
            "lab_show_run": [*lab, "show", "quickstart", "--run", run_key],
            "lab_db_current": [*lab, "db", "current"],
            "lab_token_list": [*lab, "token", "list"],
        }
        commands = {
            "python_pass": [sys.executable, "-c", "pass"],
            **reads,
            "lab_ls_http": [*lab, "ls", "--store", served],
            "dry_run": [*lab, "run", "lr-sweep.yaml", "--dry-run"],
            "import_train_lib": [sys.executable, "-c", "import train_lib"],
            "import_torch": [sys.executable, "-c", "import torch"],
            "dry_run_torch_inside": [*lab, "run", "light.yaml", "--dry-run"],
        }
        env = {**env, "LAB_TOKEN": token}
        arms = {name: (lambda i, a=argv: _timed(a, env, folder)) for name, argv in commands.items()}
        if args.before is not None:
            old = {**env, "PYTHONPATH": str(args.before.resolve())}
            for name in (*reads, "dry_run", "dry_run_torch_inside"):
                arms[f"{name}_before"] = lambda i, a=commands[name]: _timed(a, old, folder)
        load = busy(args.load)
        try:
            results = alternate(rounds, arms)
        finally:
            stop([*load, server])
    cpu = {n: round(statistics.median(r["cpu"] for r in rs), 4) for n, rs in results.items()}
    wall = {n: round(statistics.median(r["s"] for r in rs), 4) for n, rs in results.items()}
    print(
        json.dumps(
            {
                "bench": "cli_startup",
                "rounds": rounds,
                "load": args.load,
                "cpu_s_median": cpu,
                "cpu_s_max": {n: round(max(r["cpu"] for r in rs), 4) for n, rs in results.items()},
                "wall_s_median": wall,
                "cpu_over_python": {n: round(cpu[n] - cpu["python_pass"], 4) for n in cpu},
                "dry_run_split": {  # the docs' file: its module (torch, lab's loop) and the rest
                    "module": cpu["import_train_lib"],
                    "torch": cpu["import_torch"],
                    "lab_over_module": round(cpu["dry_run"] - cpu["import_train_lib"], 4),
                    "lab_alone": cpu["dry_run_torch_inside"],
                },
                "target_met": all(cpu[n] < TARGET_CPU_S for n in reads),
                "help_under_0_1": cpu["lab_help"] < TARGET_HELP_CPU_S,
                "ls_under_0_25": cpu["lab_ls"] < TARGET_LS_CPU_S,
                "machine": machine(load_average=os.getloadavg()[0]),
            }
        )
    )


if __name__ == "__main__":
    main()
