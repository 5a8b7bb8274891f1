"""Where this process sits under a launcher such as `torchrun`: its rank, from the environment.

Until runs train across ranks (DDP), an Experiment under ``torchrun`` runs every run on
rank 0 alone; the other ranks return at once, so no run is trained or recorded twice.
"""

from __future__ import annotations

import os

from lab.errors import ConfigError


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a whole number; unset it, or launch with torchrun, which "
            "sets RANK and WORLD_SIZE"
        ) from None
    if value < 0:
        raise ConfigError(f"{name}={raw!r} must be >= 0; unset it, or launch with torchrun")
    return value


def launcher_rank() -> tuple[int, int] | None:
    """``(rank, world_size)`` when a launcher started several processes (``WORLD_SIZE`` > 1),
    else None. A malformed ``RANK`` or ``WORLD_SIZE`` is a `ConfigError`."""
    world = _env_int("WORLD_SIZE")
    if world is None or world <= 1:
        return None
    rank = _env_int("RANK")
    if rank is None:
        raise ConfigError(
            f"WORLD_SIZE={world} but RANK is not set; launch with torchrun, which sets both"
        )
    if rank >= world:
        raise ConfigError(f"RANK={rank} must be below WORLD_SIZE={world}")
    return rank, world
