"""Whether the process that owns a `running` run is still alive.

A run row names its owner: the host, the pid, the process's start time (`process_start`,
epoch seconds, as psutil reads it) and the machine's `boot_id`. A pid alone proves little:
pids are reused, so a dead run's pid may belong to a new process; and a reader in a
container that shares the host's name sees another PID namespace, where the owner's pid
does not exist even though the owner runs. So a reader judges the owner by its process
only where the pid means the same thing to it as to the owner:

- same host, same boot id (the kernel's boot id and the PID namespace, see `boot_id`):
  the owner is gone when no process has its pid, when that process is a zombie, or when
  the process that has it started at another time (a reused pid);
- anything else (another host, another boot, another PID namespace, a row without the
  owner's identity): the heartbeat decides. The run's metric writer refreshes it every
  `heartbeat_s` at the least; a heartbeat older than `stale_after_s` means gone.

`owner_gone` says why the owner is gone (or None); `owner_alive` is its negation. Every
caller that must decide whether a `running` run still has an owner (marking crashed runs,
claiming a run) asks these, so the rule lives here only.
"""

from __future__ import annotations

import os
import socket
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

#: Two readings of one process's start time agree to within this many seconds (psutil
#: derives it from the boot time and clock ticks; a reused pid starts much later).
START_TOLERANCE_S = 1.0
_BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")
_PID_NAMESPACE = Path("/proc/self/ns/pid")


def process_start(pid: int | None = None) -> float | None:
    """When process `pid` (default: this one) started, in epoch seconds; None when it does
    not exist or cannot be read. Recorded with a run, so a reused pid is told apart."""
    import psutil

    if pid is None:
        return _own_start(os.getpid())
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


@cache
def _own_start(pid: int) -> float | None:
    """This process's start time, read once per process (keyed by pid: a fork reads anew)."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


@cache
def boot_id() -> str | None:
    """Which running kernel and PID namespace this process's pids belong to.

    Linux: ``<boot id>/<pid namespace>``, e.g. ``f434a724-...-533f4eb83322/pid:[4026531836]``:
    a container shares the host's kernel (and so its boot id) but may have a PID namespace
    of its own, where the same pid names another process. Elsewhere: ``boot:<boot time>``
    from psutil. None when neither can be read (the heartbeat then decides).
    """
    try:
        boot = _BOOT_ID_FILE.read_text().strip()
    except OSError:
        boot = ""
    if boot:
        try:
            return f"{boot}/{os.readlink(_PID_NAMESPACE)}"[:64]
        except OSError:
            return boot[:64]
    try:
        import psutil

        return f"boot:{psutil.boot_time():.0f}"
    except Exception:
        return None


def this_owner() -> dict[str, Any]:
    """This process as a run's owner: host, pid, process start time and boot id, which
    `mark_crashed` judges to tell a live run from one whose process is gone."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start": process_start(),
        "boot_id": boot_id(),
    }


def owner_gone(
    *,
    host: str | None,
    pid: int | None,
    process_start: float | None,
    boot_id: str | None,
    heartbeat_at: datetime | None,
    stale_after_s: float,
    now: datetime | None = None,
) -> str | None:
    """Why the process that owns a `running` run is gone, or None while it may be alive.

    The arguments are the run row's columns (`heartbeat_at` naive UTC, as stored). See the
    module docstring for the rule; a row recorded before process identities existed (no
    `process_start`/`boot_id`) is judged by its pid on the same host, as before.
    """
    import psutil

    here = socket.gethostname()
    if host == here and pid is not None:
        same_boot = boot_id is not None and boot_id == _boot_id_now()
        legacy = boot_id is None and process_start is None
        if same_boot or legacy:
            try:
                proc = psutil.Process(pid)
                zombie = proc.status() == psutil.STATUS_ZOMBIE
                started = proc.create_time()
            except psutil.NoSuchProcess:
                return f"the process (pid {pid} on {host}) died"
            except (psutil.Error, OSError):  # exists, but cannot be read: ask the heartbeat
                zombie, started = False, None
            if zombie:
                return f"the process (pid {pid} on {host}) died"
            if (
                process_start is not None
                and started is not None
                and abs(started - process_start) > START_TOLERANCE_S
            ):
                return (
                    f"the process (pid {pid} on {host}) died; pid {pid} now belongs to "
                    "another process"
                )
            if same_boot and started is not None:
                return None  # its own process, alive: a quiet heartbeat is not a death
    if heartbeat_at is None:
        return None
    now = now if now is not None else datetime.now(UTC).replace(tzinfo=None)
    age = (now - heartbeat_at).total_seconds()
    if age > stale_after_s:
        return f"its process (pid {pid} on {host}) was last seen {age:.0f}s ago"
    return None


def owner_alive(
    *,
    host: str | None,
    pid: int | None,
    process_start: float | None,
    boot_id: str | None,
    heartbeat_at: datetime | None,
    stale_after_s: float,
    now: datetime | None = None,
) -> bool:
    """Whether a `running` run's owner may still be alive: `owner_gone` found no reason it
    is gone. A run whose owner is alive must not be marked crashed nor taken over."""
    return (
        owner_gone(
            host=host,
            pid=pid,
            process_start=process_start,
            boot_id=boot_id,
            heartbeat_at=heartbeat_at,
            stale_after_s=stale_after_s,
            now=now,
        )
        is None
    )


def _boot_id_now() -> str | None:
    return boot_id()
