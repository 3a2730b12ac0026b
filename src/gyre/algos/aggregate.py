"""Loss aggregation: per-token losses (B, T) -> the optimizer step's scalar loss.

The mode is the choice that tells GRPO, DAPO and Dr. GRPO apart (docs/algorithms.md):

| mode | step loss |
| --- | --- |
| ``token-mean`` | sum_i sum_t l_it / (tokens in the step) |
| ``seq-mean-token-mean`` | (1 / rows) sum_i (sum_t l_it / \\|o_i\\|) |
| ``seq-mean-token-sum`` | (1 / rows) sum_i sum_t l_it |
| ``seq-mean-token-sum-norm`` | sum_i sum_t l_it / (rows * L), L a constant length (Dr. GRPO) |

Every mode is a weighted sum with weights fixed from the **whole step's** counts (all
micro-batches; later all data-parallel ranks), never a micro-batch's own count: a micro-batch's
contribution is ``sum(l * weights)`` and the contributions add up to the step loss, so the
gradient does not depend on how the step is split. :class:`StepCounts` carries the global
denominators; a data-parallel runner would all-reduce it before the micro-batch loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


@dataclass(frozen=True)
class StepCounts:
    """Denominators of one optimizer step, over every micro-batch (and rank).

    ``tokens``: loss tokens; ``rows``: sequences; ``norm_len``: the constant L of
    ``seq-mean-token-sum-norm``.
    """

    tokens: float
    rows: float
    norm_len: float

    @classmethod
    def of(
        cls, loss_mask: torch.Tensor, norm_len: float = 0.0, count_masked_rows: bool = True
    ) -> StepCounts:
        """Counts of a whole step's mask (B, T). ``norm_len`` 0: the step's longest row in loss
        tokens (fixed per step; pass a constant such as the generation budget for Dr. GRPO).
        ``count_masked_rows`` False leaves rows without a loss token out of ``rows`` (verl's
        seq-mean denominators); True counts every row (gyre's default)."""
        per_row = loss_mask.sum(dim=1)
        longest = float(per_row.max().item()) if per_row.numel() else 0.0
        rows = loss_mask.shape[0] if count_masked_rows else int((per_row > 0).sum().item())
        return cls(
            tokens=float(loss_mask.sum().item()),
            rows=float(rows),
            norm_len=float(norm_len) if norm_len > 0 else longest,
        )

    def __add__(self, other: StepCounts) -> StepCounts:
        """Combine two shards' counts (what an all-reduce over ranks computes)."""
        return StepCounts(
            self.tokens + other.tokens, self.rows + other.rows, max(self.norm_len, other.norm_len)
        )


def check_mode(mode: str) -> None:
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(
            f"unknown loss aggregation {mode!r}; valid: {', '.join(LOSS_AGGREGATIONS)}"
        )


def agg_weights(
    loss_mask: torch.Tensor, mode: str, counts: StepCounts | None = None
) -> torch.Tensor:
    """Per-token weights (B, T) so that ``(l * weights).sum()`` is this part's share of the step
    loss. ``loss_mask`` may be any subset of the step's rows; ``counts`` are the whole step's
    (default: this mask is the whole step)."""
    check_mode(mode)
    if counts is None:
        counts = StepCounts.of(loss_mask)
    if mode == "token-mean":
        return loss_mask / max(counts.tokens, 1.0)
    rows = max(counts.rows, 1.0)
    if mode == "seq-mean-token-mean":
        per_row = loss_mask.sum(dim=1, keepdim=True).clamp(min=1)
        return loss_mask / per_row / rows
    if mode == "seq-mean-token-sum":
        return loss_mask / rows
    return loss_mask / (rows * max(counts.norm_len, 1.0))


def aggregate(
    loss: torch.Tensor, loss_mask: torch.Tensor, mode: str, counts: StepCounts | None = None
) -> torch.Tensor:
    """This part's share of the step loss: ``sum(loss * agg_weights(mask, mode, counts))``."""
    return (loss * agg_weights(loss_mask, mode, counts)).sum()
