"""DAPO's batch-side parts (Yu et al. 2025, arXiv:2503.14476), applied before the advantages.

- **Overlong punishment** (:func:`overlong_penalty`): a soft length penalty over the last
  ``buffer`` tokens before the length limit.
- **Truncated-response masking** (:func:`mask_truncated`): an episode cut off by the token limit
  gets no loss at all, so the policy is not pushed away from a reasoning that only ran long.

Dynamic sampling, the sampling-side part, is :mod:`gyre.rollout.dapo`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gyre.config import DapoConfig, SamplingConfig
from gyre.trainer.batch import TokenBatch
from gyre.types import Trajectory


def overlong_penalty(
    lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward (Eq. 13 of the paper).

    0 while |y| <= L_max - L_buf; ((L_max - L_buf) - |y|) / L_buf * factor inside the buffer
    (linear from 0 to -factor); -factor beyond L_max. ``buffer_len == 0`` disables it.
    """
    lengths = lengths.float()
    if buffer_len <= 0:
        return torch.zeros_like(lengths)
    if buffer_len > max_len:
        raise ValueError(f"overlong buffer ({buffer_len}) is longer than max_len ({max_len})")
    start = max_len - buffer_len
    pen = (start - lengths) / buffer_len * factor
    return pen.clamp(min=-factor, max=0.0)


def mask_truncated(batch: TokenBatch, trajs: Sequence[Trajectory]) -> float:
    """Zero the loss mask of truncated episodes in place; returns the fraction masked.

    Their tokens leave every loss and every denominator (DAPO's overlong filtering).
    """
    if len(trajs) != batch.loss_mask.shape[0]:
        raise ValueError(
            f"{len(trajs)} trajectories for a batch of {batch.loss_mask.shape[0]} rows"
        )
    cut = torch.tensor([t.truncated for t in trajs], device=batch.loss_mask.device)
    if cut.any():
        batch.loss_mask.mul_((~cut).to(batch.loss_mask.dtype).unsqueeze(-1))
    return float(cut.float().mean()) if len(trajs) else 0.0


def apply_overlong(
    rewards: torch.Tensor,
    trajs: Sequence[Trajectory],
    batch: TokenBatch,
    cfg: DapoConfig,
    sampling: SamplingConfig,
    metrics: dict[str, float],
) -> torch.Tensor:
    """The loop's one call for overlong handling: returns the shaped rewards (N,), and masks
    truncated episodes out of ``batch`` when ``cfg.mask_truncated``. Both off by default."""
    shaped = rewards
    if cfg.overlong_buffer_len > 0:
        lengths = torch.tensor([float(t.num_generated) for t in trajs])
        max_len = cfg.overlong_max_len or sampling.max_new_tokens
        pen = overlong_penalty(
            lengths, max_len, cfg.overlong_buffer_len, cfg.overlong_penalty_factor
        )
        shaped = rewards + pen
        metrics["rollout/overlong_penalty_mean"] = float(pen.mean())
    if cfg.mask_truncated:
        metrics["rollout/truncated_frac"] = mask_truncated(batch, trajs)
    return shaped
