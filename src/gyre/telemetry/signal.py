"""The no-learning-signal warning: every group of a step had one reward for all its samples.

GRPO-style advantages are a sample's reward against its group's; a group whose samples all got
the same reward (``rollout/frac_reward_zero_std`` = 1.0 for the whole batch) gives zero
advantages, so the step changes nothing but the KL and entropy terms. After
``log.no_signal_steps`` such steps in a row the run says so, on the console and in the
``gyre.loop`` log, with what to change; again after twice as many, and so on.
"""

from __future__ import annotations

import logging

from gyre.telemetry.sinks import MetricsSink

_log = logging.getLogger("gyre.loop")


def no_signal_message(streak: int, reward: float) -> str:
    return (
        f"no learning signal: in each of the last {streak} steps every group's samples got "
        f"the same reward (rollout/frac_reward_zero_std = 1.0, mean reward {reward:g}), so all "
        "advantages are zero and the policy does not learn. Try more SFT (sft.steps), a higher "
        "temperature (train.sampling.temperature), larger groups (train.group_size), DAPO "
        "dynamic sampling (train.dapo.dynamic_sampling=true), or an easier task / denser reward."
    )


class NoSignalWatch:
    """Counts steps in a row with no group reward spread; ``update`` warns when due."""

    def __init__(self, steps: int) -> None:
        self.steps = steps  # 0: never warn
        self.streak = 0
        self._next = steps

    def update(self, metrics: dict[str, float], out: MetricsSink) -> str | None:
        """Feed one step's metrics; returns (and sends to ``out`` and the log) the warning
        when the streak reaches ``steps``, ``2 * steps``, ``4 * steps``, ..."""
        if metrics.get("rollout/frac_reward_zero_std", 0.0) < 1.0:
            self.streak, self._next = 0, self.steps
            return None
        self.streak += 1
        if not self.steps or self.streak < self._next:
            return None
        self._next *= 2
        text = no_signal_message(self.streak, metrics.get("rollout/reward_mean", float("nan")))
        out.message(text)
        _log.warning(text)
        return text
