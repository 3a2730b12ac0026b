"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay.

The factor of optimizer-schedule step s (0-based; ``scheduler.step()`` calls so far) is

    s < warmup:    (s + 1) / warmup                       (the first step already trains)
    constant:      1
    linear:        m + (1 - m) (1 - p)                    p = (s - warmup) / (total - warmup)
    cosine:        m + (1 - m) (1 + cos(pi p)) / 2        (p clipped to [0, 1])

with m = ``min_lr_ratio``. SFT steps its scheduler once per SFT step (``total = sft.steps``),
GRPO once per GRPO step, after that step's update (``total = train.steps``): every mini-batch of
one rollout batch uses the same LR, as verl's actor does.
"""

from __future__ import annotations

import math

import torch

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, warmup: int, total: int, kind: str, min_ratio: float = 0.0) -> float:
    """The LR multiplier of schedule step ``step`` (see the module docstring)."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown LR schedule {kind!r}; valid: {', '.join(SCHEDULES)}")
    if kind == "constant" or step < warmup:
        # the exact expression SFT always used, so the default SFT run is unchanged
        return min(1.0, (step + 1) / max(1, warmup))
    p = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    if kind == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - p)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup: int, total: int, kind: str, min_ratio: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over :func:`lr_factor` (its state_dict is what checkpoints save)."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown LR schedule {kind!r}; valid: {', '.join(SCHEDULES)}")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup, total, kind, min_ratio)
    )
