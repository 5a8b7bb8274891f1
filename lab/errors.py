"""Every error `lab` raises on purpose derives from `LabError`, and its message names the fix.

The command line prints a `LabError` as one line and exits 1; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations


class LabError(Exception):
    """Base of every error `lab` raises on purpose."""


class ConfigError(LabError, ValueError):
    """An experiment, arm, loop or checkpoint setting is invalid."""


class StoreError(LabError):
    """The store cannot be opened, read or written."""


class UnknownScheme(StoreError):
    """A store URL names a database `lab` does not support."""


class StoreUnreachable(StoreError):
    """The database server named by a store URL did not answer."""


class SchemaTooNew(StoreError):
    """The database was migrated by a newer `lab` than this one."""


class NotALabStore(StoreError):
    """The database holds no `lab` store: it is empty, or holds someone else's tables."""


class NoStore(StoreError):
    """No store exists where a command that only reads was pointed."""


class NotADatabase(StoreError):
    """The store's file is not a SQLite database."""


class StoreDamaged(StoreError):
    """The store's file is a SQLite database that cannot be read back whole."""


class StoreReadOnly(StoreError):
    """The store cannot be written: a read-only file, folder or file system."""


class SchemaTooOld(StoreError):
    """The store's schema is older than this `lab` can read; ``lab db upgrade`` fixes it."""


class ExportError(LabError):
    """An export cannot be written where it was asked to go."""


class NoExperiment(LabError, KeyError):
    """No experiment of that name is in the store."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class NoRun(LabError, KeyError):
    """An experiment has no run of that key."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class NoToken(LabError, KeyError):
    """No `lab serve` token of that name is in the store."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RunBusy(LabError):
    """A run is being trained by a live process, or was just recorded by another one with
    other settings: nobody else may train it now."""


class LossError(LabError, TypeError):
    """A `loss_fn` returned something that is not a scalar loss."""


class CheckpointError(LabError):
    """A checkpoint cannot be saved, found or loaded."""


class CallbackError(LabError):
    """A callback raised inside a hook while strict mode was on."""


class Terminated(SystemExit):
    """The process got SIGTERM: raised in the main thread so training unwinds, records the
    run as interrupted and flushes the store before the process exits (status 143)."""

    def __str__(self) -> str:
        return "terminated by SIGTERM"


class MetricError(LabError, ValueError):
    """A logged metric has a key or value the store cannot hold."""


class HookOrderError(LabError, RuntimeError):
    """A loop drove its run handle out of order: a step that goes backwards, a step logged
    before the handle started or after the run ended, a step begun twice or never ended."""


class RefusedMetric(MetricError):
    """A callback put a value that is not a number into a step's scalar metrics."""


class ExperienceError(ConfigError):
    """An RL experience batch is inconsistent: its tensors disagree in batch size."""


class TokenRejected(StoreError):
    """A `lab serve` server refused the token: it is wrong, revoked, or may not write."""


class ServerRejected(StoreError, ValueError):
    """A `lab serve` server refused a request as malformed; sending it again cannot help."""
