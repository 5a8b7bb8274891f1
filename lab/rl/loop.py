"""The on-policy loop: episodes that make experience with the policy, then learn from it.

`OnPolicyLoop.fit` reads top to bottom: set up the run handle, restore the episode counter on
resume, then each episode makes its experience, samples its rollouts into the store, learns
for `learn_epochs` epochs over minibatches of it (one optimizer step per learn batch, each a
step of the run), and saves at its boundary when one is due. Every hook fires in the run
handle (`lab.loop.handle.RunHandle`) or here, in the order `lab.hooks` writes down.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from lab._metrics import as_number
from lab.errors import ConfigError, LossError
from lab.hooks import Callback
from lab.loop.checkpoints import CheckpointConfig
from lab.loop.evals import Evaluator
from lab.loop.handle import RunHandle
from lab.loop.settings import LoopSettings, Setting
from lab.loop.steps import positive_int
from lab.records import Kind, LoopArtifacts, TrainingBatch
from lab.rl.experience import Experience
from lab.rl.hooks import RLHook
from lab.rl.rollouts import Rollouts

if TYPE_CHECKING:
    from lab.records import RunSpec

__all__ = ["RL_METRICS", "EpisodeInfo", "OnPolicyLoop"]

#: The step metrics the loop itself logs (the learn function adds its own): the episode's
#: at its last learn batch.
RL_METRICS: tuple[str, ...] = (
    "loss",
    "episode",
    "env_steps",
    "episode/return_mean",
    "episode/return_std",
    "episode/return_min",
    "episode/return_max",
    "episode/length_mean",
    "episode/count",
    "episode/nonfinite_rewards",
    "throughput/experience_per_s",
    "throughput/learn_per_s",
)

#: The key of the loop's entry in each checkpoint's payload.
STATE_KEY = "rl"


@dataclass
class EpisodeInfo:
    """What `make_experience` and `learn` see: where the run is.

    `generator` is the loop's own torch generator (seeded from the run's seed, saved in each
    checkpoint and restored on resume): draw an environment's or a minibatch's randomness
    from it and a resumed run draws the same. `device` is the loop's device (None: as is).
    """

    episode: int
    num_episodes: int
    step: int
    generator: torch.Generator
    device: torch.device | None = None

    @property
    def progress_remaining(self) -> float:
        """1 at the first episode, falling to 1/num_episodes at the last (SB3's linear
        schedules read it)."""
        return 1.0 - self.episode / self.num_episodes


class OnPolicyLoop:
    """Runs `num_episodes` episodes of on-policy RL on a `RunHandle`.

    Each episode calls `make_experience(info)` (the policy acts; no grad), then learns for
    `learn_epochs` epochs over minibatches of `batch_size` rows (None: all rows), shuffled
    from the loop's generator. `learn(batch, info)` returns ``{"loss": scalar tensor,
    **metrics}``; the loop zero-grads, backwards, clips to `max_grad_norm` and steps the
    optimizer, and the other values become the step's metrics. Pass the two functions, or
    subclass and override the methods. `scheduler` steps once per episode, after its last
    optimizer step and before the save at its end (so a resume continues the schedule).

    Checkpoints fall only at episode boundaries: with `checkpoint_unit="episodes"`,
    `CheckpointConfig`'s `every`, `ephemeral_every` and `fixed_steps` count episodes; with
    ``"steps"``, a save falls at the end of an episode that crossed one of those steps. A
    resume restores the episode counter, the loop's generator, the RNGs and the objects in
    `stateful` (an environment's state), and re-runs the episode a kill interrupted, so it
    continues the trajectory of a run that never stopped. `settings` (an environment's id,
    the number of environments...) are saved too: resuming with other settings,
    `learn_epochs`, `batch_size` or `shuffle` is one ConfigError naming each difference.

    A callback's `state.request_stop()` ends the loop at the end of the current episode
    (never inside one: a save there could not be resumed exactly).
    """

    # the settings the fit's run handle gets, as attributes of the loop (`lab.loop.settings`)
    scheduler = Setting()
    checkpoint = Setting()
    evaluators = Setting()
    callbacks = Setting()
    device = Setting()
    run_dir = Setting()
    resume = Setting()
    stateful = Setting()

    def __init__(
        self,
        policy: torch.nn.Module,
        optimizer: Any,
        *,
        num_episodes: int,
        make_experience: Callable[[EpisodeInfo], Experience] | None = None,
        learn: Callable[[Experience, EpisodeInfo], Mapping[str, Any]] | None = None,
        learn_epochs: int = 1,
        batch_size: int | None = None,
        shuffle: bool = True,
        max_grad_norm: float | None = None,
        scheduler: Any = None,
        checkpoint: CheckpointConfig | None = None,
        checkpoint_unit: Literal["episodes", "steps"] = "episodes",
        rollouts: Rollouts | None = None,
        settings: Mapping[str, Any] | None = None,
        stateful: Mapping[str, Any] | None = None,
        evaluators: Sequence[Evaluator] = (),
        callbacks: Sequence[Callback] = (),
        device: str | torch.device | None = None,
        run_dir: str | Path | None = None,
        resume: bool | str | Path | int | None = None,
    ) -> None:
        if make_experience is None and type(self).make_experience is OnPolicyLoop.make_experience:
            raise ConfigError(
                "OnPolicyLoop needs make_experience=fn(info) -> Experience, or a subclass "
                "that overrides make_experience"
            )
        if learn is None and type(self).learn is OnPolicyLoop.learn:
            raise ConfigError(
                "OnPolicyLoop needs learn=fn(batch, info) -> {'loss': tensor, ...}, or a "
                "subclass that overrides learn"
            )
        _check_numbers(num_episodes, learn_epochs, batch_size, checkpoint_unit, rollouts,
                       max_grad_norm)  # fmt: skip
        self.loop_settings = LoopSettings(
            scheduler=scheduler, checkpoint=checkpoint, evaluators=evaluators,
            callbacks=callbacks, device=device, resume=True if resume is None else resume,
            run_dir=run_dir, stateful=stateful,
        )  # fmt: skip
        self.policy = policy
        self.optimizer = optimizer
        self.num_episodes = num_episodes
        self._make_experience = make_experience
        self._learn = learn
        self.learn_epochs = learn_epochs
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.max_grad_norm = max_grad_norm
        self.checkpoint_unit = checkpoint_unit
        self.rollouts = rollouts
        self.settings = _plain_settings(settings)
        #: The run handle while `fit` runs (None otherwise): log histograms, evals from it.
        self.handle: RunHandle | None = None

    # ------------------------------------------------------------------------------------
    # what a subclass may override
    def make_experience(self, info: EpisodeInfo) -> Experience:
        """Act with the policy and return the episode's experience (called under no_grad)."""
        assert self._make_experience is not None
        return self._make_experience(info)

    def learn(self, batch: Experience, info: EpisodeInfo) -> Mapping[str, Any]:
        """The loss of one learn batch and its metrics: ``{"loss": tensor, **metrics}``."""
        assert self._learn is not None
        return self._learn(batch, info)

    # ------------------------------------------------------------------------------------
    def fit(self, run: RunSpec | None = None) -> LoopArtifacts:
        """Run the episodes (resuming the run's latest checkpoint if any) and return what
        the run leaves: the policy, its final metrics, its checkpoints and evals."""
        seed = run.seed if run is not None else torch.initial_seed()
        self._seed = int(seed) % (2**63)
        self._generator = torch.Generator().manual_seed(self._seed)
        settings = replace(self.loop_settings, metrics=RL_METRICS, more_metrics=True)
        handle = RunHandle.from_settings(run, self.policy, self.optimizer, settings)
        self._episodes_done = 0
        self._env_steps = 0
        self._span = (0, 0)  # the steps (start, end] of the episode that ended last
        handle.loop_state[STATE_KEY] = None  # filled by a resume, then at each save
        if self.checkpoint is not None:
            handle.save_kind = self._save_kind
        self.handle = handle
        try:
            with handle:
                if handle.resumed_from is not None:
                    self._restore(handle.loop_state[STATE_KEY], handle.resumed_from)
                self._run(handle)
        finally:
            self.handle = None
        assert handle.artifacts is not None
        return handle.artifacts

    def _run(self, loop: RunHandle) -> None:
        # -- set up ------------------------------------------------------------------------
        state, hooks = loop.state, loop.hooks
        policy, optimizer = self.policy, self.optimizer
        params = [p for p in policy.parameters() if p.requires_grad]
        clip = self.max_grad_norm
        step_batch = TrainingBatch()
        learn_start = hooks.listens(RLHook.LEARN_BATCH_START)
        learn_end = hooks.listens(RLHook.LEARN_BATCH_END)
        while self._episodes_done < self.num_episodes and not state.stop_requested:
            episode = self._episodes_done
            info = EpisodeInfo(episode, self.num_episodes, state.step, self._generator, self.device)
            hooks.fire(RLHook.EPISODE_START, state, episode)
            experience, made = self._experience(loop, info)
            summary = _episode_metrics(experience)
            # -- learn: epochs of minibatches, one optimizer step each ------------------
            per_epoch = experience.num_minibatches(self.batch_size)
            size = (experience.size, per_epoch)
            learn_started = time.perf_counter()
            for epoch in range(self.learn_epochs):
                hooks.fire(RLHook.LEARN_EPOCH_START, state, epoch)
                batches = experience.minibatches(
                    self.batch_size, generator=self._generator, shuffle=self.shuffle
                )
                for i, batch in enumerate(batches):
                    step_idx = state.step + 1
                    if learn_start:
                        hooks.fire(RLHook.LEARN_BATCH_START, state, step_idx, batch)
                    step_batch.data, step_batch.epoch, step_batch.index = batch, epoch, i
                    loop.pre_step(step_batch)
                    out = self.learn(batch, info)
                    loss = _loss_of(out)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    grad_norm = (
                        torch.nn.utils.clip_grad_norm_(params, clip) if clip is not None else None
                    )
                    optimizer.step()
                    metrics = _step_metrics(out, loss, grad_norm, step_idx)
                    last = epoch == self.learn_epochs - 1 and i == per_epoch - 1
                    save = False
                    if last:  # the episode's metrics join its last step, where it may save
                        metrics.update(summary)
                        timing = (made, time.perf_counter() - learn_started)
                        save = self._episode_done(loop, info, size, timing, metrics)
                    loop.end_step(metrics, step_batch, save=save)
                    if learn_end:
                        hooks.fire(RLHook.LEARN_BATCH_END, state, step_idx, batch, metrics)
                hooks.fire(RLHook.LEARN_EPOCH_END, state, epoch)
            hooks.fire(RLHook.EPISODE_END, state, episode)

    def _experience(self, loop: RunHandle, info: EpisodeInfo) -> tuple[Experience, float]:
        """The episode's experience (the policy acts, without gradients), on `device`, and
        the seconds it took; a rollout sample is evaluated when one is due."""
        state, hooks, episode = loop.state, loop.hooks, info.episode
        hooks.fire(RLHook.MAKE_EXPERIENCE_START, state, episode)
        started = time.perf_counter()
        with torch.no_grad():
            experience = self.make_experience(info)
        if not isinstance(experience, Experience):
            raise ConfigError(
                f"make_experience returned a {type(experience).__name__}; return a "
                "lab.rl.Experience"
            )
        if self.device is not None:
            experience = experience.to(self.device)
        made = time.perf_counter() - started
        hooks.fire(RLHook.MAKE_EXPERIENCE_END, state, episode, experience)
        rollouts = self.rollouts
        if rollouts is not None and rollouts.due(episode):
            sample = rollouts.sample(experience, seed=self._seed, episode=episode)
            loop.evaluate(Evaluator(rollouts.name, lambda _model, s=sample: s))
        return experience, made

    def _episode_done(
        self,
        loop: RunHandle,
        info: EpisodeInfo,
        size: tuple[int, int],
        timing: tuple[float, float],
        metrics: dict[str, float],
    ) -> bool:
        """At the episode's last optimizer step: count it, add its metrics (`size`: its rows
        of experience and minibatches per epoch; `timing`: the seconds making and learning
        from them took), step the scheduler, and say whether a checkpoint is due after it
        (keeping what it would save)."""
        (rows, per_epoch), (made, learned) = size, timing
        self._env_steps += rows
        self._episodes_done = info.episode + 1
        metrics["episode"] = float(info.episode)
        metrics["env_steps"] = float(self._env_steps)
        metrics["throughput/experience_per_s"] = _rate(rows, made)
        metrics["throughput/learn_per_s"] = _rate(rows * self.learn_epochs, learned)
        if self.scheduler is not None:  # before the save, so a resume
            self.scheduler.step()  # starts the next episode at its rate
        save = self._save_due(loop.state, loop.state.step + 1, per_epoch)
        if self.checkpoint is not None:  # what a save here would keep
            loop.loop_state[STATE_KEY] = self._state()
        return save

    # ------------------------------------------------------------------------------------
    # checkpoints at episode boundaries
    def _save_due(self, state: Any, step: int, per_epoch: int) -> bool:
        """Whether the episode that ends at optimizer step `step` saves after it."""
        config = self.checkpoint
        if config is None:
            return False
        done, total = self._episodes_done, self.num_episodes
        end = config.save_at_end and (done == total or state.stop_requested)
        if self.checkpoint_unit == "episodes":
            due = config.due(done, total) and not (
                state.ephemeral_checkpoints_blocked and config.is_ephemeral(done, total)
            )
            return due or end
        start = step - per_epoch * self.learn_epochs  # the step before the episode's first
        self._span = (start, step)
        crossed = self._crossed(start, step)
        if crossed == "ephemeral" and state.ephemeral_checkpoints_blocked:
            crossed = None
        return crossed is not None or end

    def _crossed(self, start: int, end: int) -> Kind | None:
        """The strongest save the steps (start, end] call for: a fixed step, a multiple of
        `every`, or one of `ephemeral_every`; None when they cross none."""
        config = self.checkpoint
        assert config is not None
        if any(start < s <= end for s in config.fixed_steps):
            return "fixed"
        if config.every is not None and end // config.every > start // config.every:
            return "regular"
        if config.ephemeral_every is not None and (
            end // config.ephemeral_every > start // config.ephemeral_every
        ):
            return "ephemeral"
        return None

    def _save_kind(self, step: int, final: bool) -> Kind:
        """How the save after the current episode is kept, in the loop's checkpoint unit."""
        config = self.checkpoint
        assert config is not None
        done, total = self._episodes_done, self.num_episodes
        if self.checkpoint_unit == "episodes" or step == 0:
            return config.kind(done if step else 0, total, final=final)
        at_end = config.save_at_end and (final or done == total)
        crossed = self._crossed(*self._span)
        if crossed == "ephemeral" and at_end:
            return "regular"
        return crossed or "regular"

    def _state(self) -> dict[str, Any]:
        """The loop's entry in a checkpoint: the episode counter, the settings it ran with,
        and its generator."""
        return {
            "episode": self._episodes_done,
            "env_steps": self._env_steps,
            "generator": self._generator.get_state(),
            "settings": dict(self.settings),
            "learn_epochs": self.learn_epochs,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
        }

    def _restore(self, saved: Any, path: Path) -> None:
        """Take the episode counter and generator back from a checkpoint, after checking
        that it was made with the same settings."""
        if not isinstance(saved, Mapping):
            raise ConfigError(
                f"checkpoint {path} was not saved by an OnPolicyLoop (it has no episode "
                "counter); resume it with the loop that saved it, or start fresh with "
                "resume=False"
            )
        now = {
            **{f"settings[{k!r}]": v for k, v in self.settings.items()},
            "learn_epochs": self.learn_epochs,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
        }
        then = {
            **{f"settings[{k!r}]": v for k, v in (saved.get("settings") or {}).items()},
            "learn_epochs": saved.get("learn_epochs"),
            "batch_size": saved.get("batch_size"),
            "shuffle": saved.get("shuffle"),
        }
        missing = object()
        diffs = [
            f"{key} {then.get(key, missing)!r} -> {now.get(key, missing)!r}".replace(
                repr(missing), "unset"
            )
            for key in [*then, *(k for k in now if k not in then)]
            if then.get(key, missing) != now.get(key, missing)
        ]
        if diffs:
            raise ConfigError(
                f"cannot resume from {path}: the loop's settings differ from those it was "
                f"saved with ({'; '.join(diffs)}); resume with the saved settings, or start "
                "fresh with resume=False (or a new run)"
            )
        self._episodes_done = int(saved["episode"])
        self._env_steps = int(saved.get("env_steps", 0))
        self._generator.set_state(saved["generator"])


# ----------------------------------------------------------------------------------------
# metrics


def _check_numbers(
    num_episodes: Any,
    learn_epochs: Any,
    batch_size: Any,
    checkpoint_unit: Any,
    rollouts: Any,
    max_grad_norm: Any,
) -> None:
    """The loop's counts and limits, each checked in one line that says what to give."""
    if not positive_int(num_episodes):
        raise ConfigError(f"num_episodes={num_episodes!r}: give an int >= 1")
    if not positive_int(learn_epochs):
        raise ConfigError(f"learn_epochs={learn_epochs!r}: give an int >= 1")
    if batch_size is not None and not positive_int(batch_size):
        raise ConfigError(
            f"batch_size={batch_size!r}: give rows per learn batch, an int >= 1, or None "
            "for all rows"
        )
    if checkpoint_unit not in ("episodes", "steps"):
        raise ConfigError(f"checkpoint_unit={checkpoint_unit!r}: use 'episodes' or 'steps'")
    if rollouts is not None and not isinstance(rollouts, Rollouts):
        raise ConfigError(f"rollouts={rollouts!r}: pass Rollouts(size=..., every=...)")
    if max_grad_norm is not None and not (
        isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0
    ):
        raise ConfigError(f"max_grad_norm={max_grad_norm!r}: give a number > 0, or None")


def _plain_settings(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """The settings as a dict of plain values (what a checkpoint can hold and compare)."""
    if settings is None:
        return {}
    if not isinstance(settings, Mapping):
        raise ConfigError(f"settings={settings!r}: give a dict, e.g. {{'env': 'CartPole-v1'}}")
    out = {}
    for key, value in settings.items():
        if not isinstance(key, str):
            raise ConfigError(f"settings keys must be strings, got {key!r}")
        if not isinstance(value, (str, int, float, bool, type(None), list, tuple)):
            raise ConfigError(
                f"settings[{key!r}] is a {type(value).__name__}; give plain values (str, "
                "number, bool, None, list) that a checkpoint can keep and compare"
            )
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


def _loss_of(out: Any) -> torch.Tensor:
    if not isinstance(out, Mapping) or "loss" not in out:
        raise LossError(
            f"learn returned {type(out).__name__}; return a dict with a scalar 'loss' tensor "
            "(and any other metrics)"
        )
    loss = out["loss"]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise LossError(
            "learn's 'loss' must be a scalar tensor that requires grad; compute it from the "
            "policy's outputs, outside torch.no_grad()"
        )
    return loss


def _step_metrics(
    out: Mapping[str, Any], loss: torch.Tensor, grad_norm: torch.Tensor | None, step: int
) -> dict[str, float]:
    metrics = {"loss": loss.item()}
    for key, value in out.items():
        if key != "loss":  # a float as it is; tensors and other numbers converted
            metrics[key] = value if type(value) is float else as_number(str(key), step, value)
    if grad_norm is not None:
        metrics["grad_norm"] = float(grad_norm)
    return metrics


def _rate(rows: float, seconds: float) -> float:
    return rows / seconds if seconds > 0 else math.inf


def _episode_metrics(experience: Experience) -> dict[str, float]:
    """The episode's metrics: returns and lengths of the episodes that ended, and how many
    rewards were NaN or inf (data, flagged here, never an error). Once per episode, in plain
    Python over the ended episodes (a few tensor ops on the rewards)."""
    rewards = experience.rewards.detach()
    mask = experience.action_mask
    finite = torch.isfinite(rewards)
    nonfinite = 0
    if not bool(finite.all()):
        if mask is not None and mask.shape == rewards.shape:
            nonfinite = int(((~finite) & mask.bool()).sum())
        else:
            nonfinite = int((~finite).sum())
    ended = experience.ended_episodes()
    out = {
        "episode/count": float(len(ended.returns)),
        "episode/nonfinite_rewards": float(nonfinite),
    }
    returns = ended.returns
    if returns:
        n = len(returns)
        mean = math.fsum(returns) / n
        out["episode/return_mean"] = mean
        out["episode/return_std"] = math.sqrt(math.fsum((r - mean) ** 2 for r in returns) / n)
        nan = any(r != r for r in returns)  # NaN is data: it shows in min and max too
        out["episode/return_min"] = math.nan if nan else min(returns)
        out["episode/return_max"] = math.nan if nan else max(returns)
        out["episode/length_mean"] = sum(ended.lengths) / len(ended.lengths)
    return out
