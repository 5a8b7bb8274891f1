"""One run on N local processes: ``Experiment(processes_per_run=N)``.

The run's worker process (see `lab.executors.ProcessPool`) becomes rank 0: it starts ranks
1..N-1 (forked on Linux, before any thread, store or process group exists in it, so they skip
importing torch again; spawned elsewhere) with the environment ``torchrun`` would give them
(``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), joins the
process group, and executes the run as any worker does (`lab.lifecycle.run_in_worker`): every
rank trains and fires the loop's hooks, and rank 0 alone records (the callbacks that declare
`rank_zero_only` are left out on the others). So arms x repeats of a DDP run need no shell
script and no ``torchrun`` line.

A rank that dies (a SIGKILL, an OOM kill) closes its connections: the others fail in their
next collective at once, the run is recorded `failed` by rank 0 (or, when rank 0 itself died,
by the experiment's process, as for any worker that dies), and the remaining ranks are
killed. A rank other than 0 never outlives its rank 0 (Linux: the parent-death signal).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lab._secrets import logger

if TYPE_CHECKING:
    from lab.hooks import Callback
    from lab.lifecycle import RunJob
    from lab.records import ArmResult, RunResult

log = logger("lab.experiment")

#: Seconds the other ranks may take to exit once rank 0's run has ended.
EXIT_GRACE_S = 30.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
    }


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (rank 0) dies."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _threads(world: int) -> None:
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads() // world))


def _other_rank(payload: bytes, rank: int, world: int, port: int) -> None:
    """Rank `rank` (>= 1): the same run, with the callbacks that run on every rank."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides; a Ctrl-C reaches it
    os.environ.update(_rank_env(rank, world, port))
    _threads(world)
    from lab._distributed import init_from_launcher, leave_group
    from lab.dispatch import Dispatcher
    from lab.lifecycle import close, execute_run

    job, callbacks, strict, arm_result = pickle.loads(payload)
    init_from_launcher()
    hooks = Dispatcher(callbacks, strict=strict)  # without the rank_zero_only callbacks
    try:
        result, _ = execute_run(job, hooks, arm_result)
    finally:
        hooks.run_key = None
        close(hooks)
    leave_group()
    sys.exit(0 if result.status != "failed" else 1)


def run_on_ranks(
    job: RunJob,
    callbacks: list[Callback],
    strict: bool | None,
    arm_result: ArmResult,
    processes: int,
    *,
    progress: Callable[[Any], None],
) -> RunResult:
    """Execute `job` on `processes` local ranks, this process being rank 0; returns rank
    0's result. Called in a worker process of `lab.executors.ProcessPool`."""
    from lab._distributed import init_from_launcher, leave_group
    from lab.lifecycle import run_in_worker

    port = _free_port()
    payload = pickle.dumps((job, callbacks, strict, arm_result), protocol=pickle.HIGHEST_PROTOCOL)
    # fork: the worker has imported torch and lab but started nothing yet (no process group,
    # no store, no training thread), so a forked rank is as clean as a spawned one, and
    # starts seconds sooner; CUDA, once initialised, does not survive a fork: spawn then
    import torch

    fork = sys.platform.startswith("linux") and not torch.cuda.is_initialized()
    mp = multiprocessing.get_context("fork") if fork else multiprocessing.get_context("spawn")
    others = []
    for rank in range(1, processes):
        proc = mp.Process(
            target=_other_rank,
            args=(payload, rank, processes, port),
            name=f"lab-rank-{rank}-{job.run_key}",
            daemon=False,  # a rank may start processes of its own (a DataLoader's workers)
        )
        proc.start()
        others.append(proc)
    os.environ.update(_rank_env(0, processes, port))
    _threads(processes)
    try:
        init_from_launcher()
        result = run_in_worker(job, callbacks, strict, arm_result, progress=progress)
    finally:
        leave_group()
        _end_others(others, job.run_key)
    return result


def _end_others(others: list[Any], run_key: str) -> None:
    """Wait for the other ranks to exit (they end with the run); kill what is left."""
    for proc in others:
        proc.join(EXIT_GRACE_S)
        if proc.exitcode is None:
            log.warning("run %s: rank process %s did not exit; killing it", run_key, proc.pid)
            proc.kill()
            proc.join()
