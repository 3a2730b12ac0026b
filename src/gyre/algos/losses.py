"""Per-token policy losses and KL estimators, plus the one aggregation the loop uses.

All functions are elementwise over (B, T) tensors; masking and normalisation happen in
:func:`masked_token_sum`, whose caller divides by the token count of the *whole optimizer step*
(all micro-batches), so gradient accumulation does not change the loss scale.
"""

from __future__ import annotations

import torch


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip (Schulman et al. 2017, arXiv:1707.06347), per token.

    l_t = -min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A), rho_t = exp(logp_t - logp_old_t).
    ``advantages`` broadcasts against the (B, T) logprobs (pass (B, 1) for per-sequence A).
    Returns (loss (B, T), clipped (B, T) bool: where the clipped branch was taken).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) (Schulman, "Approximating KL divergence", 2020).

    With d = logp - logp_ref: k3 = exp(-d) + d - 1 >= 0, clamped to [-10, 10] for stability.
    """
    d = logprobs - ref_logprobs
    return torch.clamp(torch.exp(-d) + d - 1.0, min=-10.0, max=10.0)


def masked_token_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` over tokens where ``mask`` is 1 (divide by the step's token count)."""
    return (values * mask).sum()
