"""A vector of gymnasium classic-control environments that a checkpoint saves and restores exactly.

`GymVectorEnv` steps N copies of one environment as stable-baselines3's `DummyVecEnv` does
(an episode that ends is reset in the same step; its last observation is kept apart, so that
a timeout can be bootstrapped with V of it), keeps each env's running episode return and
length as SB3's `Monitor` does, and hands tensors in and out.

Its `state_dict()` is everything that decides what the environments do next, as plain
tensors, lists and numbers that a checkpoint loads with `weights_only=True`: each env's
physical state (`unwrapped.state` and its kin), its `np_random` bit generator, the
TimeLimit's elapsed steps, the current observations and the running returns and lengths.
Passed as `OnPolicyLoop(stateful={"env": env})`, a resume continues the environments
bit-identically, as if the run had never stopped.

gymnasium is an optional extra (``pip install 'lab[rl]'``), imported when an env is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lab.errors import ConfigError

# The attributes of a classic-control env that change as it runs (the rest are constants set
# in its __init__): the physical state, CartPole's count of steps past the end, Pendulum's
# last torque (drawn by render).
_DYNAMIC = ("state", "steps_beyond_terminated", "last_u")


@dataclass
class EnvStep:
    """What one step of all N environments gave: tensors on dim 0 = the env index."""

    observations: Tensor  # after the step; a new episode's first where one ended
    rewards: Tensor  # float32
    terminated: Tensor  # bool: the episode reached a terminal state
    truncated: Tensor  # bool: the episode was cut (TimeLimit)
    final_observations: Tensor  # the observation each episode ended on (else = observations)
    episode_returns: list[float]  # of the episodes that ended in this step, by env index
    episode_lengths: list[int]

    @property
    def dones(self) -> Tensor:
        """Where an episode ended (terminated or truncated): GAE's `dones`."""
        return self.terminated | self.truncated

    @property
    def timeouts(self) -> Tensor:
        """Where an episode was cut but not terminated: SB3 bootstraps these with V(final)."""
        return self.truncated & ~self.terminated


class GymVectorEnv:
    """N gymnasium classic-control envs of one id, seeded seed, seed + 1, ..., resumable.

    >>> env = GymVectorEnv("CartPole-v1", 2, seed=0)
    >>> env.observations.shape, env.settings
    (torch.Size([2, 4]), {'env_id': 'CartPole-v1', 'num_envs': 2, 'max_episode_steps': 500})
    >>> step = env.step(torch.tensor([0, 1]))
    >>> step.rewards.tolist(), step.dones.tolist()
    ([1.0, 1.0], [False, False])
    """

    def __init__(self, env_id: str, num_envs: int, *, seed: int, **kwargs: Any) -> None:
        gym = _gymnasium()
        if num_envs < 1:
            raise ConfigError(f"GymVectorEnv(num_envs={num_envs}): use an int >= 1")
        self.env_id, self.num_envs = env_id, num_envs
        self.envs = gym.vector.SyncVectorEnv(
            [lambda: gym.make(env_id, **kwargs) for _ in range(num_envs)],
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
        unwrapped = self.envs.envs[0].unwrapped
        if not type(unwrapped).__module__.startswith("gymnasium.envs.classic_control."):
            self.envs.close()
            raise ConfigError(
                f"GymVectorEnv saves and restores gymnasium's classic-control envs only; "
                f"{env_id} is {type(unwrapped).__module__}.{type(unwrapped).__name__}: use a "
                "classic-control id (CartPole-v1, Acrobot-v1, MountainCar-v0, Pendulum-v1, ...)"
            )
        obs, _ = self.envs.reset(seed=seed)
        self.observations = torch.from_numpy(np.array(obs))
        self._returns = np.zeros(num_envs, dtype=np.float64)
        self._lengths = np.zeros(num_envs, dtype=np.int64)

    @property
    def settings(self) -> dict[str, Any]:
        """What a resume must match: the env id, how many, and their TimeLimit."""
        return {
            "env_id": self.env_id,
            "num_envs": self.num_envs,
            "max_episode_steps": self.envs.envs[0].spec.max_episode_steps,
        }

    def step(self, actions: Tensor) -> EnvStep:
        """Step every env with its action; an episode that ends is reset at once (SB3's way)."""
        obs, rewards, terminated, truncated, infos = self.envs.step(actions.cpu().numpy())
        self._returns += rewards
        self._lengths += 1
        observations = torch.from_numpy(np.array(obs))
        final = observations
        done = np.logical_or(terminated, truncated)
        returns: list[float] = []
        lengths: list[int] = []
        if done.any():
            final = observations.clone()
            for i in np.flatnonzero(done):
                final[i] = torch.from_numpy(np.asarray(infos["final_obs"][i]))
                returns.append(float(self._returns[i]))
                lengths.append(int(self._lengths[i]))
            self._returns[done] = 0.0
            self._lengths[done] = 0
        self.observations = observations
        return EnvStep(
            observations=observations,
            rewards=torch.from_numpy(rewards.astype(np.float32)),
            terminated=torch.from_numpy(terminated.copy()),
            truncated=torch.from_numpy(truncated.copy()),
            final_observations=final,
            episode_returns=returns,
            episode_lengths=lengths,
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything that decides the envs' future, as values weights_only=True loads."""
        return {
            "settings": self.settings,
            "observations": self.observations.clone(),
            "episode_returns": torch.from_numpy(self._returns.copy()),
            "episode_lengths": torch.from_numpy(self._lengths.copy()),
            "envs": [_env_state(env) for env in self.envs.envs],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put the envs back where `state_dict()` found them; other settings are a ConfigError."""
        saved = dict(state["settings"])
        differ = [
            f"{key} {saved.get(key)!r} -> {value!r}"
            for key, value in self.settings.items()
            if saved.get(key) != value
        ]
        if differ:
            raise ConfigError(
                "the checkpoint's environments differ from these: "
                + ", ".join(differ)
                + "; resume with the saved settings, or start a new run"
            )
        self.observations = state["observations"].clone()
        self._returns = state["episode_returns"].numpy().copy()
        self._lengths = state["episode_lengths"].numpy().copy()
        for env, env_state in zip(self.envs.envs, state["envs"], strict=True):
            _load_env_state(env, env_state)

    def close(self) -> None:
        """Close the envs (a renderer's window, if one was opened)."""
        self.envs.close()


def _gymnasium() -> Any:
    try:
        import gymnasium
    except ImportError as exc:
        raise ConfigError(
            "lab.rl.gym needs gymnasium: pip install 'lab[rl]' (or pip install gymnasium)"
        ) from exc
    return gymnasium


def _env_state(env: Any) -> dict[str, Any]:
    """One env's state: its dynamic attributes, its bit generator, its wrappers' counters."""
    unwrapped = env.unwrapped
    return {
        "attrs": {k: _encode(getattr(unwrapped, k)) for k in _DYNAMIC if hasattr(unwrapped, k)},
        "np_random": unwrapped.np_random.bit_generator.state,
        "np_random_seed": unwrapped._np_random_seed,
        "wrappers": _wrapper_counters(env),
    }


def _load_env_state(env: Any, state: Mapping[str, Any]) -> None:
    unwrapped = env.unwrapped
    for key, value in state["attrs"].items():
        setattr(unwrapped, key, _decode(value))
    unwrapped.np_random.bit_generator.state = state["np_random"]
    unwrapped._np_random_seed = state["np_random_seed"]
    counters = state["wrappers"]
    for wrapper in _wrappers(env):
        for attr in _COUNTERS.get(type(wrapper).__name__, ()):
            setattr(wrapper, attr, counters[f"{type(wrapper).__name__}.{attr}"])


# The wrapper attributes that change as an env runs: TimeLimit's step count, OrderEnforcing's
# "reset was called" flag.
_COUNTERS = {"TimeLimit": ("_elapsed_steps",), "OrderEnforcing": ("_has_reset",)}


def _wrappers(env: Any) -> list[Any]:
    gym = _gymnasium()
    out = []
    while isinstance(env, gym.Wrapper):
        out.append(env)
        env = env.env
    return out


def _wrapper_counters(env: Any) -> dict[str, Any]:
    return {
        f"{type(w).__name__}.{attr}": getattr(w, attr)
        for w in _wrappers(env)
        for attr in _COUNTERS.get(type(w).__name__, ())
    }


def _encode(value: Any) -> tuple[str, Any]:
    """A value of an env's state as (kind, plain value): arrays and numpy scalars as tensors
    (their dtype kept), tuples and lists item by item, Python numbers as they are."""
    if isinstance(value, np.ndarray):
        return ("ndarray", torch.from_numpy(value.copy()))
    if isinstance(value, np.generic):
        return ("scalar", torch.from_numpy(np.asarray(value).copy()))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, [_encode(v) for v in value])
    if value is None or isinstance(value, (bool, int, float)):
        return ("py", value)
    raise ConfigError(  # a classic-control env that grew a new kind of state
        f"GymVectorEnv cannot save an env attribute of type {type(value).__name__}"
    )


def _decode(encoded: tuple[str, Any]) -> Any:
    kind, value = encoded
    if kind == "ndarray":
        return value.numpy().copy()
    if kind == "scalar":
        return value.numpy()[()]
    if kind == "tuple":
        return tuple(_decode(v) for v in value)
    if kind == "list":
        return [_decode(v) for v in value]
    return value
