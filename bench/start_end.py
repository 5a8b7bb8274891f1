"""How long a script waits for `lab` when a run starts and when it ends.

Start: a fresh interpreter imports torch and builds its model and optimizer (the user's own
work, untimed), then ``import lab``, ``lab.start_run(...)`` (with a config) entered and
``lab.RunHandle(run, model, opt, num_steps=1)`` entered, until the first step may run. Each
round runs, as fresh processes in a rotating order: the baseline (the same script without
`lab`: ``import torch``, the model, the optimizer), a run into an existing SQLite store (at
head, one run in it already; a new experiment each round) and a run into a new store (a new
file each round). Two figures each: ``inside``, from before ``import lab`` to the first
step, wall (``perf_counter``), CPU of the process's threads (``process_time``), of the
main thread alone (``thread_time``) and the seconds of full garbage collections in it
(``full_gc_s``: one walks every object torch's import left, ~0.18 s); and
``outside``, the whole process's wall and CPU (``os.wait4``: start, one step, end, exit)
less the baseline's of the same round. Targets: ``inside`` wall within 0.3 s (existing
store) and 0.45 s (new store).

End: in this process, a 2,000-step run with 10 metrics per step and a busy step of
``--step-us`` (300 µs), from the moment the last ``end_step`` returns until the
``RunHandle`` and ``start_run`` blocks have exited, every row committed (counted afterwards
through another connection: 20,000), beside the same loop without `lab` (its end is the
loop's own exit: the floor). Wall (``perf_counter``) and the training thread's CPU
(``thread_time``). One run first warms the writer process up (uncounted: it is started once
per training process). Target: within 15 ms.

    python bench/start_end.py                # 7 rounds, on a quiet machine
    python bench/start_end.py --load 2       # the same with 2 busy processes meanwhile
    python bench/start_end.py --quick        # 3 rounds
    PYTHONPATH=/path/to/older python bench/start_end.py --source /path/to/older  # its figures
    python bench/start_end.py --before /path/to/older   # + its starts, alternating

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import alternate, busy, log, machine, stop

ROOT = Path(__file__).resolve().parents[1]
#: The `lab` source tree timed (``--source``: another checkout, for a before/after).
SOURCE = ROOT
TARGET_START_EXISTING_S = 0.3
TARGET_START_NEW_S = 0.45
TARGET_END_S = 0.015
STEPS = 2_000
METRICS = 10

# One run's start, timed inside the process; argv: store URL ("baseline": no lab),
# experiment, output folder. Prints {"s", "cpu"} from before `import lab` to the first step.
_START = """
import gc, json, sys, time
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
full = []  # the full garbage collections in the start, and their seconds
def timed(phase, info):
    if phase == "start":
        timed.t = time.perf_counter()
    elif info["generation"] == 2:
        full.append(time.perf_counter() - timed.t)
gc.callbacks.append(timed)
t0, cpu0, own0 = time.perf_counter(), time.process_time(), time.thread_time()
if sys.argv[1] == "baseline":
    print(json.dumps({"s": 0.0, "cpu": 0.0, "thread_cpu": 0.0, "full_gc_s": 0.0}))
else:
    import lab
    with lab.start_run(sys.argv[2], store=sys.argv[1], config={"lr": 0.1, "layers": 2},
                       quiet=True, output_dir=sys.argv[3]) as run:
        with lab.RunHandle(run, model, opt, num_steps=1) as loop:
            for step in loop.steps():
                s, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                own, gc_s = time.thread_time() - own0, sum(full)
                loop.end_step({"loss": 1.0})
    print(json.dumps({"s": s, "cpu": cpu, "thread_cpu": own, "full_gc_s": gc_s}))
"""


def _started(url: str, experiment: str, folder: str, source: Path | None = None) -> dict:
    """One fresh process's start (of `source`'s lab, default `SOURCE`): inside figures, and
    the whole process's wall and CPU."""
    env = {**os.environ, "PYTHONPATH": str(source or SOURCE), "LAB_QUIET": "1"}
    began = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-c", _START, url, experiment, folder],
        env=env, cwd=folder, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert child.stdout is not None
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - began
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"the start of {experiment} in {url} failed")
    inside = json.loads(out)
    return {
        "s": inside["s"],
        "cpu": inside["cpu"],
        "thread_cpu": inside["thread_cpu"],
        "full_gc_s": inside["full_gc_s"],
        "process_s": wall,
        "process_cpu": usage.ru_utime + usage.ru_stime,
    }


def _fit(lab_on: bool, url: str, name: str, folder: str, step_s: float) -> dict[str, float]:
    """One 2,000-step fit; its end's wall and training-thread CPU, from the last
    `end_step` until the blocks exited."""
    import torch

    import lab

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    keys = [f"m{i}" for i in range(METRICS)]

    def busy() -> None:
        until = time.perf_counter() + step_s
        while time.perf_counter() < until:
            pass

    if not lab_on:
        for step in range(1, STEPS + 1):
            busy()
            metrics = {k: step + i / 10 for i, k in enumerate(keys)}
        t0, cpu0 = time.perf_counter(), time.thread_time()
        del metrics
        return {"s": time.perf_counter() - t0, "cpu": time.thread_time() - cpu0}
    with (
        lab.start_run(name, store=url, quiet=True, output_dir=folder) as run,
        lab.RunHandle(run, model, opt, num_steps=STEPS) as loop,
    ):
        for step in loop.steps():
            busy()
            loop.end_step({k: step + i / 10 for i, k in enumerate(keys)})
        t0, cpu0 = time.perf_counter(), time.thread_time()
    s, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    con = sqlite3.connect(url.removeprefix("sqlite:///"))
    try:
        (rows,) = con.execute(
            "SELECT count(*) FROM metrics JOIN runs USING (run_id) "
            "JOIN experiments USING (experiment_id) WHERE experiments.name = ?",
            (name,),
        ).fetchone()
    finally:
        con.close()
    if rows != STEPS * METRICS:
        raise RuntimeError(f"{name}: {rows} rows after the end, not {STEPS * METRICS}")
    return {"s": s, "cpu": cpu}


def _summary(rows: list[dict[str, float]], less: list[dict[str, float]] | None = None) -> dict:
    """Medians and minima of each figure (less the baseline's of the same round)."""
    out: dict[str, Any] = {}
    for field in rows[0]:
        values = [
            r[field] - (less[i][field] if less is not None else 0.0) for i, r in enumerate(rows)
        ]
        out[field] = {
            "median": round(statistics.median(values), 4),
            "min": round(min(values), 4),
            "max": round(max(values), 4),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    parser.add_argument("--load", type=int, default=0, help="busy processes meanwhile")
    parser.add_argument("--step-us", type=float, default=300.0, help="the end's busy step")
    parser.add_argument("--source", type=Path, default=ROOT, help="the lab tree to time")
    parser.add_argument("--before", type=Path, help="another lab tree: its starts alternate")
    args = parser.parse_args()
    global SOURCE
    SOURCE = args.source.resolve()
    import lab

    if not Path(lab.__file__).resolve().is_relative_to(SOURCE):
        parser.error(f"this process imported lab from {lab.__file__}: PYTHONPATH={SOURCE}")
    rounds = 3 if args.quick else args.rounds
    load = busy(args.load)
    try:
        with tempfile.TemporaryDirectory(prefix="lab-start-end-") as folder:
            existing = f"sqlite:///{folder}/existing.db"
            _started(existing, "made-before", folder)  # the store exists, at head
            # the older tree's existing store, at its own head (it refuses a newer one)
            older = f"sqlite:///{folder}/existing-before.db"
            if args.before is not None:
                _started(older, "made-before", folder, args.before)
            start = alternate(rounds, {
                "baseline": lambda i: _started("baseline", "-", folder),
                "existing": lambda i: _started(existing, f"start-{i}", folder),
                "new": lambda i: _started(f"sqlite:///{folder}/new-{i}.db", f"new-{i}", folder),
            } | ({} if args.before is None else {
                "existing_before": lambda i: _started(older, f"before-{i}", folder, args.before),
                "new_before": lambda i: _started(
                    f"sqlite:///{folder}/before-{i}.db", f"new-before-{i}", folder, args.before
                ),
            }))  # fmt: skip
            url = f"sqlite:///{folder}/end.db"
            step_s = args.step_us / 1e6
            _fit(True, url, "warm-up", folder, step_s)
            end = alternate(rounds, {
                "lab": lambda i: _fit(True, url, f"end-{i}", folder, step_s),
                "bare": lambda i: _fit(False, url, "-", folder, step_s),
            })  # fmt: skip
    finally:
        stop(load)
    base = start["baseline"]
    result = {
        "bench": "start_end",
        "rounds": rounds,
        "load": args.load,
        "source": str(SOURCE),
        "loadavg": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "start": {
            "baseline_process": _summary([{k: r[k] for k in ("process_s", "process_cpu")}
                                          for r in base]),
            "existing": _summary(start["existing"], base),
            "new": _summary(start["new"], base),
            **{arm: _summary(start[arm], base) for arm in ("existing_before", "new_before")
               if arm in start},
        },
        "end": {
            "step_us": args.step_us,
            "lab": _summary(end["lab"]),
            "bare": _summary(end["bare"]),
        },
    }  # fmt: skip
    start_s = result["start"]
    result["met"] = {
        "start_existing": start_s["existing"]["s"]["median"] <= TARGET_START_EXISTING_S,
        "start_new": start_s["new"]["s"]["median"] <= TARGET_START_NEW_S,
        "end": result["end"]["lab"]["s"]["median"] <= TARGET_END_S,
    }
    result["machine"] = machine()
    log("done")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
