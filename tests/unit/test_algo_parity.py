"""Parity choices against verl, on hand values: the whitening std, rows without loss tokens in
the seq-mean denominators, and the abs / low_var_kl / straight-through ("+") KL estimators."""

from __future__ import annotations

import math

import pytest
import torch

from gyre.algos import (
    KL_ESTIMATORS,
    AdvantageInputs,
    AdvantageSettings,
    StepCounts,
    agg_weights,
    compute_advantages,
    get_kl_fn,
)
from gyre.algos.advantages import masked_whiten
from gyre.config import load_config


def test_whiten_population_vs_unbiased():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])  # the 9 is off the mask
    # mean 2.5; squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5
    pop, unb = math.sqrt(5 / 4), math.sqrt(5 / 3)
    got_pop = masked_whiten(x, mask, eps=0.0)
    got_unb = masked_whiten(x, mask, eps=0.0, std="unbiased")
    torch.testing.assert_close(got_pop, torch.tensor([[-1.5, -0.5, 0.5, 1.5, 0.0]]) / pop)
    torch.testing.assert_close(got_unb, torch.tensor([[-1.5, -0.5, 0.5, 1.5, 0.0]]) / unb)
    # verl's factor: unbiased-whitened = population-whitened * sqrt((n - 1) / n)
    torch.testing.assert_close(got_unb, got_pop * math.sqrt(3 / 4))
    with pytest.raises(ValueError, match="whitening std"):
        masked_whiten(x, mask, std="sample")


def test_gae_and_reinforce_pp_pass_the_whitening_choice():
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    rewards, groups = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    values = torch.zeros(2, 3)
    x, unbiased = AdvantageInputs(mask, values=values), AdvantageSettings(whiten_std="unbiased")
    pop, _ = compute_advantages("gae", rewards, groups, x)
    unb, _ = compute_advantages("gae", rewards, groups, x, unbiased)
    # 3 policy tokens: the unbiased std is sqrt(3/2) x the population one
    torch.testing.assert_close(unb, pop * math.sqrt(2 / 3), atol=1e-6, rtol=1e-5)
    pop, _ = compute_advantages("reinforce_pp", rewards, groups, AdvantageInputs(mask))
    unb, _ = compute_advantages("reinforce_pp", rewards, groups, AdvantageInputs(mask), unbiased)
    torch.testing.assert_close(unb, pop * math.sqrt(2 / 3), atol=1e-6, rtol=1e-5)
    cfg = load_config(None, ["train.algo.whiten_std=unbiased"])
    assert cfg.train.algo.whiten_std == "unbiased"
    assert load_config().train.algo.whiten_std == "population"  # today's numerics by default


def test_count_masked_rows_in_seq_mean():
    # 5 rows, the last one fully masked (a failed episode); token loss 1 everywhere
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 4 + [[0.0, 0.0, 0.0]])
    loss = torch.ones(5, 3)
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        counted = (loss * agg_weights(mask, mode, StepCounts.of(mask))).sum()
        dropped = (loss * agg_weights(mask, mode, StepCounts.of(mask, 0.0, False))).sum()
        # seq-mean-token-mean: each live row's mean is 1 -> 4 / 5 = 0.8 (gyre) vs 4 / 4 (verl);
        # token-sum: 2 per row -> 8 / 5 vs 8 / 4; sum-norm (L = 2): 8 / 10 vs 8 / 8
        assert float(dropped) == pytest.approx(float(counted) * 5 / 4)
    assert float((loss * agg_weights(mask, "seq-mean-token-mean", StepCounts.of(mask))).sum()) \
        == pytest.approx(0.8)  # fmt: skip
    # token-mean never counted rows
    assert StepCounts.of(mask, 0.0, False).tokens == StepCounts.of(mask).tokens == 8
    assert StepCounts.of(mask, 0.0, False).rows == 4 and StepCounts.of(mask).rows == 5
    assert load_config().train.algo.count_masked_rows is True


def _value_and_grad(name: str, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = d.clone().requires_grad_(True)
    val = get_kl_fn(name)(logp, torch.zeros_like(d))
    val.sum().backward()
    assert logp.grad is not None
    return val.detach(), logp.grad


def test_kl_estimators_values_and_gradients():
    d = torch.tensor([0.5, -1.0, -3.0])  # logp - logp_ref
    k3 = torch.tensor([math.exp(-0.5) - 0.5, math.e - 2.0, 10.0])  # e^3 - 4 = 16.09 -> 10
    want = {
        "abs": (d.abs(), torch.tensor([1.0, -1.0, -1.0])),  # d|d|/dd = sign(d)
        "low_var_kl": (k3, torch.tensor([1 - math.exp(-0.5), 1 - math.e, 0.0])),  # clamped: 0
        "k1+": (d, d),  # k1's value, k2's gradient d
        "k3+": (k3, d),
        "low_var_kl+": (k3, d),
        "abs+": (d.abs(), d),
    }
    for name, (value, grad) in want.items():
        v, g = _value_and_grad(name, d)
        torch.testing.assert_close(v, value, msg=name)
        torch.testing.assert_close(g, grad, msg=name)
    # low_var_kl is k3 (already clamped in gyre): the same function, the same numbers
    assert KL_ESTIMATORS["low_var_kl"] is KL_ESTIMATORS["k3"]
    _, g2 = _value_and_grad("k2", d)
    torch.testing.assert_close(g2, d)  # the gradient every "+" borrows
    for name in ("abs", "k1+", "k3+", "low_var_kl", "low_var_kl+", "abs+"):
        assert load_config(None, [f"train.algo.kl_type={name}"]).train.algo.kl_type == name
