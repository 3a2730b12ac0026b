"""DAPO's sampling-side part (Yu et al. 2025, arXiv:2503.14476): dynamic sampling, phase 1.

- **Dynamic sampling** (:func:`sample_groups`): a group whose rewards are all equal has zero
  advantage under every group baseline, so it only dilutes the batch. Drop such groups and
  roll out more tasks until ``tasks_per_step`` groups remain, at most ``max_rounds`` rounds.
  Logged: ``rollout/frac_groups_dropped`` (dropped / generated) and ``rollout/sampling_rounds``.
- The overlong punishment and truncated-response masking act on the trainer's batch:
  :mod:`gyre.trainer.overlong`.

The other DAPO part, clip-higher, is ``train.algo.clip_eps_high``; its token-mean aggregation is
``train.loss_agg=token-mean``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

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
