"""Where users already train: Lightning, the Hugging Face `Trainer` and accelerate, recorded
by `lab` as a loop written on `RunHandle` is.

Each integration is a thin adapter onto `FrameworkRun` (`lab.integrations.recording`), which
records a framework's run through the lifecycle engine and a `lab.loop.framework.
FrameworkHandle`: the same hooks, the same sinks, the same rows. The frameworks themselves are
imported only by the module of their own integration.
"""

from __future__ import annotations

from lab.integrations.recording import FrameworkRun

__all__ = ["FrameworkRun"]
