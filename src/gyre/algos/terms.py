"""The named terms of the policy update's loss: pure functions of tensors and config values.

Each term returns ``(contribution, metrics)``: ``contribution`` is what it adds to the loss
(per token (B, T) before aggregation, except the value loss, which is already a scalar share of
the step and the rollout-IS weight, which multiplies the policy term) and ``metrics`` are
masked token *sums* (detached; the update divides them by the step's scored tokens). None of
them sees a model or an optimizer; :func:`gyre.trainer.loss.micro_batch_loss` adds them up:

    loss = sum_t w_t * (pg_t * is_t + kl_coef * kl_t - entropy_coef * H_t)
           + vf_coef * sum_t vl_t / (step tokens)

in exactly this float order. Formulas and papers: docs/algorithms.md.
"""

from __future__ import annotations

import torch

from gyre.algos.correction import rollout_is_weights
from gyre.algos.losses import LossParams, get_kl_fn, get_policy_loss_fn, masked_token_sum

Metrics = dict[str, torch.Tensor]


def policy_term(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    name: str,
    params: LossParams,
) -> tuple[torch.Tensor, Metrics]:
    """The registered policy loss ``name`` (PPO-clip, GSPO, CISPO, REINFORCE) per token (B, T);
    metric ``clipfrac``: the tokens where a clip was active."""
    loss, clipped = get_policy_loss_fn(name)(logprobs, old_logprobs, advantages, loss_mask, params)
    return loss, {"clipfrac": masked_token_sum(clipped.float(), loss_mask)}


def rollout_is_term(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str,
    level: str,
    threshold: float,
    threshold_lower: float,
) -> tuple[torch.Tensor, Metrics]:
    """The rollout importance weight (B, T) that multiplies the policy term: TIS (``truncate``,
    min(w, C)) or MIS (``mask``), w = pi_old_train / pi_rollout (see
    :func:`gyre.algos.rollout_is_weights`); metrics ``is_weight``, ``is_affected_frac``."""
    w, affected = rollout_is_weights(
        old_logprobs.detach(),
        rollout_logprobs,
        loss_mask,
        mode,
        level,
        threshold,
        threshold_lower,
    )
    return w, {
        "is_weight": masked_token_sum(w, loss_mask),
        "is_affected_frac": masked_token_sum(affected, loss_mask),
    }


def kl_term(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    kl_type: str,
    coef: float,
) -> tuple[torch.Tensor, Metrics]:
    """KL penalty to the reference per token: ``coef * k(logp, ref)`` with the named estimator
    (k1, k2, k3); metric ``kl``: the estimator's value (without the coefficient)."""
    kl = get_kl_fn(kl_type)(logprobs, ref_logprobs)
    return coef * kl, {"kl": masked_token_sum(kl.detach(), loss_mask)}


def entropy_term(
    entropy: torch.Tensor, loss_mask: torch.Tensor, coef: float
) -> tuple[torch.Tensor | None, Metrics]:
    """Entropy bonus per token: ``-coef * H`` (a positive coefficient rewards entropy), None
    when ``coef`` is 0 (no term in the loss at all); metric ``entropy`` either way."""
    bonus = None if coef == 0 else -coef * entropy
    return bonus, {"entropy": masked_token_sum(entropy.detach(), loss_mask)}


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token: 0.5 max((V - R)^2, (V_old + clip(V - V_old) - R)^2).

    Returns (loss (B, T), clipped (B, T) bool: where the clipped branch was the larger).
    """
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    a = (values - returns) ** 2
    b = (v_clipped - returns) ** 2
    return 0.5 * torch.maximum(a, b), b > a


def value_term(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    clip: float,
    coef: float,
    step_tokens: float,
) -> tuple[torch.Tensor, Metrics]:
    """The clipped value loss of a GAE value model as this part's scalar share of the step:
    ``coef * sum_t vl_t / step_tokens`` -- a per-token mean over the whole optimizer step,
    whatever the policy's loss aggregation; metrics ``value_loss``, ``vf_clipfrac``."""
    vl, vclip = clipped_value_loss(values, old_values, returns, clip)
    v_loss = masked_token_sum(vl, loss_mask) / max(step_tokens, 1.0)
    return coef * v_loss, {
        "value_loss": masked_token_sum(vl.detach(), loss_mask),
        "vf_clipfrac": masked_token_sum(vclip, loss_mask),
    }
