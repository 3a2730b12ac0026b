"""Prioritised level replay over GRPO training tasks (Jiang et al. 2021, arXiv:2010.03934).

A task (a training seed of the GRPO stream) whose group came back with *mixed outcomes* -- a
success rate strictly between 0 and 1 -- still has something to teach: GRPO's advantages are
nonzero there. :class:`LevelReplay` keeps up to ``buffer_size`` such tasks, scored by their
group's reward std (the spread the group baseline works on), and each task slot of a step
replays one of them with probability ``prob``, else takes the next new task. Replayed tasks are
drawn by rank: P(task) ~ (1 / rank)^(1 / temperature), rank 1 = highest score. A replayed task
whose group comes back all-success or all-failure leaves the buffer; a full buffer evicts its
lowest score.

Deviations from the paper: the score is the group's reward std, not the mean |GAE| of a value
model; no staleness term. The draws of step s, round r come from a generator seeded by
(run seed, stream, s, r), so the only state to checkpoint is the buffer itself
(:meth:`state_dict`), and a resumed run draws the very same tasks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from gyre.config import LevelReplayConfig
from gyre.types import Trajectory

STREAM_REPLAY = 9


class LevelReplay:
    """The replay buffer (task index -> score) and the per-slot replay draw."""

    def __init__(self, cfg: LevelReplayConfig, run_seed: int) -> None:
        self.cfg = cfg
        self.run_seed = run_seed
        self.scores: dict[int, float] = {}

    # -- drawing ------------------------------------------------------------------------------
    def probabilities(self, candidates: Sequence[int]) -> np.ndarray:
        """Rank prioritisation over ``candidates`` (ties: the lower task index ranks first)."""
        order = sorted(candidates, key=lambda k: (-self.scores[k], k))
        rank = {k: r + 1 for r, k in enumerate(order)}
        h = np.array([(1.0 / rank[k]) ** (1.0 / self.cfg.temperature) for k in candidates])
        return h / h.sum()

    def draw(
        self, n: int, next_task: int, step: int, round_: int, exclude: Iterable[int] = ()
    ) -> tuple[list[int], int]:
        """The ``n`` task indices of one rollout round and how many of them are new (those
        are ``next_task, next_task + 1, ...``). ``exclude``: tasks already played this step
        (a task is never in a step twice: its index is the group id)."""
        rng = np.random.default_rng([self.run_seed, STREAM_REPLAY, step, round_])
        taken = set(exclude)
        tasks: list[int] = []
        new = 0
        for _ in range(n):
            candidates = sorted(k for k in self.scores if k not in taken)
            if candidates and rng.random() < self.cfg.prob:
                k = int(rng.choice(candidates, p=self.probabilities(candidates)))
            else:
                k = next_task + new
                new += 1
            taken.add(k)
            tasks.append(k)
        return tasks, new

    # -- scoring ------------------------------------------------------------------------------
    def update(self, trajs: Sequence[Trajectory]) -> None:
        """Score each group of ``trajs`` (group id = task index): keep mixed-outcome tasks."""
        groups: dict[int, list[Trajectory]] = {}
        for t in trajs:
            groups.setdefault(t.group_id, []).append(t)
        for k, group in groups.items():
            rate = float(np.mean([t.success for t in group]))
            if 0.0 < rate < 1.0:
                self.scores[k] = float(np.std([t.reward for t in group], ddof=1))
            else:
                self.scores.pop(k, None)
        while len(self.scores) > self.cfg.buffer_size:
            worst = min(self.scores, key=lambda k: (self.scores[k], k))  # lowest, then oldest
            del self.scores[worst]

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"scores": [[k, v] for k, v in self.scores.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scores = {int(k): float(v) for k, v in state.get("scores", [])}
