"""Data-parallel ranks that run their collectives in step, whatever their share of rows.

The Ray runner gives each trainer rank an equal share of whole *groups*, but a group's rows are
not a fixed number: a multi-turn episode expands into one row per turn, so two ranks can hold
different numbers of rows, hence of mini-batches (``algo.mini_batch_size``) and micro-batches
(``micro_batch_size``). A collective waits for every rank, so a rank that has run out of work
while another still calls one deadlocks the group:

- under DDP (gyre's summed gradients) the collectives are once per optimizer step: the global
  counts and the gradient sum, so every rank must run the same number of optimizer steps;
- under FSDP2 every forward (an all-gather of the sharded weights) and every backward (a
  reduce-scatter of the gradients) is a collective too, so every rank must also run the same
  number of micro-batches per optimizer step and of no-grad scoring forwards per batch.

:class:`Lockstep` brings a rank up to the most any rank has: an all-reduce (max) of each count,
then the missing work as *zero-weight* micro-batches: a forward and backward of one of the rank's
rows whose loss is multiplied by 0, so the collectives are joined and the gradient (a sum over
ranks and micro-batches) is unchanged. A rank with fewer optimizer steps runs empty steps: its
counts are zero (the step's global counts come from the others) and, under DDP, one zero-weight
micro-batch gives every parameter a gradient for the sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gyre.trainer.batch import TokenBatch


@dataclass(frozen=True)
class Lockstep:
    """What a data-parallel rank must keep in step with the others.

    ``most(n)``: the largest ``n`` over the ranks (every rank calls it with its own count).
    ``forwards``: every forward and backward is a collective (FSDP2), so micro-batches and scoring
    forwards are padded too, not only optimizer steps.
    """

    most: Callable[[int], int]
    forwards: bool = False

    def extra_forwards(self, done: int) -> int:
        """Zero-weight forwards this rank adds after ``done`` real ones (0 unless ``forwards``)."""
        return self.most(done) - done if self.forwards else 0


def padding_rows(batch: TokenBatch) -> slice:
    """The row a zero-weight micro-batch runs: the one with the most loss tokens, so its
    forward really runs (a micro-batch with nothing to score skips the forward, and with it
    the collectives)."""
    i = int(batch.loss_mask.sum(dim=1).argmax())
    return slice(i, i + 1)


def padding_row(batch: TokenBatch, advantages: torch.Tensor) -> tuple[TokenBatch, torch.Tensor]:
    """:func:`padding_rows` and its advantage, in the shape a micro-step takes."""
    rows = padding_rows(batch)
    mb = batch.rows(rows)
    adv = advantages[rows].unsqueeze(-1) if advantages.dim() == 1 else mb.extras["advantages"]
    return mb, adv
