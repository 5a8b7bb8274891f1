"""The loop's optimizers: one, a list, or a dict of named ones (a GAN's generator and
discriminator), and which of them need a closure to step (LBFGS).

With one optimizer the loop's default step zeroes, back-propagates, clips and steps it. With
several it cannot know which loss goes to which, so a custom ``train_step`` is required and
does its own steps. Every optimizer's state is saved in each checkpoint under its name (a
list's are named ``"0"``, ``"1"``...) and restored on resume.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from lab.errors import ConfigError

__all__ = ["as_optimizers", "needs_closure"]

_METHODS = ("step", "zero_grad", "state_dict", "load_state_dict")


def as_optimizers(given: Any) -> dict[str, torch.optim.Optimizer]:
    """{name: optimizer} from an optimizer, a list or tuple of them, or a dict of them.

    Anything else is a `ConfigError` that says what to pass.
    """
    if isinstance(given, dict):
        named = {str(name): opt for name, opt in given.items()}
    elif isinstance(given, (list, tuple)):
        named = {str(i): opt for i, opt in enumerate(given)}
    else:
        named = {"optimizer": given}
    if not named:
        raise ConfigError("optimizer: give a torch optimizer, or a list or dict of them")
    for name, opt in named.items():
        missing = [m for m in _METHODS if not callable(getattr(opt, m, None))]
        if missing:
            where = "optimizer" if name == "optimizer" else f"optimizer[{name!r}]"
            raise ConfigError(
                f"{where} is a {type(opt).__name__}, not an optimizer (no {missing[0]}()); "
                "give a torch.optim optimizer, or a list or dict of them"
            )
    return named


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` must get a closure that re-evaluates the loss (LBFGS)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        return True
    try:
        params = inspect.signature(optimizer.step).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "closure" and p.default is p.empty for p in params)
