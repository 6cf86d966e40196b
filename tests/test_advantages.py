"""grpo.group_advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from grpo import group_advantages, zero_signal_groups

nan = float("nan")


def close(actual: torch.Tensor, expected, atol: float = 1e-3) -> None:
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


def test_seeds_example_population_std():
    # mean 1.125, deviations .375 -.625 -.125 .375, population variance .6875/4 = .171875
    close(group_advantages(torch.tensor([1.5, 0.5, 1.0, 1.5]), 4), [0.905, -1.508, -0.302, 0.905])


def test_unbiased_std_divides_by_g_minus_1():
    # sample variance .6875/3, std .478714
    close(group_advantages(torch.tensor([1.5, 0.5, 1.0, 1.5]), 4, std="unbiased"), [0.7833, -1.3056, -0.2611, 0.7833])


def test_groups_are_independent_and_scale_options():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])  # two groups of 2
    # group means .5 and 2, each group's population std .5 and 1
    close(group_advantages(rewards, 2), [1.0, -1.0, 1.0, -1.0])
    close(group_advantages(rewards, 2, scale="none"), [0.5, -0.5, 1.0, -1.0])
    # batch: centred per group, divided by the std of all four rewards (mean 1.25, var 1.1875)
    s = math.sqrt(1.1875)
    close(group_advantages(rewards, 2, scale="batch"), [0.5 / s, -0.5 / s, 1.0 / s, -1.0 / s])
    s_unbiased = math.sqrt(1.1875 * 4 / 3)
    close(group_advantages(rewards, 2, scale="batch", std="unbiased"), [0.5 / s_unbiased, -0.5 / s_unbiased, 1 / s_unbiased, -1 / s_unbiased])


def test_eps_is_added_to_the_std():
    close(group_advantages(torch.tensor([1.0, 0.0]), 2, eps=0.5), [0.5, -0.5])


def test_equal_rewards_give_zero_and_count_as_zero_signal():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, 3)
    assert torch.equal(adv[:3], torch.zeros(3)) and torch.equal(adv[6:], torch.zeros(3))
    assert adv[3:6].abs().sum() > 0
    assert zero_signal_groups(rewards, 3).tolist() == [True, False, True]


def test_nan_rewards_get_zero_advantage_and_leave_the_statistics():
    # valid rewards 1, 0, 1: mean 2/3, population std sqrt(2/9)
    adv = group_advantages(torch.tensor([1.0, nan, 0.0, 1.0]), 4)
    close(adv, [0.7071, 0.0, -1.4142, 0.7071])
    assert not torch.isnan(adv).any()
    # the same as the group without the unscorable completion
    close(adv[[0, 2, 3]], group_advantages(torch.tensor([1.0, 0.0, 1.0]), 3).tolist(), atol=1e-6)
    # a group with one valid reward carries no signal; one with none gives zeros, not NaN
    rewards = torch.tensor([nan, 1.0, nan, nan])
    assert torch.equal(group_advantages(rewards, 2), torch.zeros(4))
    assert zero_signal_groups(rewards, 2).tolist() == [True, True]


def test_nan_rewards_are_left_out_of_the_batch_std():
    rewards = torch.tensor([1.0, 0.0, nan, 3.0, 1.0, nan])  # two groups of 3
    valid = torch.tensor([1.0, 0.0, 3.0, 1.0])
    s = valid.std(unbiased=False).item()
    close(group_advantages(rewards, 3, scale="batch"), [0.5 / s, -0.5 / s, 0.0, 1.0 / s, -1.0 / s, 0.0])


def test_accepts_lists_and_float64():
    close(group_advantages([1.5, 0.5, 1.0, 1.5], 4), [0.905, -1.508, -0.302, 0.905])
    close(group_advantages(torch.tensor([1.5, 0.5, 1.0, 1.5], dtype=torch.float64), 4), [0.905, -1.508, -0.302, 0.905])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(group_size=3), "shape"),
        (dict(group_size=0), "group_size"),
        (dict(group_size=2, std="sample"), "std"),
        (dict(group_size=2, scale="global"), "scale"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(torch.ones(4), **kwargs)


def reference(rewards: torch.Tensor, G: int, unbiased: bool, scale: str, eps: float = 1e-6) -> torch.Tensor:
    """The formula in float64, straight: no NaN rewards, no overflow guard."""
    r = rewards.double().view(-1, G)
    centered = r - r.mean(-1, keepdim=True)
    if scale == "group":
        centered = centered / (r.std(-1, keepdim=True, unbiased=unbiased) + eps)
    elif scale == "batch":
        centered = centered / (r.std(unbiased=unbiased) + eps)
    return centered.view(-1)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("std", ["population", "unbiased"])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e6])
def test_matches_a_float64_reference_on_random_rewards(scale, std, magnitude):
    g = torch.Generator().manual_seed(7)
    rewards = torch.randn(5 * 7, generator=g, dtype=torch.float64) * magnitude
    rewards[7:14] = rewards[7]  # one group with no signal
    actual = group_advantages(rewards, 7, std=std, scale=scale)
    expected = reference(rewards, 7, std == "unbiased", scale)
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual.double(), expected, rtol=1e-6, atol=1e-6 * (magnitude if scale == "none" else 1.0))


def test_equal_rewards_with_eps_zero_give_zero_not_nan():
    close(group_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2, eps=0.0), [0.0, 0.0, -1.0, 1.0], atol=1e-6)
    close(group_advantages(torch.tensor([1.0, 1.0, 2.0, 2.0]), 2, eps=0.0, scale="batch"), [0.0] * 4, atol=0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_huge_rewards_never_make_advantages_nan(scale):
    rewards = torch.tensor([1e39, 0.0, 1.0, 2.0, 1.5e308, 1.5e308, -1.7e308, 0.0], dtype=torch.float64)
    adv = group_advantages(rewards, 4, scale=scale)
    assert not torch.isnan(adv).any()
    if scale != "none":  # |r - mean| itself overflows float32 only without a std to divide by
        assert torch.isfinite(adv).all()
        assert adv[4] > 0 and adv[6] < 0
    if scale == "group":  # (with the batch's std, set by 1e308, the first group's advantages round to 0)
        assert adv[0] > 0 and adv[1] < 0
    with pytest.raises(ValueError, match=r"rewards\[1\] is inf"):
        group_advantages(torch.tensor([0.0, math.inf]), 2, scale=scale)
