"""GRPO's arithmetic on small tensors worked by hand: group-relative advantages and the k3
estimate of the KL to a reference."""

from __future__ import annotations

import doctest
import math

import pytest
import torch

from lab.errors import ConfigError
from lab.rl.grpo import approx_kl, grpo_advantages


def test_advantages_are_rewards_standardized_within_each_group() -> None:
    rewards = torch.tensor([0.0, 1.0, 2.0, 1.0, 0.0, 0.0])  # groups [0 1 2] and [1 0 0]
    got = grpo_advantages(rewards, group_size=3, eps=0.0)
    # group 1: mean 1, unbiased std 1; group 2: mean 1/3, unbiased std 1/sqrt(3)
    third = 1 / math.sqrt(3)
    want = torch.tensor([-1.0, 0.0, 1.0, (2 / 3) / third, (-1 / 3) / third, (-1 / 3) / third])
    torch.testing.assert_close(got, want)


def test_advantages_of_one_right_answer_in_four_are_exact() -> None:
    # mean 0.25; squared deviations 0.5625 + 3 * 0.0625 = 0.75, / 3 = 0.25: std 0.5
    got = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, eps=0.0)
    assert got.tolist() == [1.5, -0.5, -0.5, -0.5]


def test_eps_divides_and_keeps_a_group_that_scored_alike_at_zero() -> None:
    got = grpo_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), group_size=2)
    half = 0.5 / (math.sqrt(0.5) + 1e-4)  # the default eps, 1e-4, as TRL and ColossalChat
    torch.testing.assert_close(got, torch.tensor([half, -half, 0.0, 0.0]))
    assert got.dtype == torch.float32


def test_a_nan_reward_makes_only_its_own_group_nan() -> None:
    got = grpo_advantages(torch.tensor([float("nan"), 1.0, 0.0, 1.0]), group_size=2, eps=0.0)
    assert torch.isnan(got[:2]).all()
    torch.testing.assert_close(got[2:], torch.tensor([-math.sqrt(0.5), math.sqrt(0.5)]))


@pytest.mark.parametrize(
    ("rewards", "group_size", "message"),
    [
        (
            torch.zeros(4),
            1,
            "group_size=1: give an int >= 2 (the answers sampled per prompt); "
            "a group of one has no spread to measure an answer against",
        ),
        (torch.zeros(4), True, "group_size=True: give an int >= 2"),
        (
            torch.zeros(5),
            2,
            "5 rewards do not split into groups of 2: give group_size answers for every prompt",
        ),
        (torch.zeros(2, 2), 2, "rewards of shape (2, 2): give one reward per answer, a [B] tensor"),
    ],
)
def test_bad_groups_are_one_clear_error(rewards, group_size, message) -> None:
    with pytest.raises(ConfigError) as info:
        grpo_advantages(rewards, group_size)
    assert str(info.value).startswith(message)


def test_k3_per_token_values_worked_by_hand() -> None:
    log_probs = torch.log(torch.tensor([[0.5, 0.25, 0.5]]))
    ref_log_probs = torch.log(torch.tensor([[0.25, 0.5, 0.5]]))
    got = approx_kl(log_probs, ref_log_probs)
    # r = ref / policy: 0.5 -> 0.5 - ln 0.5 - 1 = ln 2 - 0.5; 2 -> 2 - ln 2 - 1; 1 -> 0
    want = torch.tensor([[math.log(2) - 0.5, 1 - math.log(2), 0.0]])
    torch.testing.assert_close(got, want)


def test_k3_averaged_over_the_policy_is_the_exact_kl() -> None:
    p = torch.tensor([0.5, 0.25, 0.25])
    q = torch.tensor([0.25, 0.25, 0.5])
    expected = (p * approx_kl(p.log(), q.log())).sum()
    # KL(p || q) = 0.5 ln 2 + 0.25 ln 1 + 0.25 ln 0.5 = 0.25 ln 2: the estimator is unbiased
    torch.testing.assert_close(expected, torch.tensor(0.25 * math.log(2)))


def test_the_action_mask_zeroes_padding_and_its_gradient() -> None:
    log_probs = torch.log(torch.tensor([[0.5, 0.5, 0.1]])).requires_grad_(True)
    ref_log_probs = torch.log(torch.tensor([[0.25, 0.5, 0.9]]))
    mask = torch.tensor([[1, 1, 0]])
    got = approx_kl(log_probs, ref_log_probs, mask)
    torch.testing.assert_close(got, torch.tensor([[math.log(2) - 0.5, 0.0, 0.0]]))
    got.sum().backward()
    # d/dlp (exp(ref - lp) - (ref - lp) - 1) = 1 - exp(ref - lp): 1 - 0.5 and 1 - 1
    torch.testing.assert_close(log_probs.grad, torch.tensor([[0.5, 0.0, 0.0]]))


def test_k3_shape_mismatches_are_one_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"log_probs \(2, 3\) and ref_log_probs \(2, 4\)"):
        approx_kl(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ConfigError, match=r"action_mask \(2,\) and log_probs \(2, 3\)"):
        approx_kl(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2))


def test_the_module_docstring_example_runs() -> None:
    import lab.rl.grpo

    result = doctest.testmod(lab.rl.grpo)
    assert (result.attempted, result.failed) == (2, 0)
