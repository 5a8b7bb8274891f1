"""ColossalChat's trainer callbacks, ported by renaming an import.

A callback written for ColossalChat's on-policy trainer::

    from coati.trainer.callbacks import Callback      # before
    from lab.rl.coati import Callback                 # after

keeps its methods and their signatures (``on_fit_start()``, ``on_episode_start(episode)``,
``on_make_experience_end(experience)``, ``on_learn_batch_end(experience)``...) and is
attached to an `OnPolicyLoop` (or an Experiment) like any `lab.Callback`. The dispatcher asks
the class's `lab_hook_adapter` once, when it resolves who listens to which hook, for what
receives each of lab's typed hooks: a small forwarder that drops the loop state (and the
arguments ColossalChat's signature lacks) for the hooks the callback overrides, nothing for
those it does not. Ordinary callbacks have no adapter and pay nothing for this.

``on_train_start`` maps to ``on_fit_start`` and ``on_train_end`` to ``on_fit_end``; the
other lab hooks (``on_step_end``, ``on_checkpoint``...) reach such a callback under their own
names and signatures when it overrides them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lab.hooks import Callback as LabCallback

if TYPE_CHECKING:
    from lab.rl.experience import Experience

__all__ = ["Callback"]


class _Forward:
    """Calls a ColossalChat-signature method with the arguments it takes out of a lab hook's.

    `pick` lists the positions of lab's arguments to pass on. It keeps `__self__`, as a
    bound method does, so the dispatcher records a failure against the callback.
    """

    __slots__ = ("__self__", "method", "pick")

    def __init__(self, owner: Any, method: Callable[..., Any], pick: tuple[int, ...]) -> None:
        self.__self__ = owner
        self.method = method
        self.pick = pick

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.method(*(args[i] for i in self.pick))


#: lab's hook -> (ColossalChat's method, the positions of lab's arguments it takes)
_MAP: dict[str, tuple[str, tuple[int, ...]]] = {
    "on_train_start": ("on_fit_start", ()),
    "on_train_end": ("on_fit_end", ()),
    "on_episode_start": ("on_episode_start", (1,)),
    "on_episode_end": ("on_episode_end", (1,)),
    "on_make_experience_start": ("on_make_experience_start", ()),
    "on_make_experience_end": ("on_make_experience_end", (2,)),
    "on_learn_epoch_start": ("on_learn_epoch_start", (1,)),
    "on_learn_epoch_end": ("on_learn_epoch_end", (1,)),
    "on_learn_batch_start": ("on_learn_batch_start", ()),
    "on_learn_batch_end": ("on_learn_batch_end", (2,)),
}


def _adapter(callback: Callback, hook: str) -> Callable[..., Any] | None:
    """What receives lab's `hook` for a ColossalChat-signature `callback` (None: nothing)."""
    mapped = _MAP.get(hook)
    if mapped is not None:
        name, pick = mapped
        if getattr(type(callback), name) is getattr(Callback, name):
            return None  # not overridden: it does not listen
        return _Forward(callback, getattr(callback, name), pick)
    if getattr(type(callback), hook, None) is getattr(LabCallback, hook):
        return None
    return getattr(callback, hook)


class Callback(LabCallback):
    """ColossalChat's on-policy trainer callback: override the phases you need.

    Its hooks take ColossalChat's arguments (no loop state); lab's dispatcher reaches them
    through `lab_hook_adapter`. Priority, error isolation and `state_dict` work as for any
    `lab.Callback`.
    """

    #: Resolves, once per listener build, what receives each lab hook (see the module).
    lab_hook_adapter = staticmethod(_adapter)

    def on_fit_start(self) -> None:
        """Once, before the first episode (lab's `on_train_start`)."""

    def on_fit_end(self) -> None:
        """Once, after the last episode (lab's `on_train_end`)."""

    def on_episode_start(self, episode: int) -> None:
        """Before episode `episode` makes its experience."""

    def on_episode_end(self, episode: int) -> None:
        """After episode `episode`'s last learn epoch."""

    def on_make_experience_start(self) -> None:
        """Right before the policy acts."""

    def on_make_experience_end(self, experience: Experience) -> None:
        """After the episode's experience was made."""

    def on_learn_epoch_start(self, epoch: int) -> None:
        """Before learn epoch `epoch`."""

    def on_learn_epoch_end(self, epoch: int) -> None:
        """After learn epoch `epoch`."""

    def on_learn_batch_start(self) -> None:
        """Before each learn batch (an optimizer step)."""

    def on_learn_batch_end(self, experience: Experience) -> None:
        """After each learn batch, with the minibatch it learned from."""
