"""Non-scalar values a loop logs at a step: histograms and images (see `Callback.on_media`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Histogram:
    """A histogram at one step: `counts[i]` values fell in ``[edges[i], edges[i + 1])``."""

    edges: tuple[float, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True)
class Image:
    """An image at one step, written as a file in the run's folder; `path` is that file."""

    path: Path
    width: int
    height: int


Media = Histogram | Image
