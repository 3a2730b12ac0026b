"""The loss of one micro-batch for a ``train`` config: the sum of the named terms of
:mod:`gyre.algos.terms` (policy loss, rollout-IS weight, KL, entropy bonus, value loss)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyre.algos import LossParams, masked_token_sum
from gyre.algos.terms import entropy_term, kl_term, policy_term, rollout_is_term, value_term
from gyre.config import TrainConfig
from gyre.trainer.batch import TokenBatch

__all__ = ["TokenTerms", "loss_params", "micro_batch_loss"]


def loss_params(train: TrainConfig) -> LossParams:
    """The clip settings of the ratio-based policy losses."""
    return LossParams(train.clip_eps, train.algo.clip_eps_high, train.algo.dual_clip)


@dataclass(frozen=True)
class TokenTerms:
    """What the loss terms read of one micro-batch, per token (b, T)."""

    logp: torch.Tensor  # the current policy's log-probs
    old: torch.Tensor  # the old policy's (the ratio's denominator)
    adv: torch.Tensor  # the advantages, (b,) or (b, T)
    entropy: torch.Tensor
    ref_logp: torch.Tensor | None = None  # the KL reference's (with a KL loss)
    values: torch.Tensor | None = None  # the value model's (with a critic)


def micro_batch_loss(
    train: TrainConfig,
    mb: TokenBatch,
    weights: torch.Tensor,
    step_tokens: float,
    terms: TokenTerms,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step loss, the sum of the named terms, and their metric
    sums. Per token: policy loss x rollout-IS weight, + KL (when ``ref_logp``), + entropy
    bonus; aggregated by ``weights``; + the value loss (when ``values``), in this float order.
    """
    logp, old, adv, ent = terms.logp, terms.old, terms.adv, terms.entropy
    ref_logp, values = terms.ref_logp, terms.values
    a = train.algo
    mask = mb.loss_mask
    loss_tok, metrics = policy_term(logp, old, adv, mask, a.policy_loss, loss_params(train))
    if a.rollout_is != "none":
        is_w, m = rollout_is_term(
            old,
            mb.rollout_logprobs,
            mask,
            a.rollout_is,
            a.rollout_is_level,
            a.rollout_is_threshold,
            a.rollout_is_threshold_lower,
        )
        loss_tok = loss_tok * is_w
        metrics.update(m)
    if ref_logp is not None:
        kl, m = kl_term(logp, ref_logp, mask, a.kl_type, train.kl_coef)
        loss_tok = loss_tok + kl
        metrics.update(m)
    bonus, m = entropy_term(ent, mask, a.entropy_coef)
    if bonus is not None:
        loss_tok = loss_tok + bonus
    metrics.update(m)
    loss = masked_token_sum(loss_tok, weights)
    if values is not None:
        ex = mb.extras
        v, m = value_term(
            values, ex["values"], ex["returns"], mask, a.value_clip, a.vf_coef, step_tokens
        )
        loss = loss + v
        metrics.update(m)
    return loss, metrics
