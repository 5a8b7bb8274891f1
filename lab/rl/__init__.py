"""On-policy reinforcement learning on the run's lifecycle: episodes, experience, learn epochs.

`OnPolicyLoop` runs episodes that make an `Experience` with the policy (a vector of
environments, or a batch of prompts) and learn from it for some epochs of minibatches; each
learn batch is one optimizer step, so an RL run reads like any other in the store. `Rollouts`
keeps a sample of each episode as prediction rows. The PPO helpers (`gae`, `ppo_loss`,
`explained_variance`) come from `lab.rl.ppo`, imported when first used; GRPO's
(`grpo_advantages`, `approx_kl`) from `lab.rl.grpo`. docs/rl.md shows the lifecycle and a
runnable example.
"""

from __future__ import annotations

from typing import Any

from lab.rl.experience import Episodes, Experience
from lab.rl.grpo import approx_kl, grpo_advantages
from lab.rl.loop import EpisodeInfo, OnPolicyLoop
from lab.rl.rollouts import Rollouts

__all__ = [
    "EpisodeInfo",
    "Episodes",
    "Experience",
    "OnPolicyLoop",
    "Rollouts",
    "approx_kl",
    "explained_variance",
    "gae",
    "grpo_advantages",
    "ppo_loss",
]

_PPO = ("gae", "ppo_loss", "explained_variance")


def __getattr__(name: str) -> Any:
    """The PPO helpers, from `lab.rl.ppo` on first use."""
    if name in _PPO:
        from lab.rl import ppo

        return getattr(ppo, name)
    raise AttributeError(f"module 'lab.rl' has no attribute {name!r}")
