"""PPO's arithmetic, as stable-baselines3 computes it: GAE, the clipped loss, explained variance.

Three pure functions on tensors, so that an on-policy `learn` reads like SB3's `PPO.train` and
gives the same numbers:

- `gae`: `RolloutBuffer.compute_returns_and_advantage` (GAE(lambda) advantages and the
  TD(lambda) returns = advantages + values). Timeouts are bootstrapped as SB3 does it, before
  this: a step that was truncated (not terminated) gets `gamma * V(final observation)` added to
  its reward by whoever made the experience (see `examples/ppo_cartpole.py`).
- `ppo_loss`: one minibatch of `PPO.train`: advantages normalised per minibatch, the clipped
  surrogate, the value loss as an MSE, the entropy bonus, and SB3's `approx_kl` and
  `clip_fraction` for the logs.
- `explained_variance`: SB3's `explained_variance(y_pred, y_true)`.

    >>> import torch
    >>> from lab.rl.ppo import gae
    >>> adv, ret = gae(torch.tensor([[1.0], [1.0]]), torch.zeros(2, 1),
    ...                torch.tensor([[False], [True]]), torch.zeros(1), gamma=0.5, lam=1.0)
    >>> adv[:, 0].tolist(), ret[:, 0].tolist()
    ([1.5, 1.0], [1.5, 1.0])
"""

from __future__ import annotations

import torch
from torch import Tensor


def gae(
    rewards: Tensor,
    values: Tensor,
    dones: Tensor,
    last_values: Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """GAE(lambda) advantages and TD(lambda) returns of a rollout, as SB3's RolloutBuffer.

    `rewards`, `values` and `dones` are [T, N] (T steps of N environments); `dones[t, n]` says
    that env n's episode ended at step t (terminated or truncated), so step t+1 starts a new
    one and nothing flows back across it; `last_values` [N] is V of the observation after the
    last step. Returns `(advantages, returns)`, both [T, N], with returns = advantages +
    values. Why a function of its own: the recursion is where PPO implementations differ
    (the done at t or at t+1, the bootstrap of the last step), and SB3's is the reference.
    """
    if rewards.ndim != 2 or values.shape != rewards.shape or dones.shape != rewards.shape:
        from lab.errors import ConfigError

        raise ConfigError(
            f"gae takes [T, N] rewards, values and dones of one shape; got rewards "
            f"{tuple(rewards.shape)}, values {tuple(values.shape)}, dones {tuple(dones.shape)}"
        )
    not_done = 1.0 - dones.to(values.dtype)
    advantages = torch.empty_like(values)
    last_gae = torch.zeros(values.shape[1], dtype=values.dtype, device=values.device)
    next_values = last_values.to(values.dtype).reshape(values.shape[1])
    for t in range(values.shape[0] - 1, -1, -1):
        delta = rewards[t] + gamma * next_values * not_done[t] - values[t]
        last_gae = delta + gamma * lam * not_done[t] * last_gae
        advantages[t] = last_gae
        next_values = values[t]
    return advantages, advantages + values


def ppo_loss(
    new_log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
    values: Tensor | None = None,
    returns: Tensor | None = None,
    entropy: Tensor | None = None,
    vf_coef: float = 0.5,
    ent_coef: float = 0.0,
    normalize_advantages: bool = True,
) -> dict[str, Tensor]:
    """One minibatch of SB3's `PPO.train`: the loss to backpropagate and its parts for the logs.

    `new_log_probs` are the current policy's log-probs of the actions taken (with grad),
    `old_log_probs` those of the policy that acted; `values` the critic's current predictions
    and `returns` their targets (both or neither); `entropy` the policy's entropy per row, or
    None for SB3's estimate -mean(new_log_probs). Advantages are normalised within the
    minibatch (mean 0, std 1 + 1e-8, unless it has one row). Returns "loss" (with grad),
    "loss/policy", "loss/value" (only with values), "entropy" (the mean entropy, the negative
    of SB3's entropy_loss), "approx_kl" (mean((r - 1) - log r)) and "clip_fraction" (share of
    rows with |r - 1| > clip_range), detached. Why: these are the numbers SB3 logs, so a run
    here reads against an SB3 run metric by metric.
    """
    if normalize_advantages and advantages.numel() > 1:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    log_ratio = new_log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    surrogate = advantages * ratio
    clipped = advantages * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    policy_loss = -torch.min(surrogate, clipped).mean()
    entropy_loss = -(entropy.mean() if entropy is not None else (-new_log_probs).mean())
    loss = policy_loss + ent_coef * entropy_loss
    out: dict[str, Tensor] = {}
    if (values is None) != (returns is None):
        from lab.errors import ConfigError

        raise ConfigError("ppo_loss takes values and returns together (the value loss needs both)")
    if values is not None and returns is not None:
        value_loss = torch.nn.functional.mse_loss(returns, values)
        loss = loss + vf_coef * value_loss
        out["loss/value"] = value_loss.detach()
    with torch.no_grad():
        out["loss/policy"] = policy_loss.detach()
        out["entropy"] = -entropy_loss.detach()
        out["approx_kl"] = ((ratio - 1) - log_ratio).mean()
        out["clip_fraction"] = ((ratio - 1).abs() > clip_range).float().mean()
    return {"loss": loss, **out}


def explained_variance(values: Tensor, returns: Tensor) -> float:
    """1 - Var[returns - values] / Var[returns]: how much of the returns the critic explains.

    As SB3's `explained_variance(y_pred, y_true)`: 1 is perfect, 0 no better than a constant,
    negative worse; NaN when the returns do not vary. Population variances (ddof 0).
    """
    values, returns = values.flatten(), returns.flatten()
    var_returns = returns.var(unbiased=False)
    if var_returns == 0:
        return float("nan")
    return float(1 - (returns - values).var(unbiased=False) / var_returns)
