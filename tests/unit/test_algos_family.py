"""The algorithm family against hand-computed values: every estimator, policy loss, aggregation
mode, KL estimator and rollout-IS mode; vectorised forms against plain loops on random input."""

from __future__ import annotations

import math

import pytest
import torch

from gyre.algos import (
    ADVANTAGES,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    AdvantageInputs,
    LossParams,
    StepCounts,
    agg_weights,
    aggregate,
    cispo_loss,
    compute_advantages,
    dr_grpo_advantages,
    gae_advantages,
    get_kl_fn,
    get_policy_loss_fn,
    grpo_advantages,
    gspo_loss,
    kl_k1,
    kl_k2,
    ppo_clip_loss,
    reinforce_loss,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    rollout_is_weights,
)
from gyre.algos.advantages import discounted_returns, last_token_rewards, masked_whiten


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


# -- outcome estimators ----------------------------------------------------------------------
def test_rloo_one_success_of_four():
    # A_0 = 1 - mean(0, 0, 0) = 1; A_j = 0 - mean(1, 0, 0) = -1/3
    adv = rloo_advantages(_t([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 0]))
    torch.testing.assert_close(adv, _t([1.0, -1 / 3, -1 / 3, -1 / 3]))


def test_rloo_is_scaled_mean_baseline_and_singleton_is_zero():
    adv = rloo_advantages(_t([3.0, 1.0, 2.0, 5.0, 7.0]), torch.tensor([0, 0, 0, 1, 2]))
    # group 0: mean 2, G/(G-1) = 1.5 -> 1.5 * (1, -1, 0); groups 1, 2 are singletons
    torch.testing.assert_close(adv, _t([1.5, -1.5, 0.0, 0.0, 0.0]))


def test_dr_grpo_mean_only():
    adv = dr_grpo_advantages(_t([1.0, 0.0, 0.0, 0.0, 2.0, 4.0]), torch.tensor([0, 0, 0, 0, 1, 1]))
    torch.testing.assert_close(adv, _t([0.75, -0.25, -0.25, -0.25, -1.0, 1.0]))


@pytest.mark.parametrize("fn", [grpo_advantages, dr_grpo_advantages, rloo_advantages])
def test_outcome_estimators_sum_to_zero_per_group(fn):
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(30, generator=g)
    groups = torch.randint(0, 6, (30,), generator=g)
    adv = fn(rewards, groups)
    for k in groups.unique():
        assert abs(adv[groups == k].sum().item()) < 1e-4


def _loop_outcome(name, rewards, groups, eps=1e-6):
    out = []
    for i in range(len(rewards)):
        mates = [float(rewards[j]) for j in range(len(rewards)) if groups[j] == groups[i]]
        r = float(rewards[i])
        mean = sum(mates) / len(mates)
        if name == "dr_grpo":
            out.append(r - mean)
        elif name == "rloo":
            others = len(mates) - 1
            out.append(r - (sum(mates) - r) / others if others else 0.0)
        else:
            var = sum((x - mean) ** 2 for x in mates) / max(len(mates) - 1, 1)
            out.append((r - mean) / (math.sqrt(var) + eps))
    return _t(out)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_outcome_vectorised_matches_loop(name):
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(40, generator=g)
    groups = torch.randint(0, 9, (40,), generator=g) * 3 + 100  # sparse, unsorted ids
    adv, _ = compute_advantages(name, rewards, groups)
    torch.testing.assert_close(adv, _loop_outcome(name, rewards, groups), atol=1e-5, rtol=1e-5)


def test_registry_lists_valid_names():
    assert set(ADVANTAGES) == {
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "gae",
        "gigpo",
        "turn_returns",
    }
    with pytest.raises(ValueError, match="valid: dr_grpo, gae, gigpo, grpo, reinforce_pp"):
        compute_advantages("ppo", _t([1.0]), torch.tensor([0]))
    assert set(POLICY_LOSSES) == {"ppo_clip", "gspo", "cispo", "reinforce"}
    with pytest.raises(ValueError, match="valid: cispo, gspo, ppo_clip, reinforce"):
        get_policy_loss_fn("sppo")
    with pytest.raises(ValueError, match=r"valid: abs, abs\+, k1, k1\+, k2, k3, k3\+, low_var_kl"):
        get_kl_fn("k4")
    with pytest.raises(ValueError, match="needs values"):
        compute_advantages("gae", _t([1.0]), torch.tensor([0]), AdvantageInputs(_t([[0.0, 1.0]])))


# -- token estimators ------------------------------------------------------------------------
def test_last_token_rewards_and_multi_turn_returns():
    mask = _t([[0, 1, 1, 0, 1, 0], [0, 1, 0, 0, 0, 0]])
    r = last_token_rewards(_t([2.0, -1.0]), mask)
    assert r.tolist() == [[0, 0, 0, 0, 2, 0], [0, -1, 0, 0, 0, 0]]
    # gamma .5 over policy tokens only: the observation token at t=3 is not a step
    ret = discounted_returns(r, mask, 0.5)
    assert ret.tolist() == [[0, 0.5, 1.0, 0, 2.0, 0], [0, -1.0, 0, 0, 0, 0]]


def test_reinforce_pp_hand_values():
    mask = _t([[0, 1, 1, 1], [0, 1, 0, 0]])
    kl_pen = _t([[0, -0.1, -0.1, -0.1], [0, 0, 0, 0]])  # -beta * KL_t
    adv = reinforce_pp_advantages(
        _t([1.0, 0.0]), torch.tensor([0, 1]), loss_mask=mask, token_rewards=kl_pen, gamma=0.5
    )
    # row 0 token rewards (-.1, -.1, .9): returns t3 .9, t2 -.1 + .45 = .35, t1 -.1 + .175 = .075
    vals = [0.075, 0.35, 0.9, 0.0]
    mean = sum(vals) / 4
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / 4)
    want = _t([[0, *[(v - mean) / std for v in vals[:3]]], [0, (0.0 - mean) / std, 0, 0]])
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)


def test_reinforce_pp_baseline_hand_values():
    mask = _t([[0, 1], [0, 1], [0, 1], [0, 1]])
    adv = reinforce_pp_baseline_advantages(
        _t([1.0, 0.0, 3.0, 3.0]), torch.tensor([0, 0, 1, 1]), loss_mask=mask
    )
    # r - mean_G = (.5, -.5, 0, 0); population std over 4 tokens = sqrt(.5 / 4)
    s = math.sqrt(0.125)
    torch.testing.assert_close(adv[:, 1], _t([0.5 / s, -0.5 / s, 0.0, 0.0]), atol=1e-5, rtol=0)
    assert torch.all(adv[:, 0] == 0)


def test_gae_hand_values():
    mask = _t([[0, 1, 1]])
    values = _t([[0.0, 0.5, 0.25]])
    x = AdvantageInputs(loss_mask=mask, values=values)
    adv, ret = gae_advantages(
        _t([1.0]), torch.tensor([0]), inputs=x, gamma=0.9, lam=0.95, whiten=None
    )
    # delta_2 = 1 - .25 = .75; delta_1 = .9 * .25 - .5 = -.275; A_1 = -.275 + .9 * .95 * .75
    torch.testing.assert_close(adv, _t([[0.0, -0.275 + 0.64125, 0.75]]))
    torch.testing.assert_close(ret, _t([[0.0, 0.36625 + 0.5, 1.0]]))


def test_gae_lambda_one_gamma_one_is_reward_to_go_minus_value():
    mask = _t([[0, 1, 0, 1, 1]])  # t=2 is an observation token: skipped
    values = _t([[0, 0.3, 9.0, -0.2, 0.7]])
    x = AdvantageInputs(loss_mask=mask, values=values)
    adv, ret = gae_advantages(_t([2.0]), torch.tensor([0]), inputs=x, whiten=None)
    torch.testing.assert_close(ret, _t([[0, 2.0, 0, 2.0, 2.0]]))
    torch.testing.assert_close(adv, _t([[0, 1.7, 0, 2.2, 1.3]]))


def _loop_gae(rewards, mask, values, gamma, lam):
    adv = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        steps = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        nxt_v, nxt_a = 0.0, 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            r = float(rewards[i]) if k == len(steps) - 1 else 0.0
            delta = r + gamma * nxt_v - float(values[i, t])
            nxt_a = delta + gamma * lam * nxt_a
            nxt_v = float(values[i, t])
            adv[i, t] = nxt_a
    return adv


def _random_mask(g, B, T):
    mask = (torch.rand(B, T, generator=g) < 0.6).float()
    mask[:, 0] = 0
    mask[:, 1] = 1
    return mask


def test_gae_and_returns_vectorised_match_loop():
    g = torch.Generator().manual_seed(3)
    B, T = 7, 13
    mask = _random_mask(g, B, T)
    values = torch.randn(B, T, generator=g)
    rewards = torch.randn(B, generator=g)
    x = AdvantageInputs(loss_mask=mask, values=values)
    adv, _ = gae_advantages(rewards, torch.arange(B), inputs=x, gamma=0.93, lam=0.8, whiten=None)
    torch.testing.assert_close(adv, _loop_gae(rewards, mask, values, 0.93, 0.8), atol=1e-5, rtol=0)
    # GAE(lambda=1) == discounted return - V, the REINFORCE++ return
    x1 = AdvantageInputs(loss_mask=mask, values=values * mask)
    adv1, _ = gae_advantages(rewards, torch.arange(B), inputs=x1, gamma=0.93, whiten=None)
    ret = discounted_returns(last_token_rewards(rewards, mask), mask, 0.93)
    torch.testing.assert_close(adv1, (ret - values) * mask, atol=1e-5, rtol=0)


def test_masked_whiten():
    x = _t([[9.0, 1.0, 3.0], [9.0, 5.0, 9.0]])
    m = _t([[0, 1, 1], [0, 1, 0]])
    w = masked_whiten(x, m)
    sel = w[m > 0]
    assert abs(sel.mean().item()) < 1e-6 and abs(sel.std(unbiased=False).item() - 1) < 1e-5
    assert torch.all(w[m == 0] == 0)


# -- policy losses ---------------------------------------------------------------------------
def test_clip_higher():
    old = _t([[0.0]])
    new = old + 0.25  # ratio e^.25 ~ 1.284
    loss, clipped = ppo_clip_loss(new, old, _t([[1.0]]), 0.2, clip_eps_high=0.28)
    torch.testing.assert_close(loss, _t([[-1.28]]))
    assert clipped.item()
    loss, clipped = ppo_clip_loss(new, old, _t([[1.0]]), 0.2, clip_eps_high=0.3)
    torch.testing.assert_close(loss, -torch.exp(new))
    assert not clipped.item()
    # the lower side still uses eps_low: ratio e^-.5 ~ .607 with A < 0 clips at .8
    loss, _ = ppo_clip_loss(old - 0.5, old, _t([[-1.0]]), 0.2, clip_eps_high=0.28)
    torch.testing.assert_close(loss, _t([[0.8]]))


def test_dual_clip_on_negative_advantage():
    old = _t([0.0, 0.0, 0.0])
    new = torch.tensor([1.5, 1.5, 0.5], requires_grad=True)  # ratios 4.48, 4.48, 1.65
    adv = _t([-1.0, 1.0, -1.0])
    loss, clipped = ppo_clip_loss(new, old, adv, 0.2, dual_clip=3.0)
    # A=-1, ratio 4.48: PPO loss 4.48 -> capped at -c A = 3; A=+1: -min(4.48, 1.2) = -1.2;
    # A=-1, ratio 1.65: loss 1.65 < 3, dual clip inactive
    torch.testing.assert_close(loss, torch.stack([_t(3.0), _t(-1.2), torch.exp(_t(0.5))]))
    assert clipped.tolist() == [True, True, False]
    loss.sum().backward()
    assert new.grad[0].item() == 0.0 and new.grad[1].item() == 0.0
    torch.testing.assert_close(new.grad[2], torch.exp(_t(0.5)))
    plain, _ = ppo_clip_loss(new.detach(), old, adv, 0.2)
    assert plain[0].item() == pytest.approx(math.exp(1.5), rel=1e-5)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(new, old, adv, 0.2, dual_clip=1.0)


def test_gspo_equals_token_ppo_when_token_ratios_are_equal():
    old = _t([[0.0, -1.0, -2.0, -0.5], [0.0, -0.3, -0.7, -0.1]])
    delta = _t([[0.0], [0.15]])  # row 0 ratio 1 (not clipped), row 1 ratio e^.15 (clipped)
    mask = _t([[0, 1, 1, 1], [0, 1, 1, 0]])
    adv = _t([[-0.7], [1.3]])
    p = LossParams(0.1, 0.1)
    grads = []
    for fn in (gspo_loss, lambda *a: ppo_clip_loss(*a[:3], 0.1, 0.1)):
        new = (old + delta).clone().requires_grad_(True)
        loss, clipped = fn(new, old, adv, mask, p)
        aggregate(loss, mask, "seq-mean-token-mean").backward()
        grads.append((loss.detach() * mask, clipped & (mask > 0), new.grad))
    for a, b in zip(*grads, strict=True):
        if a.dtype == torch.bool:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b)


def test_gspo_sequence_ratio_hand_values():
    old = _t([[0.0, 0.0, 0.0]])
    new = torch.tensor([[0.0, 0.1, 0.3]], requires_grad=True)
    mask = _t([[0, 1, 1]])
    loss, clipped = gspo_loss(new, old, _t([[1.0]]), mask, LossParams(0.5, 0.5))
    s = math.exp(0.2)  # exp(mean of (.1, .3))
    torch.testing.assert_close(loss[0, 1:], _t([-s, -s]))
    (loss * mask).sum().backward()
    # d/dlogp_t of -s_i,t = -s (GSPO-token form); t=0 is off the mask
    torch.testing.assert_close(new.grad, _t([[0.0, -s, -s]]))
    loss, clipped = gspo_loss(new.detach(), old, _t([[1.0]]), mask, LossParams(3e-4, 4e-4))
    torch.testing.assert_close(loss[0, 1:], _t([-1.0004, -1.0004]))
    assert clipped[0, 1:].all()


def test_cispo_clips_the_weight_not_the_gradient():
    old = _t([0.0, 0.0])
    new = torch.tensor([0.5, 0.1], requires_grad=True)  # ratios 1.65 (clipped to 1.28), 1.105
    mask = _t([1, 1])
    loss, clipped = cispo_loss(new, old, _t([1.0, -2.0]), mask, LossParams(0.2, 0.28))
    r2 = math.exp(0.1)
    torch.testing.assert_close(loss, _t([-1.28, 2.0 * r2]))
    assert clipped.tolist() == [True, False]
    loss.sum().backward()
    # grad = -sg(w) A: the clipped token still learns (PPO would give it 0)
    torch.testing.assert_close(new.grad, _t([-1.28, 2.0 * r2]))


def test_reinforce_has_no_ratio():
    old = _t([[0.0, 0.0]])
    new = torch.tensor([[3.0, -3.0]], requires_grad=True)
    loss, clipped = reinforce_loss(new, old, _t([[2.0]]), _t([[1, 1]]), LossParams())
    torch.testing.assert_close(loss, _t([[-2.0, -2.0]]))
    assert not clipped.any()
    loss.sum().backward()
    torch.testing.assert_close(new.grad, _t([[-2.0, -2.0]]))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_loss_is_minus_advantage_on_policy(name):
    """At ratio 1 every loss's value is -A and its gradient -A d(log pi)."""
    g = torch.Generator().manual_seed(4)
    old = -torch.rand(3, 5, generator=g)
    new = old.clone().requires_grad_(True)
    adv = torch.randn(3, 5, generator=g)
    mask = _random_mask(g, 3, 5)
    loss, clipped = get_policy_loss_fn(name)(new, old, adv, mask, LossParams(0.2, 0.28, 3.0))
    torch.testing.assert_close(loss, -adv)
    assert not clipped.any()
    (loss * mask).sum().backward()
    torch.testing.assert_close(new.grad, -adv * mask)


# -- KL --------------------------------------------------------------------------------------
def test_k1_k2_hand_values():
    d = math.log(2.0)
    lp, ref = _t([d, -d, 0.0]), _t([0.0, 0.0, 0.0])
    torch.testing.assert_close(kl_k1(lp, ref), _t([d, -d, 0.0]))
    torch.testing.assert_close(kl_k2(lp, ref), _t([0.5 * d * d, 0.5 * d * d, 0.0]))
    assert get_kl_fn("k3")(lp, ref)[2].item() == 0.0


def test_kl_estimators_agree_in_expectation():
    # samples x ~ p = N(0, 1) scored against q = N(.1, 1): KL(p||q) = .005; k1 and k3 unbiased
    g = torch.Generator().manual_seed(5)
    x = torch.randn(200_000, generator=g)
    logp = -0.5 * x**2
    logq = -0.5 * (x - 0.1) ** 2
    for name in ("k1", "k3"):
        assert get_kl_fn(name)(logp, logq).mean().item() == pytest.approx(0.005, abs=1e-3)
    assert get_kl_fn("k2")(logp, logq).mean().item() == pytest.approx(0.005, abs=1e-3)


# -- aggregation -----------------------------------------------------------------------------
def test_aggregation_modes_on_unequal_lengths():
    mask = _t([[0, 1, 1, 1, 1], [0, 1, 1, 0, 0]])
    loss = _t([[9, 1, 1, 1, 1], [9, 3, 3, 9, 9]])  # row 0 loses 1 per token, row 1 loses 3
    got = {m: aggregate(loss, mask, m).item() for m in LOSS_AGGREGATIONS}
    assert got["token-mean"] == pytest.approx(10 / 6)  # (4 + 6) / 6 tokens
    assert got["seq-mean-token-mean"] == pytest.approx(2.0)  # (1 + 3) / 2
    assert got["seq-mean-token-sum"] == pytest.approx(5.0)  # (4 + 6) / 2
    assert got["seq-mean-token-sum-norm"] == pytest.approx(1.25)  # 10 / (2 rows * L=4)
    # Dr. GRPO's constant L (e.g. the generation budget)
    counts = StepCounts.of(mask, norm_len=10)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", counts).item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="valid: token-mean, seq-mean-token-mean"):
        aggregate(loss, mask, "sum")


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_aggregation_split_with_step_counts_adds_up(mode):
    """Micro-batches (or ranks) with the step's counts sum to the whole step's loss; with their
    own counts they would not (the gradient-accumulation bug)."""
    g = torch.Generator().manual_seed(6)
    mask = _random_mask(g, 9, 11)
    mask[0, 2:] = 0  # a short row
    loss = torch.randn(9, 11, generator=g)
    whole = aggregate(loss, mask, mode)
    counts = StepCounts.of(mask)
    parts = [slice(0, 2), slice(2, 7), slice(7, 9)]
    split = sum(aggregate(loss[s], mask[s], mode, counts) for s in parts)
    torch.testing.assert_close(split, whole)
    shard_counts = [StepCounts.of(mask[s]) for s in parts]
    total = shard_counts[0] + shard_counts[1] + shard_counts[2]
    assert total == counts  # what an all-reduce of the counts gives
    naive = sum(aggregate(loss[s], mask[s], mode) for s in parts) / len(parts)
    if mode != "seq-mean-token-mean":  # equal only by accident for this mode's row weights
        assert abs(naive.item() - whole.item()) > 1e-4


def test_agg_weights_sum():
    mask = _t([[0, 1, 1, 1, 1], [0, 1, 1, 0, 0]])
    assert agg_weights(mask, "token-mean").sum().item() == pytest.approx(1.0)
    assert agg_weights(mask, "seq-mean-token-mean").sum().item() == pytest.approx(1.0)
    assert agg_weights(mask, "seq-mean-token-sum").sum().item() == pytest.approx(3.0)


# -- rollout importance sampling -------------------------------------------------------------
def test_rollout_is_token_level():
    rollout = _t([[0.0, -1.0, -1.0, -1.0]])
    old = rollout + _t([[0.0, math.log(3.0), math.log(0.5), math.log(0.3)]])
    mask = _t([[0, 1, 1, 1]])
    w, hit = rollout_is_weights(old, rollout, mask, "truncate", "token", 2.0)
    torch.testing.assert_close(w, _t([[0, 2.0, 0.5, 0.3]]))
    assert hit.tolist() == [[False, True, False, False]]
    w, hit = rollout_is_weights(old, rollout, mask, "mask", "token", 2.0)  # keep [.5, 2]
    assert w.tolist() == [[0, 0, 1, 0]] and hit.tolist() == [[False, True, False, True]]
    w, _ = rollout_is_weights(old, rollout, mask, "mask", "token", 4.0, 0.25)
    assert w.tolist() == [[0, 1, 1, 1]]
    w, hit = rollout_is_weights(old, rollout, mask, "none")
    assert w.tolist() == mask.tolist() and not hit.any()


def test_rollout_is_sequence_level():
    rollout = _t([[0.0, -1.0, -1.0], [0.0, -2.0, 0.0]])
    old = rollout + _t([[0.0, math.log(3.0), math.log(0.5)], [0.0, math.log(1.1), 0.0]])
    mask = _t([[0, 1, 1], [0, 1, 0]])
    # row weights: 3 * .5 = 1.5 and 1.1
    w, _ = rollout_is_weights(old, rollout, mask, "truncate", "sequence", 1.2)
    torch.testing.assert_close(w, _t([[0, 1.2, 1.2], [0, 1.1, 0]]))
    w, hit = rollout_is_weights(old, rollout, mask, "mask", "sequence", 1.4)
    assert w.tolist() == [[0, 0, 0], [0, 1, 0]]
    assert hit.tolist() == [[False, True, True], [False, False, False]]
    with pytest.raises(ValueError, match="valid: token, sequence"):
        rollout_is_weights(old, rollout, mask, "truncate", "geometric")


# -- vectorised vs plain loops on random inputs ------------------------------------------------
def _loop_token_loss(name, new, old, adv, mask, p):
    """Scalar formulas token by token (sequence ratio for gspo computed per row)."""
    B, T = new.shape
    out = torch.zeros(B, T)
    for i in range(B):
        n = sum(float(mask[i, t]) for t in range(T)) or 1.0
        seq = math.exp(sum(float(new[i, t] - old[i, t]) * float(mask[i, t]) for t in range(T)) / n)
        for t in range(T):
            a = float(adv[i, t])
            rho = math.exp(float(new[i, t] - old[i, t]))
            lo, hi = 1 - p.clip_eps, 1 + p.eps_high
            if name == "ppo_clip":
                loss = -min(rho * a, min(max(rho, lo), hi) * a)
                if p.dual_clip is not None and a < 0:
                    loss = min(loss, -p.dual_clip * a)
            elif name == "gspo":
                loss = -min(seq * a, min(max(seq, lo), hi) * a)
            elif name == "cispo":
                loss = -min(max(rho, lo), hi) * a
            else:
                loss = -a
            out[i, t] = loss
    return out


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_losses_vectorised_match_loop(name):
    g = torch.Generator().manual_seed(7)
    B, T = 5, 9
    old = -torch.rand(B, T, generator=g) * 3
    new = old + 0.4 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    mask = _random_mask(g, B, T)
    p = LossParams(0.2, 0.28, 3.0) if name != "gspo" else LossParams(0.05, 0.08)
    loss, _ = get_policy_loss_fn(name)(new, old, adv, mask, p)
    want = _loop_token_loss(name, new, old, adv, mask, p)
    torch.testing.assert_close(loss * mask, want * mask, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_aggregation_vectorised_matches_loop(mode):
    g = torch.Generator().manual_seed(8)
    B, T = 6, 10
    mask = _random_mask(g, B, T)
    loss = torch.randn(B, T, generator=g)
    rows = [[float(loss[i, t]) for t in range(T) if mask[i, t] > 0] for i in range(B)]
    longest = max(len(r) for r in rows)
    if mode == "token-mean":
        want = sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    elif mode == "seq-mean-token-mean":
        want = sum(sum(r) / len(r) for r in rows) / B
    elif mode == "seq-mean-token-sum":
        want = sum(sum(r) for r in rows) / B
    else:
        want = sum(sum(r) for r in rows) / (B * longest)
    assert aggregate(loss, mask, mode).item() == pytest.approx(want, rel=1e-5)


def test_reinforce_pp_vectorised_matches_loop():
    g = torch.Generator().manual_seed(9)
    B, T, gamma = 6, 12, 0.9
    mask = _random_mask(g, B, T)
    rewards = torch.randn(B, generator=g)
    kl_pen = -0.05 * torch.rand(B, T, generator=g)
    adv = reinforce_pp_advantages(
        rewards, torch.arange(B), loss_mask=mask, token_rewards=kl_pen, gamma=gamma
    )
    returns = torch.zeros(B, T)
    for i in range(B):
        steps = [t for t in range(T) if mask[i, t] > 0]
        running = 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            r = float(kl_pen[i, t]) + (float(rewards[i]) if k == len(steps) - 1 else 0.0)
            running = r + gamma * running
            returns[i, t] = running
    vals = returns[mask > 0]
    want = (returns - vals.mean()) / (vals.std(unbiased=False) + 1e-8) * mask
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)
