"""GRPO advantages, PPO-clip loss and the k3 KL estimator against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from gyre.algos import (
    ADVANTAGES,
    get_advantage_fn,
    grpo_advantages,
    kl_k3,
    masked_token_sum,
    ppo_clip_loss,
)

E = math.e


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


# -- GRPO advantages --------------------------------------------------------------------------
def test_grpo_single_group_hand_values():
    # mean .25, deviations (.75, -.25, -.25, -.25), unbiased var .75/3 = .25, std .5
    adv = grpo_advantages(_t([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 0]))
    torch.testing.assert_close(adv, _t([1.5, -0.5, -0.5, -0.5]), atol=1e-5, rtol=0)


def test_grpo_two_successes():
    # mean .5, deviations +-.5, unbiased var 1/3
    adv = grpo_advantages(_t([1.0, 1.0, 0.0, 0.0]), torch.tensor([3, 3, 3, 3]))
    s = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv, _t([s, s, -s, -s]), atol=1e-5, rtol=0)


def test_grpo_equal_rewards_give_zero():
    for value in (0.0, 1.0, 0.3):
        adv = grpo_advantages(_t([value] * 4), torch.tensor([0, 0, 0, 0]))
        assert torch.all(adv == 0.0)


def test_grpo_interleaved_groups():
    # group 7 = positions 0, 2, 4 with rewards (1, 0, 0); group 2 = positions 1, 3, 5 (0, 1, 1)
    rewards = _t([1.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    groups = torch.tensor([7, 2, 7, 2, 7, 2])
    adv = grpo_advantages(rewards, groups)
    # group (1,0,0): mean 1/3, devs (2/3, -1/3, -1/3), var (4/9 + 2/9)/2 = 1/3
    std = math.sqrt(1 / 3)
    hi, lo = (2 / 3) / std, (-1 / 3) / std
    torch.testing.assert_close(adv, _t([hi, -hi, lo, -lo, lo, -lo]), atol=1e-5, rtol=0)
    for g in (7, 2):
        assert abs(adv[groups == g].sum().item()) < 1e-5


def test_grpo_group_sums_zero_random():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(24, generator=g)
    groups = torch.arange(24) % 5
    adv = grpo_advantages(rewards, groups)
    for k in range(5):
        sel = adv[groups == k]
        assert abs(sel.sum().item()) < 1e-4
        assert abs(sel.std().item() - 1.0) < 1e-3  # unbiased std normalised to 1


def test_grpo_eps_and_singleton_group():
    adv = grpo_advantages(_t([1.0, 0.0]), torch.tensor([0, 0]), eps=1.0)
    # mean .5, unbiased std sqrt(.5); A = +-.5 / (sqrt(.5) + 1)
    a = 0.5 / (math.sqrt(0.5) + 1.0)
    torch.testing.assert_close(adv, _t([a, -a]), atol=1e-6, rtol=0)
    assert grpo_advantages(_t([5.0]), torch.tensor([0])).item() == 0.0


def test_advantage_registry():
    assert get_advantage_fn("grpo") is grpo_advantages
    assert "grpo" in ADVANTAGES
    with pytest.raises(ValueError, match="nope"):
        get_advantage_fn("nope")


# -- PPO clip ---------------------------------------------------------------------------------
def test_ppo_ratio_e_positive_advantage_is_clipped():
    old = _t([[-2.0]])
    loss, clipped = ppo_clip_loss(old + 1.0, old, _t([[1.0]]), 0.2)
    # -min(e * 1, 1.2 * 1) = -1.2
    torch.testing.assert_close(loss, _t([[-1.2]]))
    assert clipped.item() is True


def test_ppo_ratio_e_negative_advantage_unclipped():
    old = _t([[-2.0]])
    loss, clipped = ppo_clip_loss(old + 1.0, old, _t([[-1.0]]), 0.2)
    # -min(e * -1, 1.2 * -1) = -(-e) = e
    torch.testing.assert_close(loss, _t([[E]]))
    assert clipped.item() is False


def test_ppo_small_ratio():
    old = _t([[-1.0, -1.0]])
    new = old + math.log(0.5)  # ratio .5
    loss, clipped = ppo_clip_loss(new, old, _t([[1.0, -1.0]]), 0.2)
    # A=+1: -min(.5, .8) = -.5 (unclipped); A=-1: -min(-.5, -.8) = .8 (clipped)
    torch.testing.assert_close(loss, _t([[-0.5, 0.8]]))
    assert clipped.tolist() == [[False, True]]


def test_ppo_ratio_one_gives_minus_advantage():
    lp = _t([[-0.3, -1.1, -2.0], [-0.1, -0.2, -0.3]])
    adv = _t([[2.0], [-0.5]])  # (B, 1) broadcasts over tokens
    loss, clipped = ppo_clip_loss(lp, lp.clone(), adv, 0.2)
    torch.testing.assert_close(loss, -adv.expand(2, 3))
    assert not clipped.any()


def test_ppo_gradient_zero_when_clipped():
    old = _t([0.0, 0.0])
    new = torch.tensor([0.5, 0.05], requires_grad=True)  # ratios e^.5 ~1.65 (clipped), ~1.05
    loss, clipped = ppo_clip_loss(new, old, _t([1.0, 1.0]), 0.2)
    loss.sum().backward()
    assert clipped.tolist() == [True, False]
    assert new.grad[0].item() == 0.0
    torch.testing.assert_close(new.grad[1], -torch.exp(torch.tensor(0.05)))


# -- KL ---------------------------------------------------------------------------------------
def test_k3_zero_when_equal():
    lp = _t([[-0.1, -2.0, -5.0]])
    assert torch.all(kl_k3(lp, lp) == 0.0)


def test_k3_hand_values():
    d = math.log(2.0)
    kl = kl_k3(_t([d, -d]), _t([0.0, 0.0]))
    # exp(-d) + d - 1: .5 + ln2 - 1 and 2 - ln2 - 1
    torch.testing.assert_close(kl, _t([0.5 + d - 1.0, 1.0 - d]))


def test_k3_positive_and_clamped():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(100, generator=g), torch.randn(100, generator=g)
    kl = kl_k3(a, b)
    assert torch.all(kl[a != b] > 0)
    assert kl_k3(_t([-30.0]), _t([0.0])).item() == 10.0


def test_masked_token_sum():
    v = _t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = _t([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert masked_token_sum(v, m).item() == 9.0
