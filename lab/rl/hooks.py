"""The on-policy RL hooks (ColossalChat's trainer phases, typed), registered with the core.

`RLHook` names the eight hooks `lab.rl.OnPolicyLoop` fires around the steps of a run: an
episode makes its experience, then learns from it in epochs of learn batches, each learn
batch one step. They register with `lab.hooks` (`register_hooks`) when `lab` is imported, so
every `lab.Callback` has their methods, a dispatcher fires them in phase order with the same
failure policy as any hook, and the lifecycle in `lab.hooks`' docstring shows them in place:
the start hooks after `on_epoch_start`, the end hooks after `on_checkpoint`.

This module is light (no torch), since ``import lab`` imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lab.hooks import Hook, HookEnum, register_hooks

if TYPE_CHECKING:
    from lab.hooks import LoopState
    from lab.rl.experience import Experience

__all__ = ["RLHook"]


class RLHook(HookEnum):
    """The on-policy RL hooks, in lifecycle order: a member's value is the `lab.Callback`
    method it calls (``hooks.fire(RLHook.EPISODE_START, state, episode)``)."""

    EPISODE_START = "on_episode_start"
    MAKE_EXPERIENCE_START = "on_make_experience_start"
    MAKE_EXPERIENCE_END = "on_make_experience_end"
    LEARN_EPOCH_START = "on_learn_epoch_start"
    LEARN_BATCH_START = "on_learn_batch_start"
    LEARN_BATCH_END = "on_learn_batch_end"
    LEARN_EPOCH_END = "on_learn_epoch_end"
    EPISODE_END = "on_episode_end"


class _CallbackMethods:
    """The methods `lab.Callback` gets for the RL hooks: each does nothing until overridden."""

    def on_episode_start(self, state: LoopState, episode: int) -> None:
        """Before episode `episode` (0-based) makes its experience."""

    def on_make_experience_start(self, state: LoopState, episode: int) -> None:
        """Right before the policy acts to make episode `episode`'s experience."""

    def on_make_experience_end(
        self, state: LoopState, episode: int, experience: Experience
    ) -> None:
        """After the experience was made, before its rollout sample and the first learn
        batch: the whole `experience` of the episode."""

    def on_learn_epoch_start(self, state: LoopState, epoch: int) -> None:
        """Before the first learn batch of learn epoch `epoch` (0-based, within the episode)."""

    def on_learn_batch_start(self, state: LoopState, step_idx: int, batch: Experience) -> None:
        """Before learn batch `batch` (a minibatch of the experience) becomes step
        `step_idx`; `pre_step` follows."""

    def on_learn_batch_end(
        self, state: LoopState, step_idx: int, batch: Experience, metrics: dict[str, float]
    ) -> None:
        """After step `step_idx`'s hooks, evals and save: the learn batch and the step's
        metrics (the episode's metrics too, at its last batch)."""

    def on_learn_epoch_end(self, state: LoopState, epoch: int) -> None:
        """After learn epoch `epoch`'s last learn batch."""

    def on_episode_end(self, state: LoopState, episode: int) -> None:
        """After episode `episode`'s last learn epoch (and the save at its boundary)."""


#: Where the start hooks fire: after `on_epoch_start`, before the step of each learn batch.
_BEFORE_STEPS = """\
[an on-policy loop (lab.rl.OnPolicyLoop), each episode from 0:
 on_episode_start(state, episode)
 on_make_experience_start(state, episode)
 on_make_experience_end(state, episode, experience)
 [its rollout sample: the eval hooks below, at the current step]
 each learn epoch: on_learn_epoch_start(state, epoch)
   each learn batch, which is one step below:
     on_learn_batch_start(state, step_idx, batch)]
"""

#: Where the end hooks fire: after the step's saves (an on-policy loop saves only after an
#: episode's last step), before `on_epoch_end`.
_AFTER_SAVES = """\
[the on-policy loop, after each step (learn batch), which saves only after
 an episode's last step:
     on_learn_batch_end(state, step_idx, batch, metrics)
   after each learn epoch's last batch:
     on_learn_epoch_end(state, epoch)
 after the episode's last learn epoch:
 on_episode_end(state, episode)]
"""

_START, _END = tuple(RLHook)[:5], tuple(RLHook)[5:]
register_hooks(_START, after=Hook.EPOCH_START, methods=_CallbackMethods, lifecycle=_BEFORE_STEPS)
register_hooks(_END, after=Hook.CHECKPOINT, methods=_CallbackMethods, lifecycle=_AFTER_SAVES)
