"""Off-policy correction for the training-inference mismatch: importance weights
pi_old_train / pi_rollout between the trainer's recomputed log-probs and the engine's.

The sampler's log-probs differ from the trainer's (other kernels, precision, batch shape), so the
samples come from a slightly different policy than the one PPO's ratio assumes. Two fixes
(Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"):

- ``truncate`` (TIS): multiply each token's loss by min(w, C);
- ``mask`` (MIS): keep the token (weight 1) only when C_min <= w <= C_max, else weight 0.

At ``token`` level w_t = exp(old_t - rollout_t); at ``sequence`` level every token of row i
uses w_i = exp(sum_t (old_t - rollout_t)) (the product of its token ratios). Weights are detached.
"""

from __future__ import annotations

import torch

IS_MODES = ("none", "truncate", "mask")
IS_LEVELS = ("token", "sequence")


def rollout_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str,
    level: str = "token",
    threshold: float = 2.0,
    threshold_lower: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weights (B, T), affected (B, T) bool: truncated or masked), 0 off the mask.

    ``threshold`` is C (TIS cap, MIS upper bound); ``threshold_lower`` is MIS's lower bound
    (0 means 1 / threshold).
    """
    if mode not in IS_MODES:
        raise ValueError(f"unknown rollout IS mode {mode!r}; valid: {', '.join(IS_MODES)}")
    if level not in IS_LEVELS:
        raise ValueError(f"unknown rollout IS level {level!r}; valid: {', '.join(IS_LEVELS)}")
    mask = loss_mask > 0
    if mode == "none":
        return loss_mask.float(), torch.zeros_like(mask)
    log_w = (old_logprobs - rollout_logprobs).detach() * loss_mask
    if level == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand_as(log_w)
    w = torch.exp(log_w.clamp(max=50.0))
    if mode == "truncate":
        out = torch.clamp(w, max=threshold)
        affected = w > threshold
    else:
        low = threshold_lower if threshold_lower > 0 else 1.0 / threshold
        keep = (w >= low) & (w <= threshold)
        out = keep.float()
        affected = ~keep
    return out * loss_mask, affected & mask
