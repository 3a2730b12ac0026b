"""The general update (gyre.trainer.update): accumulation invariance for every aggregation mode
and loss,
per-token advantages, old-logprob recomputation and when it is skipped, rollout IS, KL in the
loss or the reward, the entropy bonus and the GAE value models."""

from __future__ import annotations

import copy

import pytest
import torch

from gyre.algos import LOSS_AGGREGATIONS, POLICY_LOSSES
from gyre.trainer.advantages import batch_advantages
from gyre.trainer.batch import collate, token_logprobs
from gyre.trainer.critic import ValueModel
from gyre.trainer.update import (
    policy_update,
    prepare_batch,
    resolve_old_logprobs,
)
from gyre.types import Trajectory
from helpers import train_cfg

CPU = torch.device("cpu")


def _synthetic(model, pad_id, *, n=6, noise=0.3, seed=0):
    """Trajectories of different lengths with masked spans and near-on-policy rollout logprobs."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        T = int(torch.randint(8, 25, (1,), generator=g))
        ids = [1, *torch.randint(4, 100, (T - 1,), generator=g).tolist()]
        mask = [0] * 4 + (torch.rand(T - 4, generator=g) < 0.6).long().tolist()
        mask[-1] = 1
        trajs.append(Trajectory(ids, mask, [0.0] * T, float(i % 2), i // 2, 0, 1, False, i))
    batch = collate(trajs, pad_id, CPU)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
    old = (logp + noise * torch.randn(logp.shape, generator=g)) * batch.loss_mask
    for i, t in enumerate(trajs):
        t.rollout_logprobs = old[i, : len(t.token_ids)].tolist()
    return trajs


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def _run(base, trajs, pad_id, settings, adv, *, lr=0.5, ref=None, value_model=None):
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    batch = collate(trajs, pad_id, CPU)
    vm = None
    if value_model is not None:
        vm = ValueModel(model, value_model, lr=0.05)
        prepare_batch(model, batch, settings, ref, vm)
        rewards = torch.tensor([t.reward for t in trajs])
        groups = torch.tensor([t.group_id for t in trajs])
        adv, _ = batch_advantages("gae", rewards, groups, batch, settings)
    else:
        prepare_batch(model, batch, settings, ref)
    gen = torch.Generator().manual_seed(7)
    m = policy_update(
        model, opt, batch, adv, settings, ref_model=ref, generator=gen, value_model=vm
    )
    return model, m, vm


@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("loss_agg", LOSS_AGGREGATIONS)
def test_accumulation_invariance_every_mode(make_tiny_model, tokenizer, loss_agg, loss):
    """Same update whatever the micro-batch size, for every aggregation mode x policy loss,
    with 2 mini-batches x 2 epochs and per-token advantages."""
    base = make_tiny_model(seed=0, sharp=True)
    pad = tokenizer.pad_token_id
    trajs = _synthetic(base, pad)
    T = max(len(t.token_ids) for t in trajs)
    adv = torch.randn(len(trajs), T, generator=torch.Generator().manual_seed(1))
    start = _params(base)
    results = []
    for micro in (64, 2, 1):
        s = train_cfg(
            clip_eps=0.1 if loss != "gspo" else 0.02,
            mini_batches=2,
            ppo_epochs=2,
            micro_batch_size=micro,
            max_grad_norm=1e9,
            loss_agg=loss_agg,
            policy_loss=loss,
            old_logprobs="recompute",
        )
        # token sums are ~10x a token mean: a smaller step keeps the 4 steps well-conditioned
        lr = 0.005 if loss_agg == "seq-mean-token-sum" else 0.05
        model, m, _ = _run(base, trajs, pad, s, adv, lr=lr)
        results.append((_params(model), m))
    ref, ref_m = results[0]
    assert _max_diff(ref, start) > 1e-3
    assert ref_m["train/optimizer_steps"] == 4.0
    for params, m in results[1:]:
        for a, b in zip(ref, params, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        for key in ("train/loss", "train/clipfrac", "train/entropy", "train/ppo_kl"):
            assert m[key] == pytest.approx(ref_m[key], rel=1e-4, abs=1e-6)


def test_per_token_advantage_equal_to_per_sequence(make_tiny_model, tokenizer):
    base = make_tiny_model(seed=2, sharp=True)
    pad = tokenizer.pad_token_id
    trajs = _synthetic(base, pad, seed=2)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    T = max(len(t.token_ids) for t in trajs)
    s = train_cfg(mini_batches=2, max_grad_norm=1e9, loss_agg="token-mean", old_logprobs="rollout")
    a, ma, _ = _run(base, trajs, pad, s, adv)
    b, mb, _ = _run(base, trajs, pad, s, adv.unsqueeze(-1).expand(-1, T).contiguous())
    assert _max_diff(_params(a), _params(b)) < 1e-6
    assert ma["train/loss"] == pytest.approx(mb["train/loss"], abs=1e-7)


def test_old_logprob_modes(make_tiny_model, tokenizer):
    base = make_tiny_model(seed=3, sharp=True)
    pad = tokenizer.pad_token_id
    trajs = _synthetic(base, pad, seed=3, noise=0.3)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    one = train_cfg(mini_batches=1, old_logprobs="auto")
    assert resolve_old_logprobs(one, 6) == "current"
    two = train_cfg(mini_batches=2, old_logprobs="auto")
    assert resolve_old_logprobs(two, 6) == "recompute"
    by_rows = train_cfg(mini_batches=1, mini_batch_size=2, old_logprobs="auto")
    assert resolve_old_logprobs(by_rows, 6) == "recompute"
    epochs = train_cfg(mini_batches=1, ppo_epochs=2, old_logprobs="auto")
    assert resolve_old_logprobs(epochs, 6) == "recompute"
    assert resolve_old_logprobs(train_cfg(old_logprobs="auto"), 6) == "recompute"  # 4 minis
    with pytest.raises(ValueError, match="exactly one optimizer step"):
        resolve_old_logprobs(train_cfg(mini_batches=2, old_logprobs="current"), 6)

    # recompute scores the batch with the trainer: the gap to the engine's logprobs is logged
    batch = collate(trajs, pad, CPU)
    m = prepare_batch(base, batch, two)
    with torch.no_grad():
        logp, _ = token_logprobs(base, batch)
    torch.testing.assert_close(batch.extras["old_logprobs"], logp * batch.loss_mask)
    gap = ((logp - batch.rollout_logprobs).abs() * batch.loss_mask).sum() / batch.num_tokens
    assert m["train/rollout_logprob_gap"] == pytest.approx(float(gap), rel=1e-5)
    assert m["train/rollout_logprob_gap"] > 0.1  # the synthetic sampler is off by noise 0.3

    # with one update per batch, skipping the recompute ("current") is exactly the same update
    same = []
    for mode in ("current", "recompute"):
        s = train_cfg(mini_batches=1, old_logprobs=mode, max_grad_norm=1e9, loss_agg="token-mean")
        model, m, _ = _run(base, trajs, pad, s, adv)
        assert m["train/clipfrac"] == 0.0 and m["train/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
        same.append(_params(model))
    assert _max_diff(*same) < 1e-7
    # the engine's logprobs as old policy ("rollout") clip on the sampler noise instead
    s = train_cfg(mini_batches=1, old_logprobs="rollout", max_grad_norm=1e9, loss_agg="token-mean")
    _, m, _ = _run(base, trajs, pad, s, adv)
    assert m["train/clipfrac"] > 0


def test_recompute_makes_second_mini_batch_see_only_policy_drift(make_tiny_model, tokenizer):
    base = make_tiny_model(seed=4, sharp=True)
    pad = tokenizer.pad_token_id
    trajs = _synthetic(base, pad, seed=4, noise=0.5)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    kw = dict(mini_batches=2, max_grad_norm=1e9, loss_agg="token-mean")
    s = train_cfg(old_logprobs="recompute", **kw)
    _, m_re, _ = _run(base, trajs, pad, s, adv, lr=1e-4)
    s = train_cfg(old_logprobs="rollout", **kw)
    _, m_ro, _ = _run(base, trajs, pad, s, adv, lr=1e-4)
    assert m_re["train/clipfrac"] == 0.0  # a tiny step never leaves the clip range
    assert m_ro["train/clipfrac"] > 0.1  # the engine noise alone trips the clip


def test_rollout_is_modes(make_tiny_model, tokenizer):
    base = make_tiny_model(seed=5, sharp=True)
    pad = tokenizer.pad_token_id
    trajs = _synthetic(base, pad, seed=5, noise=0.3)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    kw = dict(mini_batches=1, old_logprobs="current", max_grad_norm=1e9, loss_agg="token-mean")
    none, _, _ = _run(base, trajs, pad, train_cfg(**kw), adv)
    big, m, _ = _run(
        base, trajs, pad, train_cfg(rollout_is="truncate", rollout_is_threshold=1e6, **kw), adv
    )
    assert _max_diff(_params(none), _params(big)) > 1e-4  # weights != 1 change the update
    assert m["train/is_affected_frac"] == 0.0 and m["train/is_weight"] > 0
    _, m, _ = _run(
        base, trajs, pad, train_cfg(rollout_is="truncate", rollout_is_threshold=1.01, **kw), adv
    )
    assert 0 < m["train/is_affected_frac"] < 1 and m["train/is_weight"] < 1.01
    # masked IS with a window no token fits: no policy gradient at all
    s = train_cfg(
        rollout_is="mask", rollout_is_threshold=1.0001, rollout_is_threshold_lower=0.9999, **kw
    )
    masked, m, _ = _run(base, trajs, pad, s, adv)
    assert m["train/is_affected_frac"] == 1.0
    assert _max_diff(_params(masked), _params(base)) == 0.0


def test_kl_in_loss_and_in_reward(make_tiny_model, tokenizer):
    base = make_tiny_model(seed=6, sharp=True)
    ref = make_tiny_model(seed=7, sharp=True)
    pad = tokenizer.pad_token_id
    trajs = _synthetic(base, pad, seed=6, noise=0.0)
    zero = torch.zeros(len(trajs))
    for kl_type in ("k1", "k2", "k3"):
        s = train_cfg(
            kl_coef=0.1,
            kl_type=kl_type,
            old_logprobs="current",
            mini_batches=1,
            loss_agg="token-mean",
        )
        moved, m, _ = _run(base, trajs, pad, s, zero, ref=ref)
        assert m["train/kl"] != 0.0
        assert _max_diff(_params(moved), _params(base)) > 0  # only the KL term moves it
    # in the reward: an outcome estimator sees r - beta * sum_t KL_t
    batch = collate(trajs, pad, CPU)
    s = train_cfg(
        kl_coef=0.5, kl_type="k1", kl_in="reward", old_logprobs="recompute", mini_batches=1
    )
    prepare_batch(base, batch, s, ref)
    rewards = torch.tensor([t.reward for t in trajs])
    groups = torch.tensor([t.group_id for t in trajs])
    adv, m = batch_advantages("dr_grpo", rewards, groups, batch, s)
    kl = (batch.extras["old_logprobs"] - batch.extras["ref_logprobs"]) * batch.loss_mask
    shaped = rewards - 0.5 * kl.sum(dim=1)
    want = shaped - shaped.view(-1, 2).mean(dim=1).repeat_interleave(2)
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)
    assert m["train/kl"] == pytest.approx(float(kl.sum() / batch.num_tokens), rel=1e-5)
    # and a token estimator sees -beta * KL_t per token
    adv_t, _ = batch_advantages("reinforce_pp", rewards, groups, batch, s)
    assert adv_t.shape == batch.loss_mask.shape
    plain = train_cfg(old_logprobs="recompute", mini_batches=1)
    adv_0, _ = batch_advantages("reinforce_pp", rewards, groups, batch, plain)
    assert (adv_t - adv_0).abs().max() > 1e-3


def test_entropy_bonus_raises_entropy(make_tiny_model, tokenizer):
    base = make_tiny_model(seed=8, sharp=True)
    pad = tokenizer.pad_token_id
    trajs = _synthetic(base, pad, seed=8, noise=0.0)
    zero = torch.zeros(len(trajs))
    kw = dict(old_logprobs="current", max_grad_norm=1e9, mini_batches=1, loss_agg="token-mean")
    s = train_cfg(entropy_coef=1.0, **kw)
    model, m0, _ = _run(base, trajs, pad, s, zero, lr=0.05)
    _, m1, _ = _run(model, trajs, pad, s, zero, lr=0.05)
    assert m1["train/entropy"] > m0["train/entropy"] + 1e-3
    # coefficient 0: advantages 0 give no gradient at all
    s0 = train_cfg(entropy_coef=0.0, **kw)
    still, _, _ = _run(base, trajs, pad, s0, zero, lr=0.05)
    assert _max_diff(_params(still), _params(base)) == 0.0


@pytest.mark.parametrize("mode", ["critic", "head"])
def test_gae_value_model_learns(make_tiny_model, tokenizer, mode):
    base = make_tiny_model(seed=9, sharp=True)
    pad = tokenizer.pad_token_id
    trajs = _synthetic(base, pad, seed=9, noise=0.0)
    model = copy.deepcopy(base)
    vm = ValueModel(model, mode, lr=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.0 if mode == "critic" else 1e-3)
    rewards = torch.tensor([t.reward for t in trajs])
    groups = torch.tensor([t.group_id for t in trajs])
    s = train_cfg(
        mini_batches=2,
        old_logprobs="recompute",
        vf_coef=1.0,
        value_clip=10.0,
        loss_agg="token-mean",
    )
    gae = train_cfg(gamma=1.0, lam=0.95)  # the estimator's numbers
    losses = []
    for _ in range(6):
        batch = collate(trajs, pad, CPU)
        prepare_batch(model, batch, s, value_model=vm)
        adv, _ = batch_advantages("gae", rewards, groups, batch, gae)
        gen = torch.Generator().manual_seed(len(losses))
        m = policy_update(model, opt, batch, adv, s, generator=gen, value_model=vm)
        losses.append(m["train/value_loss"])
    assert losses[-1] < 0.5 * losses[0]
    assert vm.head.weight.abs().sum() > 0
    if mode == "critic":
        # a separate critic never touches the policy (its lr is 0 here, and it shares nothing)
        assert _max_diff(_params(model), _params(base)) == 0.0
        assert vm.backbone is not None
    else:
        assert list(vm.parameters()) == list(vm.head.parameters())


def test_gae_needs_value_targets(make_tiny_model, tokenizer):
    base = make_tiny_model(seed=10)
    trajs = _synthetic(base, tokenizer.pad_token_id, seed=10)
    vm = ValueModel(base, "critic")
    batch = collate(trajs, tokenizer.pad_token_id, CPU)
    opt = torch.optim.SGD(base.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="value targets"):
        s = train_cfg(mini_batches=1, old_logprobs="rollout", loss_agg="token-mean")
        policy_update(base, opt, batch, torch.zeros(6), s, value_model=vm)
    with pytest.raises(ValueError, match="valid: critic, head"):
        ValueModel(base, "shared")  # type: ignore[arg-type]


@pytest.mark.parametrize("loss_agg", LOSS_AGGREGATIONS)
def test_global_counts_from_ranks(make_tiny_model, tokenizer, loss_agg):
    """``reduce_counts`` stands in for an all-reduce: two ranks holding this same batch have
    twice the rows and tokens, so each rank's share of the step loss (and gradient) halves."""
    base = make_tiny_model(seed=11, sharp=True)
    pad = tokenizer.pad_token_id
    trajs = _synthetic(base, pad, seed=11)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    start = _params(base)
    deltas = []
    for reduce in (None, lambda c: c + c):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s = train_cfg(loss_agg=loss_agg, old_logprobs="current", max_grad_norm=1e9, mini_batches=1)
        policy_update(model, opt, collate(trajs, pad, CPU), adv, s, reduce_counts=reduce)
        deltas.append([p - q for p, q in zip(_params(model), start, strict=True)])
    for full, half in zip(*deltas, strict=True):
        torch.testing.assert_close(half, 0.5 * full, atol=1e-6, rtol=1e-4)
