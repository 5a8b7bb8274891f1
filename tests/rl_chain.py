"""A tiny deterministic environment for the RL loop's tests: a vector of chain walks.

Pure torch, no gymnasium. Each of `num_envs` walkers stands on a chain of `length` cells and
steps left or right; reaching the right end pays 1 and starts a new walk at cell 0, and a
walk that lasts `horizon` steps ends with nothing. The start cell of a new walk and the
"slip" (an action turned into its opposite, with probability `slip`) come from the
environment's own `torch.Generator`, whose state is in `state_dict()`, so a resumed run
continues the same walks. Run as a script, it trains one run (the SIGKILL test's child).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from lab.rl import EpisodeInfo, Episodes, Experience, OnPolicyLoop


class ChainWalk:
    """`num_envs` chain walks stepped together; observations are one-hot cells."""

    def __init__(
        self,
        num_envs: int = 4,
        length: int = 5,
        horizon: int = 12,
        seed: int = 0,
        slip: float = 0.1,
        nan_reward_at: int | None = None,
    ) -> None:
        self.num_envs, self.length, self.horizon, self.slip = num_envs, length, horizon, slip
        self.generator = torch.Generator().manual_seed(seed)
        self.pos = torch.zeros(num_envs, dtype=torch.long)
        self.t = torch.zeros(num_envs, dtype=torch.long)
        self.ret = torch.zeros(num_envs, dtype=torch.float64)
        self.steps = 0
        self.nan_reward_at = nan_reward_at

    def observe(self) -> torch.Tensor:
        return torch.nn.functional.one_hot(self.pos, self.length).float()

    def step(
        self, action: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[float], list[int]]:
        """Move; returns (reward, done, returns and lengths of the walks that ended)."""
        slipped = torch.rand(self.num_envs, generator=self.generator) < self.slip
        move = torch.where(action == 1, 1, -1) * torch.where(slipped, -1, 1)
        self.pos = (self.pos + move).clamp(0, self.length - 1)
        self.t += 1
        self.steps += 1
        reward = (self.pos == self.length - 1).float()
        if self.nan_reward_at is not None and self.steps == self.nan_reward_at:
            reward[0] = float("nan")
        self.ret += reward.double()
        done = (self.pos == self.length - 1) | (self.t >= self.horizon)
        ended_returns = [float(r) for r in self.ret[done].tolist()]
        ended_lengths = [int(n) for n in self.t[done].tolist()]
        starts = torch.randint(0, 2, (self.num_envs,), generator=self.generator)
        self.pos = torch.where(done, starts, self.pos)
        self.t = torch.where(done, 0, self.t)
        self.ret = torch.where(done, 0.0, self.ret)
        return reward, done, ended_returns, ended_lengths

    def state_dict(self) -> dict[str, Any]:
        return {
            "generator": self.generator.get_state(),
            "pos": self.pos.clone(),
            "t": self.t.clone(),
            "ret": self.ret.clone(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.pos, self.t, self.ret = state["pos"].clone(), state["t"].clone(), state["ret"].clone()
        self.steps = int(state["steps"])


def make_loop(
    env: ChainWalk, *, n_steps: int = 6, gamma: float = 0.9, **kwargs: Any
) -> OnPolicyLoop:
    """A clipped policy-gradient learner on `env` (a small PPO without a value function)."""
    torch.manual_seed(0)
    policy = torch.nn.Linear(env.length, 2)
    optimizer = torch.optim.Adam(policy.parameters(), lr=0.05)

    def make_experience(info: EpisodeInfo) -> Experience:
        obs, actions, log_probs, rewards, dones = [], [], [], [], []
        ended_returns: list[float] = []
        ended_lengths: list[int] = []
        for _ in range(n_steps):
            o = env.observe()
            dist = torch.distributions.Categorical(logits=policy(o))
            a = dist.sample()  # the global RNG: saved and restored by the run handle
            r, d, rets, lens = env.step(a)
            obs.append(o), actions.append(a), log_probs.append(dist.log_prob(a))
            rewards.append(r), dones.append(d)
            ended_returns += rets
            ended_lengths += lens
        rew = torch.stack(rewards)
        ret = torch.zeros_like(rew)
        running = torch.zeros(env.num_envs)
        for t in reversed(range(n_steps)):
            running = torch.nan_to_num(rew[t]) + gamma * running * (~dones[t]).float()
            ret[t] = running
        adv = (ret - ret.mean()) / (ret.std() + 1e-8)
        ids = [f"env{i}" for i in range(env.num_envs)] * n_steps
        return Experience(
            action_log_probs=torch.stack(log_probs).flatten(),
            rewards=rew.flatten(),
            observations=torch.stack(obs).flatten(0, 1),
            actions=torch.stack(actions).flatten(),
            returns=ret.flatten(),
            advantages=adv.flatten(),
            example_ids=ids,
            episodes=Episodes(ended_returns, ended_lengths),
        )

    def learn(batch: Experience, info: EpisodeInfo) -> dict[str, Any]:
        dist = torch.distributions.Categorical(logits=policy(batch.observations))
        new = dist.log_prob(batch.actions)
        ratio = torch.exp(new - batch.action_log_probs)
        adv = batch.advantages
        clipped = torch.clamp(ratio, 0.8, 1.2)
        policy_loss = -torch.min(ratio * adv, clipped * adv).mean()
        entropy = dist.entropy().mean()
        with torch.no_grad():
            approx_kl = ((ratio - 1) - (new - batch.action_log_probs)).mean()
            clip_fraction = ((ratio - 1).abs() > 0.2).float().mean()
        return {
            "loss": policy_loss - 0.01 * entropy,
            "loss/policy": policy_loss.detach(),
            "entropy": entropy.detach(),
            "approx_kl": approx_kl,
            "clip_fraction": clip_fraction,
        }

    kwargs.setdefault("settings", {"env": "chain", "num_envs": env.num_envs, "n_steps": n_steps})
    return OnPolicyLoop(
        policy,
        optimizer,
        make_experience=make_experience,
        learn=learn,
        stateful={"env": env},
        **kwargs,
    )


if __name__ == "__main__":  # the child of the SIGKILL test: train one run of an experiment
    import lab
    from lab import CheckpointConfig

    folder, episodes = Path(sys.argv[1]), int(sys.argv[2])
    kill_at = int(os.environ.get("RL_CHAIN_KILL_AT", "0"))

    class KillAt(lab.Callback):
        """SIGKILLs this process right after learn batch `kill_at` (mid-episode)."""

        def on_learn_batch_end(self, state: Any, step_idx: int, batch: Any, metrics: Any) -> None:
            if step_idx == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    def train(run: lab.RunSpec) -> Any:
        env = ChainWalk(seed=run.seed)
        loop = make_loop(
            env,
            num_episodes=episodes,
            learn_epochs=2,
            batch_size=8,
            checkpoint=CheckpointConfig(every=1),
            callbacks=[KillAt()],
        )
        return loop.fit(run)

    lab.Experiment(
        "kill", train, output_dir=folder, store=f"sqlite:///{folder / 'lab.db'}", seed=3
    ).run()
