"""Non-scalar values a loop logs at a step: histograms and images (see `Callback.on_media`).

Two records travel through the `on_media` hook, and two functions make them:

- `histogram(values, bins, range)` counts a tensor, array or list into a `Histogram`. NaN,
  +inf and -inf are data: they are counted apart (`nan`, `posinf`, `neginf`), never binned
  and never an error. The finite values are binned as `numpy.histogram` bins them.
- `write_image(folder, key, step, image)` writes a PNG into a run folder, at
  ``<folder>/media/<key as a folder name>/step_<step, 6 digits>.png``, and returns an `Image`
  that points at it. The key never becomes a path as it is (see `key_folder`).

Sinks (the SQL store, wandb, a JSONL log) take the records from there.

>>> h = histogram([0.0, 1.0, 1.0, 2.0, float("nan")], bins=2)
>>> h.edges, h.counts, h.nan
((0.0, 1.0, 2.0), (1, 3), 1)
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab._metrics import check_key
from lab._names import safe_name
from lab._secrets import logger
from lab.errors import ConfigError, MetricError

if TYPE_CHECKING:  # numpy is imported where values are counted or drawn: the records need none
    import numpy as np

#: The folder of a run folder that holds its images.
MEDIA_DIR = "media"


@dataclass(frozen=True)
class Histogram:
    """A histogram at one step, JSON-friendly (tuples of plain numbers).

    `counts[i]` finite values fell in ``[edges[i], edges[i + 1])``, the last bin closed on
    both sides (as in `numpy.histogram`). NaN, +inf and -inf are counted apart in `nan`,
    `posinf` and `neginf`; finite values outside the edges (a `range` given by hand) are not
    counted at all.
    """

    edges: tuple[float, ...]
    counts: tuple[int, ...]
    nan: int = 0
    posinf: int = 0
    neginf: int = 0

    def __post_init__(self) -> None:
        if len(self.edges) != len(self.counts) + 1:
            raise ConfigError(
                f"a histogram needs one more edge than counts; got {len(self.edges)} edges "
                f"and {len(self.counts)} counts"
            )


@dataclass(frozen=True)
class Image:
    """An image at one step, written as a PNG file in the run's folder; `path` is that file."""

    path: Path
    width: int
    height: int


Media = Histogram | Image


def histogram(values: Any, bins: int = 64, range: tuple[float, float] | None = None) -> Histogram:
    """Count `values` (a tensor of any shape and device, a numpy array, a list) into `bins`
    equal bins over `range` (default: the smallest to the largest finite value).

    Why a record and not a tensor: the store, wandb and a JSONL log all keep bins and counts,
    and a histogram of a million weights is 64 numbers. A tensor is counted where it lies
    (on its GPU too): only the counts and a few numbers cross to the CPU; still,
    log histograms every N steps, not every step.
    The counts are exactly `numpy.histogram`'s, on every device: the edges are numpy's, and
    a value ``x`` is in bin ``i`` when ``edges[i] <= x < edges[i + 1]`` (the last bin closed).
    NaN and ±inf are counted apart (`Histogram.nan`, `posinf`, `neginf`). With no finite
    value and no `range`, the edges span [0, 1] and every count is 0; when every finite
    value is the same number v, they span [v - 0.5, v + 0.5], both as `numpy.histogram` does.

    >>> histogram([1, 2, 3, float("inf")], bins=2, range=(0, 4)).counts
    (1, 2)
    """
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ConfigError(f"histogram bins={bins!r}: give a whole number of bins, 1 or more")
    if range is not None:
        range = _check_range(range)
    if hasattr(values, "detach") and hasattr(values, "is_complex"):  # a torch tensor
        if values.device.type != "cpu":  # counted where it lies: only counts cross over
            return _tensor_histogram(values, bins, range)
        if values.is_complex():
            raise MetricError("histogram values are complex numbers; log .real, .imag or .abs()")
        import torch

        values = values.detach().to(torch.float64).numpy()  # one copy (none if float64)
    import numpy as np

    flat = _as_float64(values)
    nan = np.isnan(flat)
    posinf = np.isposinf(flat)
    neginf = np.isneginf(flat)
    finite = flat[~(nan | posinf | neginf)]
    if range is None:
        range = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    edges = _edges(*range, bins)
    counts, _ = np.histogram(finite, bins=bins, range=(float(edges[0]), float(edges[-1])))
    return Histogram(
        edges=tuple(float(e) for e in edges),
        counts=tuple(int(c) for c in counts),
        nan=int(nan.sum()),
        posinf=int(posinf.sum()),
        neginf=int(neginf.sum()),
    )


def _tensor_histogram(values: Any, bins: int, range: tuple[float, float] | None) -> Histogram:
    """`histogram` of a tensor, counted on its own device in float64."""
    import torch

    if values.is_complex():
        raise MetricError("histogram values are complex numbers; log .real, .imag or .abs()")
    x = values.detach().reshape(-1).to(torch.float64)
    finite_mask = torch.isfinite(x)
    finite = x[finite_mask]
    odd = torch.stack([torch.isnan(x).sum(), torch.isposinf(x).sum(), torch.isneginf(x).sum()])
    if range is None:
        lo, hi = torch.stack(torch.aminmax(finite)).tolist() if finite.numel() else (0.0, 1.0)
    else:
        lo, hi = range
    edges = _edges(lo, hi, bins)
    lo, hi = float(edges[0]), float(edges[-1])
    inside = finite[(finite >= lo) & (finite <= hi)]
    index = torch.bucketize(inside, torch.as_tensor(edges, device=x.device), right=True) - 1
    counts = torch.bincount(index.clamp_(max=bins - 1), minlength=bins)  # hi: the last bin
    *counted, nan, posinf, neginf = torch.cat([counts, odd]).tolist()  # one copy, one sync
    return Histogram(
        edges=tuple(float(e) for e in edges),
        counts=tuple(counted),
        nan=nan,
        posinf=posinf,
        neginf=neginf,
    )


def _edges(lo: float, hi: float, bins: int) -> np.ndarray:
    """The edges `numpy.histogram` uses for `bins` equal bins over [lo, hi] (one value:
    [v - 0.5, v + 0.5]); a `MetricError` line when float64 cannot make them distinct."""
    import numpy as np

    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    with np.errstate(over="ignore", invalid="ignore"):
        edges = np.linspace(lo, hi, bins + 1, endpoint=True, dtype=np.float64)
    if not (np.isfinite(edges).all() and (np.diff(edges) > 0).all()):
        raise MetricError(
            f"histogram: {bins} equal bins from {lo!r} to {hi!r} cannot be told apart in "
            "float64; give fewer bins or a narrower range=(low, high)"
        )
    return edges


def _as_float64(values: Any) -> np.ndarray:
    """`values` as a flat float64 array; one `MetricError` line for what is not numbers
    (complex numbers included: they have no order to bin by)."""
    import numpy as np

    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise MetricError(f"histogram values could not be read as numbers ({exc})") from None
    if array.dtype.kind == "c":
        raise MetricError("histogram values are complex numbers; log .real, .imag or abs()")
    if array.dtype.kind not in "biuf":
        raise MetricError(
            f"histogram values must be numbers; got an array of {array.dtype} "
            f"({_shown(values)}): log a tensor, an array or a list of numbers"
        )
    return array.astype(np.float64, copy=False).ravel()


def _check_range(range: Any) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in range)
    except (TypeError, ValueError):
        raise ConfigError(f"histogram range={range!r}: give two numbers (low, high)") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ConfigError(f"histogram range={range!r}: give finite numbers with low < high")
    return lo, hi


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- images --------------------------------------------------------------------------------


def key_folder(key: str, *, limit: int = 64) -> str:
    """The folder name of a media key: safe on every filesystem, distinct for distinct keys.

    A key made only of letters, digits, ``_``, ``.`` and ``-`` (and not starting with a dot)
    is its own folder name; any other gets its unsafe characters replaced and a hash of the
    whole key appended (`lab._names.safe_name`, as for run folders), so ``"train/weights"``
    and ``"train-weights"`` never share a folder.

    >>> key_folder("samples")
    'samples'
    >>> key_folder("../../etc")
    'etc-7baf5cb6'
    """
    return safe_name(key, limit=limit)


def stored_path(path: str | os.PathLike[str], folder: str | os.PathLike[str] | None) -> str:
    """An image's path as records keep it: relative to the run folder `folder` (POSIX
    separators) when it lies inside, else absolute, so the record holds wherever the run
    folder is read from."""
    resolved = Path(path).resolve()
    if folder is not None and resolved.is_relative_to(root := Path(folder).resolve()):
        return resolved.relative_to(root).as_posix()
    return str(resolved)


def image_bytes(image: Image) -> bytes | None:
    """The bytes of `image`'s PNG file: what a store keeps of it, so that no server ever
    opens a path to show it. None, with one warning line, when the file cannot be read
    (removed before its row was written); the row is still recorded, with its path."""
    try:
        return Path(image.path).read_bytes()
    except OSError as exc:
        logger("lab.media").warning(
            "lab: the image %s cannot be read (%s); its row keeps the path only",
            image.path, exc.strerror or type(exc).__name__,
        )  # fmt: skip
        return None


def image_path(folder: str | os.PathLike[str], key: str, step: int) -> Path:
    """Where `write_image` puts the image of `key` at `step` inside run folder `folder`."""
    return Path(folder) / MEDIA_DIR / key_folder(key) / f"step_{step:06d}.png"


def write_image(folder: str | os.PathLike[str], key: str, step: int, image: Any) -> Image:
    """Write `image` as a PNG into run folder `folder` (see `image_path`) and return its
    `Image` record; writing the same key and step again replaces the file.

    Why files: an image is bytes a viewer opens, and the store keeps a row that points at
    the file, as it keeps checkpoint folders. The file is written through a temporary name
    and renamed, so a reader or a kill never sees half a PNG.

    `image` is a matplotlib `Figure`, or pixels: a tensor or an array of shape HxW
    (grayscale), HxWxC or CxHxW with C = 1 (grayscale), 3 (RGB) or 4 (RGBA). A 3-D tensor
    is read as CxHxW first (torch's order), a 3-D array as HxWxC first (numpy's, PIL's),
    each falling back to the other when its channel count does not fit. Pixels are uint8
    (0-255 as they are), integers in 0-255, bools (black and white), or floats in [0, 1]:
    floats are clipped to [0, 1], NaN and -inf are drawn black and +inf white (they are
    data: an image of a NaN weight shows it). Anything else is one `MetricError` line.

    >>> write_image("runs/demo/r0", "samples", 3, np.zeros((8, 8)))    # doctest: +SKIP
    Image(path=PosixPath('runs/demo/r0/media/samples/step_000003.png'), width=8, height=8)
    """
    check_key(key, step)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise MetricError(f"image {key!r}: step {step!r} is not a whole number >= 0")
    figure = hasattr(image, "savefig")  # a matplotlib Figure
    pixels = None if figure else _pixels(key, step, image)  # bad pixels: no folder made
    path = image_path(folder, key, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if pixels is None:
            image.savefig(tmp, format="png")
        else:
            from PIL import Image as PILImage  # matplotlib's own dependency

            PILImage.fromarray(pixels).save(tmp, format="PNG")
        width, height = _png_size(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Image(path=path, width=width, height=height)


def _pixels(key: str, step: int, image: Any) -> np.ndarray:
    """`image` as uint8 pixels, HxW or HxWxC (C = 3 or 4); see `write_image`."""
    import numpy as np

    where = f"image {key!r} at step {step}"
    is_tensor = hasattr(image, "detach") and hasattr(image, "cpu")
    if is_tensor:
        tensor = image.detach().cpu()
        if tensor.is_floating_point():
            tensor = tensor.double()  # numpy has no bfloat16
        array = tensor.numpy()
    else:
        try:
            array = np.asarray(image)
        except (TypeError, ValueError) as exc:
            raise MetricError(f"{where} could not be read as pixels ({exc})") from None
    shape = tuple(array.shape)
    expected = "HxW, HxWxC or CxHxW with C = 1, 3 or 4"
    if array.ndim == 3:
        chw, hwc = shape[0] in (1, 3, 4), shape[2] in (1, 3, 4)
        if chw and (is_tensor or not hwc):
            array = array.transpose(1, 2, 0)
        elif not hwc:
            raise MetricError(f"{where} has shape {shape}; give {expected}")
        if array.shape[2] == 1:
            array = array[:, :, 0]
    elif array.ndim != 2:
        raise MetricError(f"{where} has shape {shape}; give {expected}")
    if array.size == 0:
        raise MetricError(f"{where} has shape {shape}, with no pixels; give {expected}")
    kind = array.dtype.kind
    if array.dtype == np.uint8:
        return np.ascontiguousarray(array)
    if kind == "b":
        return np.ascontiguousarray(array.astype(np.uint8) * 255)
    if kind in "iu":
        if array.min() < 0 or array.max() > 255:
            raise MetricError(
                f"{where} holds integers from {array.min()} to {array.max()}; give uint8 "
                "(0-255), or floats in [0, 1]"
            )
        return np.ascontiguousarray(array.astype(np.uint8))
    if kind == "f":
        scaled = np.nan_to_num(array, nan=0.0, posinf=1.0, neginf=0.0).clip(0.0, 1.0)
        return np.ascontiguousarray(np.rint(scaled * 255.0).astype(np.uint8))
    raise MetricError(
        f"{where} holds {array.dtype} values; give uint8 (0-255), bools or floats in [0, 1]"
    )


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk: the file says what was written."""
    with path.open("rb") as f:
        head = f.read(24)
    size = png_size(head)
    if size is None:
        raise MetricError(f"{path} is not a PNG file")
    return size


def png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the IHDR chunk at the start of a PNG's bytes, or None for bytes
    that do not start as a PNG: how a store checks the bytes it is handed before it keeps
    them, and takes their size from them rather than from whoever sent them."""
    head = bytes(data[:24])
    if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", head[16:24])
    return int(width), int(height)
