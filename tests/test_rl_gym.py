"""lab.rl.gym.GymVectorEnv: real gymnasium envs, saved mid-episode through a safe checkpoint
load and restored into fresh envs, continue bit-identically."""

from __future__ import annotations

import doctest
import io

import pytest
import torch

import lab.rl.gym
from lab.errors import ConfigError
from lab.loop.payload import check_safe
from lab.rl.gym import EnvStep, GymVectorEnv


def _actions(env_id: str, n: int, gen: torch.Generator) -> torch.Tensor:
    if env_id == "Pendulum-v1":  # a torque in [-2, 2]
        return torch.rand(n, 1, generator=gen, dtype=torch.float64).float() * 4 - 2
    if env_id == "MountainCarContinuous-v0":
        return torch.rand(n, 1, generator=gen).float() * 2 - 1
    return torch.randint(
        0, 3 if env_id.startswith(("Acrobot", "MountainCar")) else 2, (n,), generator=gen
    )


def _trace(env: GymVectorEnv, actions: list[torch.Tensor]) -> list[EnvStep]:
    return [env.step(a) for a in actions]


def _same(a: list[EnvStep], b: list[EnvStep]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for name in ("observations", "rewards", "terminated", "truncated", "final_observations"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
        assert (x.episode_returns, x.episode_lengths) == (y.episode_returns, y.episode_lengths)


def _safe_round_trip(state: dict) -> dict:
    check_safe(0, state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    "env_id",
    ["CartPole-v1", "Acrobot-v1", "MountainCar-v0", "MountainCarContinuous-v0", "Pendulum-v1"],
)
def test_a_restored_env_continues_bit_identically(env_id: str) -> None:
    gen = torch.Generator().manual_seed(0)
    actions = [_actions(env_id, 3, gen) for _ in range(60)]
    # short episodes (TimeLimit 7), so that the save falls mid-episode, with episodes ending
    # (some terminated, some truncated) before and after it
    straight = GymVectorEnv(env_id, 3, seed=1, max_episode_steps=7)
    whole = _trace(straight, actions)

    first = GymVectorEnv(env_id, 3, seed=1, max_episode_steps=7)
    _same(_trace(first, actions[:25]), whole[:25])
    state = _safe_round_trip(first.state_dict())
    for _ in range(5):  # the original goes on; the saved state must not move with it
        first.step(actions[0])
    resumed = GymVectorEnv(env_id, 3, seed=99, max_episode_steps=7)  # other seeds: all restored
    resumed.load_state_dict(state)
    assert torch.equal(resumed.observations, whole[24].observations)
    _same(_trace(resumed, actions[25:]), whole[25:])
    assert sum(len(s.episode_returns) for s in whole[25:]) >= 3
    assert any(s.timeouts.any() for s in whole[25:])


def test_cartpole_episodes_ended_with_their_returns_and_final_observations() -> None:
    env = GymVectorEnv("CartPole-v1", 2, seed=0, max_episode_steps=3)
    steps = _trace(env, [torch.tensor([1, 1])] * 3)
    assert [s.dones.tolist() for s in steps] == [[False, False], [False, False], [True, True]]
    last = steps[-1]
    assert last.timeouts.tolist() == [True, True]  # cut by the TimeLimit, not fallen
    assert (last.episode_returns, last.episode_lengths) == ([3.0, 3.0], [3, 3])
    # the observation it ended on is kept; the env itself already starts a new episode
    assert not torch.equal(last.final_observations, last.observations)
    assert torch.equal(last.observations, env.observations)
    assert last.rewards.dtype == torch.float32 and last.observations.dtype == torch.float32


def test_a_resume_into_other_env_settings_is_one_config_error() -> None:
    state = GymVectorEnv("CartPole-v1", 4, seed=0).state_dict()
    with pytest.raises(ConfigError) as info:
        GymVectorEnv("CartPole-v1", 2, seed=0, max_episode_steps=100).load_state_dict(state)
    assert str(info.value) == (
        "the checkpoint's environments differ from these: num_envs 4 -> 2, max_episode_steps "
        "500 -> 100; resume with the saved settings, or start a new run"
    )


def test_only_classic_control_envs_are_taken() -> None:
    with pytest.raises(ConfigError) as info:
        GymVectorEnv("FrozenLake-v1", 1, seed=0)
    assert str(info.value) == (
        "GymVectorEnv saves and restores gymnasium's classic-control envs only; FrozenLake-v1 "
        "is gymnasium.envs.toy_text.frozen_lake.FrozenLakeEnv: use a classic-control id "
        "(CartPole-v1, Acrobot-v1, MountainCar-v0, Pendulum-v1, ...)"
    )
    with pytest.raises(ConfigError, match="use an int >= 1"):
        GymVectorEnv("CartPole-v1", 0, seed=0)


def test_docstring_examples_run() -> None:
    result = doctest.testmod(lab.rl.gym)
    assert result.attempted > 0
    assert result.failed == 0
