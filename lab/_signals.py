"""SIGTERM, made to unwind like Ctrl-C, so that what is running records itself and flushes.

A scheduler (SLURM, Kubernetes) stops a job with SIGTERM, and by default that kills Python
without running a `finally` block or an `atexit` handler: the run stays `running` and the
buffered metrics are lost. With this handler, SIGTERM raises `Terminated` (a `SystemExit`
with status 143) in the main thread, so an Experiment records the run as interrupted, the
store flushes, and the process exits. A second SIGTERM kills at once.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from lab.errors import Terminated

_installed = False


def unwind_on_sigterm() -> None:
    """Install the handler once per process, from the main thread, and only while SIGTERM
    still has its default action: a handler the program set itself is left alone."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main interpreter
        return
    _installed = True


def _on_sigterm(signum: int, _frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
    raise Terminated(128 + signum)
