"""DAPO's sampling-side parts (Yu et al. 2025, arXiv:2503.14476), used by loop phases 1 and 3.

- **Dynamic sampling** (:func:`sample_groups`): a group whose rewards are all equal has zero
  advantage under every group baseline, so it only dilutes the batch. Drop such groups and
  roll out more tasks until ``tasks_per_step`` groups remain, at most ``max_rounds`` rounds.
  Logged: ``rollout/frac_groups_dropped`` (dropped / generated) and ``rollout/sampling_rounds``.
- **Overlong punishment** (:func:`overlong_penalty`): a soft length penalty over the last
  ``buffer`` tokens before the length limit.
- **Truncated-response masking** (:func:`mask_truncated`): an episode cut off by the token limit
  gets no loss at all, so the policy is not pushed away from a reasoning that only ran long.

The other DAPO part, clip-higher, is ``train.algo.clip_eps_high``; its token-mean aggregation is
``train.loss_agg=token-mean``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from gyre.config import DapoConfig, SamplingConfig
from gyre.trainer.batch import TokenBatch
from gyre.types import Trajectory


def _groups(trajs: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories grouped by ``group_id``, in first-seen order."""
    out: dict[int, list[Trajectory]] = {}
    for t in trajs:
        out.setdefault(t.group_id, []).append(t)
    return list(out.values())


def has_reward_variance(
    group: Sequence[Trajectory], reward_of: Callable[[Trajectory], float]
) -> bool:
    first = reward_of(group[0])
    return any(reward_of(t) != first for t in group[1:])


def sample_groups(
    generate: Callable[[int, int], list[Trajectory]],
    num_tasks: int,
    *,
    dynamic: bool = False,
    max_rounds: int = 4,
    reward_of: Callable[[Trajectory], float] = lambda t: t.reward,
) -> tuple[list[Trajectory], dict[str, float]]:
    """Roll out ``num_tasks`` groups; with ``dynamic``, keep only groups with reward variance.

    ``generate(n_tasks, round)`` plays ``n_tasks`` new tasks (a full group each) and returns
    their trajectories. Without ``dynamic`` this is exactly one call ``generate(num_tasks, 0)``.
    With it, each further round asks only for the missing groups; the result keeps at most
    ``num_tasks`` groups, renumbered ``0..K-1`` and contiguous. If the cap is hit with fewer, the
    step trains on fewer groups; if none at all had variance, on the last round's groups (all
    advantages 0, so only the KL / entropy terms move the policy).
    """
    if not dynamic:
        return generate(num_tasks, 0), {}
    kept: list[list[Trajectory]] = []
    generated = dropped = rounds = 0
    last: list[list[Trajectory]] = []
    while len(kept) < num_tasks and rounds < max_rounds:
        last = _groups(generate(num_tasks - len(kept), rounds))
        rounds += 1
        generated += len(last)
        good = [g for g in last if has_reward_variance(g, reward_of)]
        dropped += len(last) - len(good)
        kept.extend(good)
    chosen = kept[:num_tasks] if kept else last
    out = [replace(t, group_id=k) for k, g in enumerate(chosen) for t in g]
    metrics = {
        "rollout/frac_groups_dropped": dropped / max(generated, 1),
        "rollout/sampling_rounds": float(rounds),
        "rollout/groups_kept": float(len(kept[:num_tasks])),
    }
    return out, metrics


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
