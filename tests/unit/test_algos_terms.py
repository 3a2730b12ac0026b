"""The named loss terms of the policy update (gyre.algos.terms) and their sum
(gyre.trainer.loss.micro_batch_loss) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from gyre.algos import (
    LossParams,
    agg_weights,
    clipped_value_loss,
    entropy_term,
    kl_term,
    policy_term,
    rollout_is_term,
    value_term,
)
from gyre.trainer.batch import TokenBatch
from gyre.trainer.loss import TokenTerms, micro_batch_loss
from helpers import train_cfg

LN2 = math.log(2.0)


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_policy_term_ppo_clip_and_clipfrac():
    # ratios exp(logp - old) = (1.5, 0.9, 2.0), A = 1, eps 0.2:
    # token 0: min(1.5, clip 1.2) = 1.2 -> loss -1.2, clipped; token 1: min(.9, .9) -> -0.9;
    # token 2 (off the mask): clipped too, but clipfrac counts mask tokens only -> sum 1
    logp = _t([[math.log(1.5), math.log(0.9), math.log(2.0)]])
    mask = _t([[1.0, 1.0, 0.0]])
    loss, m = policy_term(logp, torch.zeros(1, 3), _t([[1.0]]), mask, "ppo_clip", LossParams())
    torch.testing.assert_close(loss, _t([[-1.2, -0.9, -1.2]]))
    assert m["clipfrac"].item() == 1.0
    # REINFORCE ignores the ratio: the loss value is -A per token, never clipped
    loss, m = policy_term(logp, torch.zeros(1, 3), _t([[2.0]]), mask, "reinforce", LossParams())
    torch.testing.assert_close(loss, _t([[-2.0, -2.0, -2.0]]))
    assert m["clipfrac"].item() == 0.0
    with pytest.raises(ValueError, match="ppo_clip"):
        policy_term(logp, logp, _t([[1.0]]), mask, "sppo", LossParams())


def test_rollout_is_term_tis_cap_and_mis_window():
    # w = exp(old - rollout) = (1, 3, 0.25); TIS with C = 2: min(w, 2) = (1, 2, 0.25)
    old = _t([[0.0, math.log(3.0), math.log(0.25)]])
    rollout = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    w, m = rollout_is_term(old, rollout, mask, "truncate", "token", 2.0, 0.0)
    torch.testing.assert_close(w, _t([[1.0, 2.0, 0.25]]))
    assert m["is_weight"].item() == pytest.approx(3.25)
    assert m["is_affected_frac"].item() == 1.0  # only the 3 was truncated
    # MIS, window [1/2, 2]: keep 1, drop 3 and 0.25
    w, m = rollout_is_term(old, rollout, mask, "mask", "token", 2.0, 0.0)
    assert w.tolist() == [[1.0, 0.0, 0.0]] and m["is_affected_frac"].item() == 2.0
    # sequence level: w = 1 * 3 * 0.25 = 0.75 for every token, under the cap
    w, _ = rollout_is_term(old, rollout, mask, "truncate", "sequence", 2.0, 0.0)
    torch.testing.assert_close(w, _t([[0.75, 0.75, 0.75]]))
    # the weight is a constant of the loss: no gradient flows into old log-probs
    old_g = old.clone().requires_grad_()
    w, _ = rollout_is_term(old_g, rollout, mask, "truncate", "token", 2.0, 0.0)
    assert not w.requires_grad


def test_kl_term_k3_k1_k2_hand_values():
    # d = logp - ref = (ln 2, -ln 2):
    # k3 = e^-d + d - 1 = (0.5 + ln2 - 1, 2 - ln2 - 1) = (0.193147, 0.306853)
    logp = _t([[math.log(0.5), math.log(0.25)]])
    ref = _t([[math.log(0.25), math.log(0.5)]])
    mask = torch.ones(1, 2)
    k3 = [0.5 + LN2 - 1.0, 2.0 - LN2 - 1.0]
    c, m = kl_term(logp, ref, mask, "k3", 0.1)
    torch.testing.assert_close(c, 0.1 * _t([k3]))  # the contribution carries the coefficient
    assert m["kl"].item() == pytest.approx(sum(k3), rel=1e-5)  # the metric does not (0.5)
    c, m = kl_term(logp, ref, mask, "k1", 1.0)  # k1 = d
    torch.testing.assert_close(c, _t([[LN2, -LN2]]))
    assert m["kl"].item() == pytest.approx(0.0, abs=1e-6)
    c, _ = kl_term(logp, ref, mask, "k2", 1.0)  # k2 = d^2 / 2 = 0.240227 both
    torch.testing.assert_close(c, _t([[LN2**2 / 2, LN2**2 / 2]]))


def test_entropy_term_is_a_bonus():
    # H = (1, 2) nats, coef 0.01: the loss gets -0.01 H = (-0.01, -0.02), so minimising the loss
    # raises entropy (d loss / d H = -coef < 0)
    ent = _t([[1.0, 2.0]]).requires_grad_()
    mask = _t([[1.0, 1.0]])
    bonus, m = entropy_term(ent, mask, 0.01)
    assert bonus is not None
    torch.testing.assert_close(bonus, _t([[-0.01, -0.02]]))
    bonus.sum().backward()
    torch.testing.assert_close(ent.grad, _t([[-0.01, -0.01]]))
    assert m["entropy"].item() == 3.0
    # coefficient 0: no term at all (not a zero term), the metric still reported
    bonus, m = entropy_term(ent, mask, 0.0)
    assert bonus is None and m["entropy"].item() == 3.0


def test_value_term_clipped_hand_values():
    # clip 0.2; token 0: V 1.0, V_old 0.5, R 2: V_clip = 0.5 + 0.2 = 0.7,
    #   (V - R)^2 = 1, (V_clip - R)^2 = 1.69 -> 0.5 * 1.69 = 0.845, the clipped branch is larger
    # token 1: V 0.6, V_old 0.5, R 0: inside the clip, 0.5 * 0.36 = 0.18, not clipped
    # token 2 (off the mask): V 0, V_old 0.5, R 0: V_clip 0.3 -> 0.5 * 0.09 = 0.045, clipped
    values, old, ret = _t([[1.0, 0.6, 0.0]]), _t([[0.5, 0.5, 0.5]]), _t([[2.0, 0.0, 0.0]])
    vl, clipped = clipped_value_loss(values, old, ret, 0.2)
    torch.testing.assert_close(vl, _t([[0.845, 0.18, 0.045]]))
    assert clipped.tolist() == [[True, False, True]]
    # the term: vf_coef 0.5 x masked sum (0.845 + 0.18 = 1.025) / 4 tokens in the whole step
    mask = _t([[1.0, 1.0, 0.0]])
    c, m = value_term(values, old, ret, mask, 0.2, 0.5, 4.0)
    assert c.dim() == 0 and c.item() == pytest.approx(0.5 * 1.025 / 4)
    assert m["value_loss"].item() == pytest.approx(1.025)
    assert m["vf_clipfrac"].item() == 1.0


def test_micro_batch_loss_is_the_sum_of_the_terms():
    # one row, 2 policy tokens, on-policy (ratio 1), A = 1 -> pg = (-1, -1);
    # KL k1 d = (ln 2, -ln 2) with kl_coef 0.1; entropy (1, 3) with coef 0.05; token-mean
    # weights 1/2: loss = 1/2 [(-1 + 0.1 ln2 - 0.05) + (-1 - 0.1 ln2 - 0.15)] = -1.1
    logp = _t([[0.0, math.log(0.5), math.log(0.25)]])
    ref = _t([[0.0, math.log(0.25), math.log(0.5)]])
    mask = _t([[0.0, 1.0, 1.0]])
    mb = TokenBatch(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3), mask, logp.clone())
    kw = dict(loss_agg="token-mean", kl_coef=0.1, kl_type="k1", entropy_coef=0.05)
    cfg = train_cfg(**kw)
    w = agg_weights(mask, cfg.loss_agg)
    ent = _t([[0.0, 1.0, 3.0]])
    terms = TokenTerms(logp, logp.detach(), _t([[1.0]]), ent, ref)
    loss, m = micro_batch_loss(cfg, mb, w, 2.0, terms)
    assert loss.item() == pytest.approx(-1.1, abs=1e-6)
    assert m["kl"].item() == pytest.approx(0.0, abs=1e-6) and m["entropy"].item() == 4.0
    assert m["clipfrac"].item() == 0.0 and "is_weight" not in m and "value_loss" not in m
    # TIS at C = 2 on a rollout that saw token 2 with half the trainer's probability
    # (w = 2, at the cap): its policy loss doubles -> loss = -1.1 + 1/2 (-1) = -1.6
    cfg = train_cfg(**kw, rollout_is="truncate", rollout_is_threshold=2.0)
    mb.rollout_logprobs[0, 2] = logp[0, 2] - LN2
    loss, m = micro_batch_loss(cfg, mb, w, 2.0, terms)
    assert loss.item() == pytest.approx(-1.6, abs=1e-5)
    assert m["is_weight"].item() == pytest.approx(3.0, rel=1e-5)
