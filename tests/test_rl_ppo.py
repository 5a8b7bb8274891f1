"""lab.rl.ppo computes what stable-baselines3's PPO computes, checked on values worked by hand."""

from __future__ import annotations

import doctest
import math

import pytest
import torch

import lab.rl.ppo
from lab.errors import ConfigError
from lab.rl import explained_variance, gae, ppo_loss


def test_gae_matches_the_recursion_worked_by_hand() -> None:
    # gamma = lam = 0.5, so gamma * lam = 0.25; three envs side by side (columns):
    # env 0 runs through; env 1 ends its episode at t=1; env 2 ends it at the last step.
    rewards = torch.tensor([[1.0, 1.0, 0.0], [2.0, 1.0, 0.0], [4.0, 1.0, 3.0]])
    values = torch.tensor([[1.0, 2.0, 0.0], [1.0, 0.0, 0.0], [2.0, 0.0, 1.0]])
    dones = torch.tensor([[False, False, False], [False, True, False], [False, False, True]])
    last_values = torch.tensor([4.0, 8.0, 100.0])
    advantages, returns = gae(rewards, values, dones, last_values, gamma=0.5, lam=0.5)
    # env 0: d2 = 4 + .5*4 - 2 = 4; d1 = 2 + .5*2 - 1 = 2, A1 = 2 + .25*4 = 3;
    #        d0 = 1 + .5*1 - 1 = .5, A0 = .5 + .25*3 = 1.25
    # env 1: d2 = 1 + .5*8 - 0 = 5; t=1 is done: A1 = 1 (no bootstrap, no carry);
    #        d0 = 1 + .5*0 - 2 = -1, A0 = -1 + .25*1 = -.75
    # env 2: the last step is done, so last_values (100) is not used: A2 = 3 - 1 = 2;
    #        d1 = 0 + .5*1 - 0 = .5, A1 = .5 + .25*2 = 1; A0 = 0 + .25*1 = .25
    assert advantages.T.tolist() == [[1.25, 3.0, 4.0], [-0.75, 1.0, 5.0], [0.25, 1.0, 2.0]]
    assert returns.T.tolist() == [[2.25, 4.0, 6.0], [1.25, 1.0, 5.0], [0.25, 1.0, 3.0]]
    assert advantages.dtype == torch.float32


def test_gae_lambda_one_is_the_discounted_monte_carlo_return() -> None:
    rewards = torch.ones(4, 1)
    values = torch.tensor([[9.0], [9.0], [9.0], [9.0]])
    _, returns = gae(rewards, values, torch.zeros(4, 1), torch.tensor([16.0]), gamma=0.5, lam=1.0)
    # backwards, values cancel out: 1 + .5*16 = 9, 1 + .5*9 = 5.5, 1 + .5*5.5 = 3.75, 2.875
    assert returns[:, 0].tolist() == [2.875, 3.75, 5.5, 9.0]


def test_gae_refuses_mismatched_shapes_in_one_line() -> None:
    with pytest.raises(ConfigError) as info:
        gae(torch.zeros(3, 2), torch.zeros(3), torch.zeros(3, 2), torch.zeros(2), gamma=1, lam=1)
    assert str(info.value) == (
        "gae takes [T, N] rewards, values and dones of one shape; got rewards (3, 2), "
        "values (3,), dones (3, 2)"
    )


def _ratios() -> tuple[torch.Tensor, torch.Tensor]:
    """Old log-probs 0 and new ones whose ratios are 1.5, 1 and 0.5."""
    return torch.log(torch.tensor([1.5, 1.0, 0.5])), torch.zeros(3)


def test_ppo_loss_matches_sb3_terms_worked_by_hand() -> None:
    new, old = _ratios()
    new.requires_grad_(True)
    out = ppo_loss(
        new,
        old,
        torch.tensor([0.0, 2.0, 4.0]),  # mean 2, std 2: normalised to -1, 0, 1
        clip_range=0.2,
        values=torch.tensor([1.0, 2.0, 3.0]),
        returns=torch.tensor([1.0, 0.0, 6.0]),
    )
    assert sorted(out) == [
        "approx_kl",
        "clip_fraction",
        "entropy",
        "loss",
        "loss/policy",
        "loss/value",
    ]
    # surrogate: [-1*1.5, 0, 1*.5] = [-1.5, 0, .5]; clipped ratios [1.2, 1, .8] give
    # [-1.2, 0, .8]; the min is [-1.5, 0, .5], so the policy loss is -(-1/3) = 1/3
    assert out["loss/policy"].item() == pytest.approx(1 / 3, rel=1e-6)
    assert out["loss/value"].item() == pytest.approx(13 / 3, rel=1e-6)  # (0 + 4 + 9) / 3
    assert out["loss"].item() == pytest.approx(1 / 3 + 0.5 * 13 / 3, rel=1e-6)
    # SB3's approx_kl: mean((r - 1) - log r)
    kl = ((0.5 - math.log(1.5)) + 0.0 + (-0.5 - math.log(0.5))) / 3
    assert out["approx_kl"].item() == pytest.approx(kl, rel=1e-6)
    assert out["clip_fraction"].item() == pytest.approx(2 / 3, rel=1e-6)  # 1.5 and 0.5
    # no entropy given: SB3's estimate, -mean(log-prob)
    assert out["entropy"].item() == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 3, rel=1e-6)
    assert out["loss"].requires_grad
    assert not any(v.requires_grad for k, v in out.items() if k != "loss")
    out["loss"].backward()
    # d/dnew of -(1/3) sum min(...): only unclipped rows move: row 0 (A=-1) and
    # row 2 (A=1): grad = -(1/3) * A * r
    assert new.grad.tolist() == pytest.approx([1.5 / 3, 0.0, -0.5 / 3], rel=1e-6)


def test_ppo_loss_with_entropy_and_without_a_critic_or_normalisation() -> None:
    new, old = _ratios()
    out = ppo_loss(
        new,
        old,
        torch.tensor([1.0, 1.0, -1.0]),
        clip_range=0.1,
        entropy=torch.tensor([1.0, 2.0, 3.0]),
        ent_coef=0.1,
        normalize_advantages=False,
    )
    assert "loss/value" not in out
    # min(A r, A clip(r)): [min(1.5, 1.1), min(1, 1), min(-.5, -.9)] = [1.1, 1, -.9]
    assert out["loss/policy"].item() == pytest.approx(-1.2 / 3, rel=1e-6)
    assert out["entropy"].item() == 2.0
    assert out["loss"].item() == pytest.approx(-1.2 / 3 - 0.1 * 2.0, rel=1e-6)


def test_ppo_loss_leaves_a_single_row_unnormalised() -> None:
    out = ppo_loss(torch.zeros(1), torch.zeros(1), torch.tensor([3.0]), clip_range=0.2)
    assert out["loss/policy"].item() == -3.0  # SB3: normalising one row makes no sense


def test_ppo_loss_takes_values_and_returns_together() -> None:
    with pytest.raises(ConfigError, match="values and returns together"):
        ppo_loss(
            torch.zeros(2), torch.zeros(2), torch.ones(2), clip_range=0.2, values=torch.ones(1)
        )


def test_explained_variance_worked_by_hand() -> None:
    # returns mean 3, variance (4 + 0 + 0 + 4) / 4 = 2; residuals [0, 1, 0, 1], variance .25
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    returns = torch.tensor([[1.0, 3.0], [3.0, 5.0]])
    assert explained_variance(values, returns) == 0.875
    assert math.isnan(explained_variance(torch.zeros(3), torch.ones(3)))  # returns don't vary


def test_docstring_examples_run() -> None:
    result = doctest.testmod(lab.rl.ppo)
    assert result.attempted > 0
    assert result.failed == 0
