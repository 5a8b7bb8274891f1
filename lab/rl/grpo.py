"""GRPO's two pieces of arithmetic: group-relative advantages and the per-token KL to a frozen
reference.

GRPO (DeepSeekMath; ColossalChat's GRPO consumer) drops PPO's critic: each prompt is answered
`group_size` times, and an answer's advantage is its reward measured against the other answers
to the same prompt. A KL penalty to a frozen copy of the starting policy keeps the policy from
drifting into text the reward scores well for the wrong reasons. Both are plain tensor
functions; they fit any learn function on :class:`lab.rl.OnPolicyLoop`.

>>> import torch
>>> grpo_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), group_size=2)
tensor([ 0.7070, -0.7070,  0.0000,  0.0000])
"""

from __future__ import annotations

import torch
from torch import Tensor

from lab.errors import ConfigError

__all__ = ["approx_kl", "grpo_advantages"]


def grpo_advantages(rewards: Tensor, group_size: int, *, eps: float = 1e-4) -> Tensor:
    """Each row's reward less its group's mean, over its group's standard deviation + `eps`:
    the advantage GRPO uses in place of a critic's estimate.

    `rewards` is [B] (one scalar per answer), its groups contiguous: rows
    ``g * group_size ... (g + 1) * group_size - 1`` answer the same prompt. The standard
    deviation is the unbiased one (``Tensor.std``), as in DeepSeekMath's GRPO, TRL and
    ColossalChat; `eps` (their 1e-4) keeps a group whose answers all scored alike at advantage
    0 instead of dividing by zero. A NaN or inf reward is data: it makes its own group's
    advantages NaN, no other group's. Returns a [B] tensor in `rewards`' dtype.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ConfigError(
            f"group_size={group_size!r}: give an int >= 2 (the answers sampled per prompt); "
            "a group of one has no spread to measure an answer against"
        )
    if rewards.dim() != 1:
        raise ConfigError(
            f"rewards of shape {tuple(rewards.shape)}: give one reward per answer, a [B] tensor"
        )
    if rewards.numel() % group_size:
        raise ConfigError(
            f"{rewards.numel()} rewards do not split into groups of {group_size}: give "
            "group_size answers for every prompt"
        )
    groups = rewards.view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True)
    return ((groups - mean) / (std + eps)).view(-1)


def approx_kl(
    log_probs: Tensor, ref_log_probs: Tensor, action_mask: Tensor | None = None
) -> Tensor:
    """Per token, Schulman's k3 estimate of KL(policy || reference) from the log-probs both
    give the token the policy sampled: ``exp(ref - lp) - (ref - lp) - 1``, as GRPO and
    ColossalChat's ``compute_approx_kl`` compute it.

    Unbiased, never negative, and 0 exactly where the two agree, so it serves as a penalty
    added to the per-token loss. `log_probs` and `ref_log_probs` are [B, A] (or any one
    shape); with `action_mask` (same shape, 1 where a generated token counts) the other
    positions are 0, so padding after an end token never adds to the penalty. Returns a tensor
    of that shape; gradients flow through `log_probs`.
    """
    if log_probs.shape != ref_log_probs.shape:
        raise ConfigError(
            f"log_probs {tuple(log_probs.shape)} and ref_log_probs "
            f"{tuple(ref_log_probs.shape)} differ in shape: give both for the same tokens"
        )
    log_ratio = ref_log_probs - log_probs
    kl = torch.exp(log_ratio) - log_ratio - 1
    if action_mask is None:
        return kl
    if action_mask.shape != kl.shape:
        raise ConfigError(
            f"action_mask {tuple(action_mask.shape)} and log_probs {tuple(kl.shape)} differ "
            "in shape: give one mask value per token"
        )
    return torch.where(action_mask.bool(), kl, torch.zeros((), dtype=kl.dtype))
