"""The bookkeeping of :func:`gyre.trainer.update.policy_update`'s optimizer steps: the step
only a finite gradient may take, and the running sums its metrics are made of."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def finite_step(optimizer: torch.optim.Optimizer, grad_norm: float, loss: float) -> bool:
    """Step only when the loss and the gradient norm are finite; else drop the gradient.

    A NaN/inf would poison the weights and AdamW's moments for good; skipping the update keeps
    the run alive (the loop counts skips and aborts after ``faults.max_nonfinite_streak``).
    """
    if math.isfinite(grad_norm) and math.isfinite(loss):
        optimizer.step()
        return True
    optimizer.zero_grad(set_to_none=True)
    return False


@dataclass
class Tally:
    """Running sums of one :func:`~gyre.trainer.update.policy_update` (token sums become means
    at the end)."""

    sums: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("kl", "clipfrac", "entropy", "logprob_gap"), 0.0)
    )
    grad_norms: list[float] = field(default_factory=list)
    total_tokens: int = 0
    scored_tokens: int = 0  # tokens of the rows actually run (all unless rows are skipped)
    skipped_rows: int = 0
    objective: float = 0.0  # the aggregated loss minimised, summed over optimizer steps
    nonfinite: int = 0  # optimizer steps dropped for a non-finite loss or gradient

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def metrics(self, steps: int, skipping: bool) -> dict[str, float]:
        # token means over the rows run; when every row was skipped nothing was measured, so
        # the means are left out (a 0.0 entropy or KL would be a false reading)
        out = (
            {f"train/{k}": v / self.scored_tokens for k, v in self.sums.items()}
            if self.scored_tokens
            else {}
        )
        if skipping:
            out["train/skipped_rows"] = float(self.skipped_rows)
            out["train/scored_tokens"] = float(self.scored_tokens)
        out["train/loss"] = self.objective / steps
        gn = self.grad_norms
        out["train/grad_norm"] = sum(gn) / len(gn) if gn else float("nan")
        out["train/nonfinite_skipped"] = float(self.nonfinite)
        out["train/tokens"] = float(self.total_tokens)
        out["train/optimizer_steps"] = float(steps)
        return out
