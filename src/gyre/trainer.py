"""Optimizer steps: GRPO (PPO-clip on group-normalised advantages) and SFT.

Normalisation: per-token weights for the whole optimizer step are fixed before the micro-batch
loop (:func:`token_weights`: 1 / step token count for ``token-mean``, 1 / (row length x rows) for
``seq-mean-token-mean``), never per micro-batch. So the gradient of one optimizer step is
identical whatever the micro-batch size (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from gyre.algos import kl_k3, masked_token_sum, ppo_clip_loss
from gyre.policy import TokenBatch, token_logprobs


@dataclass
class GRPOSettings:
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    mini_batches: int = 1
    micro_batch_size: int = 64
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    loss_agg: str = "token-mean"


LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


class Collective(Protocol):
    """What data-parallel training needs from a process group (see :mod:`gyre.distributed`).

    Each rank holds a shard of the step's rows. The loss weights are fixed from *global* counts
    (all-reduced) and the gradients are summed across ranks, so the step equals the one-process
    step on the whole batch.
    """

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor: ...

    def sync_gradients(self, model: torch.nn.Module) -> None: ...


def token_weights(
    loss_mask: torch.Tensor, mode: str, comm: Collective | None = None
) -> torch.Tensor:
    """Weights that turn a per-token loss into the step's loss by a plain weighted sum.

    - ``token-mean``: 1 / (loss tokens in the step) -- every token counts the same (DAPO).
    - ``seq-mean-token-mean``: 1 / (tokens of the row * rows in the step) -- every sequence counts
      the same (the original GRPO). With sparse episode rewards this keeps long failed episodes
      from outweighing short successful ones: the advantages of a group sum to zero, and so do
      their total weights.
    """
    if mode == "token-mean":
        count = loss_mask.sum()
        if comm is not None:  # this rank holds a shard: divide by the step's global count
            count = comm.all_reduce_sum(count)
        return loss_mask / count.clamp(min=1)
    if mode == "seq-mean-token-mean":
        per_row = loss_mask.sum(dim=1, keepdim=True).clamp(min=1)
        rows = torch.tensor(float(loss_mask.shape[0]))
        if comm is not None:
            rows = comm.all_reduce_sum(rows)
        return loss_mask / per_row / rows
    raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(LOSS_AGGREGATIONS)}")


def _micro_slices(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def grpo_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TokenBatch,
    advantages: torch.Tensor,
    settings: GRPOSettings,
    ref_model: torch.nn.Module | None = None,
    generator: torch.Generator | None = None,
    comm: Collective | None = None,
) -> dict[str, float]:
    """One rollout batch -> ``settings.mini_batches`` optimizer steps.

    With ``comm`` (data parallel) this rank's ``batch`` is its shard of the step; every rank must
    hold as many rows so that all ranks take the same number of optimizer steps. The returned
    metrics are this rank's; ``train/loss`` is its share of the global objective.

    The old log-probs are the engine's (the weights that sampled are the weights we start from,
    synced in-process), so the first mini-batch has ratio 1; later mini-batches are off-policy
    and the clip applies.
    """
    if settings.loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(
            f"unknown loss aggregation {settings.loss_agg!r}; valid: {', '.join(LOSS_AGGREGATIONS)}"
        )
    model.train()
    B = batch.input_ids.shape[0]
    perm = torch.randperm(B, generator=generator) if settings.mini_batches > 1 else torch.arange(B)
    minis = [perm[s] for s in _micro_slices(B, -(-B // settings.mini_batches))]
    sums = {"kl": 0.0, "clipfrac": 0.0, "entropy": 0.0, "logprob_gap": 0.0}
    grad_norms = []
    total_tokens = 0
    objective = 0.0  # the aggregated loss that was minimised, summed over mini-batches
    for mini_idx in minis:
        mini = batch.rows(mini_idx)
        adv_mini = advantages[mini_idx]
        step_tokens = max(mini.num_tokens, 1)  # loss tokens of this optimizer step (for metrics)
        total_tokens += step_tokens
        optimizer.zero_grad(set_to_none=True)
        # Per-token weights of the whole optimizer step, fixed before the micro-batch loop.
        weights = token_weights(mini.loss_mask, settings.loss_agg, comm)  # (b, T)
        for sl in _micro_slices(mini.input_ids.shape[0], settings.micro_batch_size):
            mb = mini.rows(sl)
            w = weights[sl, : mb.input_ids.shape[1]]
            adv = adv_mini[sl].unsqueeze(-1)  # (b, 1): one advantage for every token
            logp, ent = token_logprobs(
                model, mb, settings.temperature, settings.top_p, with_entropy=True
            )
            pg, clipped = ppo_clip_loss(logp, mb.rollout_logprobs, adv, settings.clip_eps)
            loss_tok = pg
            if ref_model is not None and settings.kl_coef > 0:
                with torch.no_grad():
                    ref_logp, _ = token_logprobs(
                        ref_model, mb, settings.temperature, settings.top_p
                    )
                kl = kl_k3(logp, ref_logp)
                loss_tok = loss_tok + settings.kl_coef * kl
                sums["kl"] += float(masked_token_sum(kl.detach(), mb.loss_mask))
            loss = masked_token_sum(loss_tok, w)
            loss.backward()
            objective += float(loss.detach())
            sums["clipfrac"] += float(masked_token_sum(clipped.float(), mb.loss_mask))
            assert ent is not None
            sums["entropy"] += float(masked_token_sum(ent, mb.loss_mask))
            gap = (logp.detach() - mb.rollout_logprobs).abs()
            sums["logprob_gap"] += float(masked_token_sum(gap, mb.loss_mask))
        if comm is not None:
            comm.sync_gradients(model)  # sum over ranks, once per optimizer step
        grad_norms.append(
            float(torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm))
        )
        optimizer.step()
    model.eval()
    out = {f"train/{k}": v / max(total_tokens, 1) for k, v in sums.items()}
    out["train/loss"] = objective / len(minis)
    out["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["train/tokens"] = float(total_tokens)
    return out


def sft_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TokenBatch,
    micro_batch_size: int,
    max_grad_norm: float = 1.0,
) -> dict[str, float]:
    """Cross-entropy on the loss-masked (policy) tokens, token-mean over the whole step."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    step_tokens = max(batch.num_tokens, 1)
    total = 0.0
    correct = 0.0
    for sl in _micro_slices(batch.input_ids.shape[0], micro_batch_size):
        mb = batch.rows(sl)
        logp, _ = token_logprobs(model, mb)
        loss = -masked_token_sum(logp, mb.loss_mask) / step_tokens
        loss.backward()
        total += float(loss.detach()) * step_tokens
        # token_acc: the share of target tokens the model gives more than half its probability
        correct += float(masked_token_sum((logp.detach() > -0.6931).float(), mb.loss_mask))
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    optimizer.step()
    model.eval()
    return {
        "sft/loss": total / step_tokens,
        "sft/token_acc": correct / step_tokens,
        "sft/grad_norm": grad_norm,
    }
