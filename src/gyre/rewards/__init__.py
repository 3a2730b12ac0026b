"""Rewards beyond the env's rule: functions named by import path, combined with weights.

- :mod:`gyre.rewards.contract` — the contract, :class:`Rewarder`, per-term metrics;
- :mod:`gyre.rewards.sandbox` — worker processes with time/memory limits and no network;
- :mod:`gyre.rewards.math_answer` — ``math_answer``, built on ``math-verify``;
- :mod:`gyre.rewards.reward_model` — ``reward_model``, any local HF sequence classifier.

See docs/rewards.md. This package imports neither torch nor math-verify until a built-in
needs them, so sandbox workers start fast.
"""

from gyre.rewards.contract import (
    RewardBatch,
    Rewarder,
    batch_from_trajectories,
    build_rewarder,
    resolve_callable,
)
from gyre.rewards.errors import RewardError, RewardSandboxError, SandboxUnavailableError

__all__ = [
    "RewardBatch",
    "RewardError",
    "RewardSandboxError",
    "Rewarder",
    "SandboxUnavailableError",
    "batch_from_trajectories",
    "build_rewarder",
    "resolve_callable",
]
