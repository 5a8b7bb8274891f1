"""On-policy reinforcement learning on the run's lifecycle: episodes, experience, learn epochs.

`OnPolicyLoop` runs episodes that make an `Experience` with the policy (a vector of
environments, or a batch of prompts) and learn from it for some epochs of minibatches; each
learn batch is one optimizer step, so an RL run reads like any other in the store. `Rollouts`
keeps a sample of each episode as prediction rows. The PPO helpers (`gae`, `ppo_loss`,
`explained_variance`) come from `lab.rl.ppo`, GRPO's (`grpo_advantages`, `approx_kl`) from
`lab.rl.grpo`; each name's module is imported when the name is first used. The RL hooks
(`lab.rl.hooks.RLHook`) register with the core's lifecycle when `lab` is imported.
docs/rl.md shows the lifecycle and a runnable example.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lab._lazy import lazy_names

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

#: Where each public name lives; ``lab.rl.<name>`` imports its module on first access, so
#: that ``import lab`` (which imports `lab.rl.hooks`, and so this package) imports no torch.
_WHERE: dict[str, str] = {
    "EpisodeInfo": "lab.rl.loop",
    "Episodes": "lab.rl.experience",
    "Experience": "lab.rl.experience",
    "OnPolicyLoop": "lab.rl.loop",
    "Rollouts": "lab.rl.rollouts",
    "approx_kl": "lab.rl.grpo",
    "explained_variance": "lab.rl.ppo",
    "gae": "lab.rl.ppo",
    "grpo_advantages": "lab.rl.grpo",
    "ppo_loss": "lab.rl.ppo",
}

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from lab.rl.experience import Episodes, Experience
    from lab.rl.grpo import approx_kl, grpo_advantages
    from lab.rl.loop import EpisodeInfo, OnPolicyLoop
    from lab.rl.ppo import explained_variance, gae, ppo_loss
    from lab.rl.rollouts import Rollouts


__getattr__, __dir__ = lazy_names("lab.rl", _WHERE, globals(), __all__)
