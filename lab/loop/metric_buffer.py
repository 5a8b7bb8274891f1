"""The step metrics a run handle holds on their device between two reads (`log_every`).

With ``log_every=N`` a step's metrics (one-element tensors: the loss, the gradient norm) are
not read on the host as the step ends: they are held here, with the step's number and its
batch's epoch and index, and read for all the held steps at once (one transfer per device,
one collective under DDP) at the next materialisation. The run handle says when that is,
and fires each held step's `on_step_end` then, in order. With ``log_every=1`` nothing is
held: a step's metrics go through `floats` as it ends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lab._distributed import MetricReducer
from lab._metrics import all_floats, as_number
from lab._secrets import logger
from lab.hooks import Callback

__all__ = ["MetricBuffer", "floats", "to_host"]

log = logger("lab.loop")

#: A held step: its number, its metrics (tensors still on their device), the batch's epoch
#: and its index.
Held = tuple[int, dict[str, Any], int, int]


class MetricBuffer:
    """The steps ended since the last materialisation, and how often one falls.

    `log_every` is what the loop asked for; `every` what is in effect (1 while a callback
    that must see each step live is attached: `in_effect`).
    """

    def __init__(self, log_every: int) -> None:
        self.log_every = log_every
        self.every = log_every
        self.held: list[Held] = []

    def in_effect(self, callbacks: Sequence[Callback]) -> int:
        """`log_every`, or 1 while a callback whose `on_step_end` must see its own step live
        (`Callback.live_steps`: the model, the gradients, the clock) is attached."""
        if self.log_every == 1:
            return 1
        live = sorted({type(cb).__name__ for cb in callbacks if cb.live_steps})
        if not live:
            return self.log_every
        log.info(
            "log_every=%d: every step materialises its metrics, as %s must see each step "
            "live (live_steps)", self.log_every, ", ".join(live),
        )  # fmt: skip
        return 1

    def hold(self, step: int, metrics: Mapping[str, Any], epoch: int, index: int) -> None:
        """Keep `step`'s metrics without reading them: its tensors stay on their device until
        the next materialisation, so the host never waits for the device here. Only the
        batch's epoch and index are kept: its data is not held alive (`log_every` batches
        on a GPU could fill it)."""
        held = dict(metrics)
        for key, value in held.items():
            if type(value) is float:
                continue
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:  # the same error as at a materialised step, now
                    as_number(str(key), step, value)
                held[key] = value.detach()
            else:
                held[key] = as_number(str(key), step, value)
        self.held.append((step, held, epoch, index))

    def read(
        self, step: int | None, metrics: Mapping[str, Any] | None, reducer: MetricReducer | None
    ) -> tuple[list[Held], list[dict[str, float]]]:
        """The held steps (emptied here) and the floats of each, then of `metrics` of `step`
        (the step being ended) when given: read on the host in one transfer per device and
        reduced across ranks in one collective."""
        held = self.held
        steps = [entry[0] for entry in held]
        rows = [entry[1] for entry in held]
        if metrics is not None:
            assert step is not None
            steps.append(step)
            rows.append(dict(metrics))
        # one row (log_every=1, or a step right after a materialisation): the fast path
        clean = to_host(rows, steps) if held else [floats(rows[0], steps[0])]
        # read: a value that is no number (a MetricError) has left the held steps held
        self.held = []
        if reducer is not None:  # one collective for all of them
            clean = reducer.reduce_steps(clean, steps)
        return held, clean

    def named(self) -> str:
        """The held steps, as a message names them."""
        held = self.held
        return f"steps {held[0][0]}-{held[-1][0]}" if len(held) > 1 else f"step {held[0][0]}"


def to_host(rows: list[dict[str, Any]], steps: list[int]) -> list[dict[str, float]]:
    """Each step's metrics as floats. The tensors are read in one transfer per device
    (stacked by dtype, then as float64: exactly the values `.item()` gives), whose one sync
    is the only wait for the device; on a CPU the same stack costs less than an `.item()`
    per value. A float passes as it is; other numbers convert through `as_number`."""
    out: list[dict[str, Any]] = []
    found: dict[torch.device, list[tuple[int, str, torch.Tensor]]] = {}
    for i, (row, step) in enumerate(zip(rows, steps, strict=True)):
        for key, value in row.items():
            if type(value) is float:  # most of them: a host value, one type test
                continue
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:  # the error that names the key and the step
                    as_number(str(key), step, value)
                found.setdefault(value.device, []).append((i, key, value))
            else:
                row[key] = as_number(str(key), step, value)
        out.append(row)
    for entries in found.values():
        by_dtype: dict[torch.dtype, list[int]] = {}
        for j, (_, _, tensor) in enumerate(entries):
            by_dtype.setdefault(tensor.dtype, []).append(j)
        parts = [torch.stack([entries[j][2].reshape(()) for j in js]) for js in by_dtype.values()]
        stacked = torch.cat([part.double() for part in parts])
        order = [j for js in by_dtype.values() for j in js]
        for j, value in zip(order, stacked.tolist(), strict=True):  # the one transfer
            i, key, _ = entries[j]
            out[i][key] = value
    return out


def floats(metrics: Mapping[str, Any], step: int) -> dict[str, float]:
    """One step's metrics as floats: a float passes as it is (a step of floats alone, the
    common case, is a copy and one pass in C: `all_floats`); other numbers and CPU tensors
    are converted; a tensor on an accelerator sends the step through `to_host`, for one
    transfer instead of one each."""
    out = dict(metrics)
    if all_floats(out.values()):  # the common case: one pass in C
        return out
    for key, value in out.items():
        if type(value) is not float:
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                return to_host([out], [step])[0]
            out[key] = as_number(str(key), step, value)
    return out
