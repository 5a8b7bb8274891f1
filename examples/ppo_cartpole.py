"""PPO on gymnasium's CartPole-v1, as stable-baselines3 runs it, recorded by `lab`.

rl-baselines3-zoo's hyperparameters for PPO on CartPole-v1 (`hyperparams/ppo.yml`): 8 envs,
32 steps each per rollout, minibatches of 256, 20 epochs, gamma 0.98, GAE lambda 0.8, no
entropy bonus, the learning rate 1e-3 and the clip range 0.2 both falling linearly to 0, 1e5
environment steps; with SB3's defaults for the rest: `MlpPolicy` (separate 64-64 tanh actor
and critic, orthogonal init), Adam with eps 1e-5, value loss weight 0.5, gradients clipped
to norm 0.5, advantages normalised per minibatch, timeouts bootstrapped with V of the last
observation.

Each rollout of 8 x 32 steps is one episode of a `lab.rl.OnPolicyLoop`: `make_experience`
steps the envs (a `lab.rl.gym.GymVectorEnv`, SB3's `DummyVecEnv` stepping) and computes GAE,
`learn` is one minibatch of SB3's `PPO.train` (`lab.rl.ppo.ppo_loss`), each an optimizer step.
The loop records per step the PPO losses, approx KL, clip fraction and explained variance,
and per episode the returns and lengths of the CartPole episodes that ended, a sample of the
rollouts as prediction rows, and a checkpoint every `--save-every` episodes with the envs'
exact state, so a resume continues as if the run never stopped. Arms: the zoo's settings,
and GAE lambda 0.95 (SB3's default); 2 repeats each.

    python examples/ppo_cartpole.py                   # into ./lab.db and ./runs
    python examples/ppo_cartpole.py --stop-at 300     # SIGKILLed at step 300 of the last run...
    python examples/ppo_cartpole.py                   # ...which this resumes; the rest are reused
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

import pydantic
import torch
import torch.nn as nn
from torch.distributions import Categorical

from lab import Arm, Callback, CheckpointConfig
from lab.rl import Episodes, Experience, OnPolicyLoop, Rollouts
from lab.rl.gym import GymVectorEnv
from lab.rl.ppo import explained_variance, gae, ppo_loss

from _lab import parse_args, run_experiment


class Config(pydantic.BaseModel):
    env_id: str = "CartPole-v1"
    n_envs: int = 8
    n_steps: int = 32
    batch_size: int = 256
    n_epochs: int = 20
    gamma: float = 0.98
    gae_lambda: float = 0.8
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    learning_rate: float = 1e-3  # linear to 0 ("lin_1e-3")
    clip_range: float = 0.2  # linear to 0 ("lin_0.2")
    max_grad_norm: float = 0.5
    n_timesteps: int = 100_000
    save_every: int = 50  # episodes (rollouts)
    rollouts: int = 8  # rows of each rollout kept as prediction rows


class ActorCritic(nn.Module):
    """SB3's `MlpPolicy` for a discrete action space: separate 64-64 tanh networks for the
    policy and the value, orthogonal init (gain sqrt(2) hidden, 0.01 policy head, 1 value
    head), zero biases."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64):
        super().__init__()

        def mlp() -> nn.Sequential:
            return nn.Sequential(
                nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh()
            )

        self.policy_net, self.value_net = mlp(), mlp()
        self.action_head, self.value_head = nn.Linear(hidden, n_actions), nn.Linear(hidden, 1)
        for module, gain in [
            (self.policy_net, math.sqrt(2)),
            (self.value_net, math.sqrt(2)),
            (self.action_head, 0.01),
            (self.value_head, 1.0),
        ]:
            for layer in module.modules():
                if isinstance(layer, nn.Linear):
                    nn.init.orthogonal_(layer.weight, gain=gain)
                    nn.init.zeros_(layer.bias)

    def forward(self, obs: torch.Tensor) -> tuple[Categorical, torch.Tensor]:
        """The action distribution and the value of each observation."""
        logits = self.action_head(self.policy_net(obs))
        return Categorical(logits=logits), self.value(obs)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.value_head(self.value_net(obs)).squeeze(-1)


def ppo_loop(run, callbacks: Sequence[Callback] = ()) -> OnPolicyLoop:
    """The run's envs, policy and OnPolicyLoop (bench/rl_cartpole.py builds it too)."""
    args = run.config
    env = GymVectorEnv(args.env_id, args.n_envs, seed=run.seed)
    obs_dim = env.observations.shape[1]
    policy = ActorCritic(obs_dim, env.envs.single_action_space.n)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.learning_rate, eps=1e-5)
    rows = args.n_envs * args.n_steps
    num_episodes = math.ceil(args.n_timesteps / rows)  # SB3 stops at the first >= n_timesteps

    def make_experience(info) -> Experience:
        """One rollout: n_steps of every env, then GAE (SB3's collect_rollouts)."""
        # the learning rate falls linearly to 0, set before each episode's learning as SB3
        # sets it at the start of each train() (from progress_remaining)
        for group in optimizer.param_groups:
            group["lr"] = args.learning_rate * info.progress_remaining
        observations, actions, log_probs, values, rewards, dones = [], [], [], [], [], []
        ended = Episodes()
        for _ in range(args.n_steps):
            obs = env.observations
            dist, value = policy(obs)
            action = torch.multinomial(dist.probs, 1, generator=info.generator).squeeze(1)
            step = env.step(action)
            reward = step.rewards
            if step.timeouts.any():  # cut by the TimeLimit: bootstrap with V(last obs)
                cut = step.timeouts
                reward = reward.clone()
                reward[cut] += args.gamma * policy.value(step.final_observations[cut])
            observations.append(obs)
            actions.append(action)
            log_probs.append(dist.log_prob(action))
            values.append(value)
            rewards.append(reward)
            dones.append(step.dones)
            ended.returns += step.episode_returns
            ended.lengths += step.episode_lengths
        values_t = torch.stack(values)
        advantages, returns = gae(
            torch.stack(rewards),
            values_t,
            torch.stack(dones),
            policy.value(env.observations),
            gamma=args.gamma,
            lam=args.gae_lambda,
        )
        return Experience(
            action_log_probs=torch.stack(log_probs).flatten(),
            rewards=torch.stack(rewards).flatten(),
            observations=torch.stack(observations).flatten(0, 1),
            actions=torch.stack(actions).flatten(),
            values=values_t.flatten(),
            returns=returns.flatten(),
            advantages=advantages.flatten(),
            episodes=ended,
        )

    def learn(batch: Experience, info) -> dict:
        """One minibatch of SB3's PPO.train."""
        dist, values = policy(batch.observations)
        out = ppo_loss(
            dist.log_prob(batch.actions),
            batch.action_log_probs,
            batch.advantages,
            clip_range=args.clip_range * info.progress_remaining,
            values=values,
            returns=batch.returns,
            entropy=dist.entropy(),
            vf_coef=args.vf_coef,
            ent_coef=args.ent_coef,
        )
        out["explained_variance"] = explained_variance(batch.values, batch.returns)
        return out

    return OnPolicyLoop(
        policy,
        optimizer,
        num_episodes=num_episodes,
        make_experience=make_experience,
        learn=learn,
        learn_epochs=args.n_epochs,
        batch_size=args.batch_size,
        max_grad_norm=args.max_grad_norm,
        checkpoint=CheckpointConfig(every=args.save_every, keep_last=1),
        rollouts=Rollouts(size=args.rollouts) if args.rollouts else None,
        settings={**env.settings, "n_steps": args.n_steps},
        stateful={"env": env},
        callbacks=callbacks,
    )


def train_run(run):
    """One arm x repeat: PPO for n_timesteps environment steps."""
    loop = ppo_loop(run)
    try:
        return loop.fit(run)  # resumes from the run's newest checkpoint, if it has one
    finally:
        loop.stateful["env"].close()


def main():
    defaults = Config()
    parser = argparse.ArgumentParser(description="PPO on CartPole-v1, recorded by lab")

    def flag(name: str, kind: type, help: str) -> None:
        field = name.removeprefix("--").replace("-", "_")
        parser.add_argument(
            name,
            type=kind,
            default=getattr(defaults, field),
            metavar="N",
            help=f"{help} (default: %(default)s)",
        )

    flag("--n-timesteps", int, "environment steps per run")
    flag("--n-envs", int, "environments stepped side by side")
    flag("--n-steps", int, "steps of each env per rollout (an episode of the loop)")
    flag("--batch-size", int, "rows per minibatch (an optimizer step)")
    flag("--n-epochs", int, "epochs over each rollout")
    flag("--save-every", int, "episodes (rollouts) between checkpoints")
    flag("--rollouts", int, "rows of each rollout kept as prediction rows, 0 for none")
    parser.add_argument(
        "--seed",
        type=int,
        default=1,
        metavar="S",
        help="random seed of the first repeat (default: %(default)s)",
    )
    args = parse_args(parser)
    config = Config(
        n_timesteps=args.n_timesteps,
        n_envs=args.n_envs,
        n_steps=args.n_steps,
        batch_size=args.batch_size,
        n_epochs=args.n_epochs,
        save_every=args.save_every,
        rollouts=args.rollouts,
    )
    arms = [Arm("zoo"), Arm("lambda-0.95", gae_lambda=0.95)]
    result = run_experiment(
        "ppo_cartpole", train_run, args, base_config=config, arms=arms, seed=args.seed,
        metric="episode/return_mean", mode="max",  # every door ranks the arms by it
    )  # fmt: skip
    keys = ["episode/return_mean", "episode/length_mean", "loss", "approx_kl"]
    print(result.summary(keys=keys))


if __name__ == "__main__":
    main()
