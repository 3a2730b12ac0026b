"""The policy update of one rollout batch, for every estimator / loss / aggregation mode.

Three steps, called by the loop in order:

1. :func:`prepare_batch` -- no-grad forwards before any weight changes: the trainer's own
   log-probs of the sampled tokens (the *old* policy of PPO's ratio), the reference policy's
   (KL), and the value model's (GAE). Stored in ``batch.extras``.
2. :func:`batch_advantages` -- KL-in-reward shaping, then the named estimator.
3. :func:`policy_update` -- ``ppo_epochs`` x mini-batches optimizer steps, each accumulated
   over micro-batches with weights fixed from the whole optimizer step's counts.

Old log-probs (``old_logprobs`` setting): ``recompute`` scores the batch with the trainer before
the first update, so the first ratio is exactly 1 and later ones measure only the policy's own
drift, not the sampler-trainer numerical gap (that gap is corrected separately, by rollout IS).
``current`` skips that forward when it is provably unnecessary -- exactly one optimizer step per
batch: the old policy *is* the current one, so old = current log-probs, detached, in the same
forward. ``rollout`` uses the engine's log-probs as old (the behaviour before this module).
``auto`` (the loop's default) picks ``current`` for one step per batch, else ``recompute``.

Zero-advantage rows (``skip_zero_advantage``): a row whose advantage is 0 at every token (a
GRPO group whose rewards are all equal) contributes exactly 0 to every policy loss here (each is
linear in A) and so nothing to the gradient, as long as no term without A is in the loss (KL in
the loss, an entropy bonus, a value loss). With the setting on, such rows are left out of the
forward, the backward and the old-logprob recompute, while the loss weights keep the counts of
the *whole* optimizer step; so the gradient is the same (up to float summation order) and the
trainer does only the work that moves the weights. An optimizer step whose rows are all skipped
still steps AdamW with a zero gradient, as it would without skipping (its moments decay).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gyre.algos import (
    TOKEN_LEVEL,
    LossParams,
    StepCounts,
    agg_weights,
    compute_advantages,
    get_kl_fn,
    get_policy_loss_fn,
    masked_token_sum,
    rollout_is_weights,
)
from gyre.algos.aggregate import check_mode
from gyre.config import TrainConfig
from gyre.trainer.batch import TokenBatch, token_logprobs
from gyre.trainer.critic import ValueModel, policy_forward

OLD_LOGPROBS = ("auto", "recompute", "current", "rollout")


@dataclass
class GRPOSettings:
    """Everything the update needs; defaults are the original GRPO update (engine log-probs as
    old, PPO-clip 0.2, token-mean, no KL)."""

    clip_eps: float = 0.2
    kl_coef: float = 0.0
    mini_batches: int = 1
    micro_batch_size: int = 64
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    loss_agg: str = "token-mean"
    policy_loss: str = "ppo_clip"
    clip_eps_high: float | None = None  # None: = clip_eps (symmetric)
    dual_clip: float | None = None
    kl_type: str = "k3"
    kl_in: str = "loss"  # "loss": a KL term in the loss; "reward": shaped into the reward
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # rows per optimizer step; 0: split into ``mini_batches``
    loss_norm_len: float = 0.0  # L of seq-mean-token-sum-norm; 0: the step's longest row
    old_logprobs: str = "rollout"
    skip_zero_advantage: bool = False
    rollout_is: str = "none"  # none | truncate | mask
    rollout_is_level: str = "token"
    rollout_is_threshold: float = 2.0
    rollout_is_threshold_lower: float = 0.0
    vf_coef: float = 0.5
    value_clip: float = 0.2
    count_masked_rows: bool = True  # seq-mean-* row denominators count all-masked rows

    def loss_params(self) -> LossParams:
        return LossParams(self.clip_eps, self.clip_eps_high, self.dual_clip)

    def updates_per_batch(self, batch_rows: int) -> int:
        return self.ppo_epochs * len(_mini_slices(batch_rows, self))

    def resolve_old_logprobs(self, batch_rows: int) -> str:
        """``auto`` -> ``current`` when one optimizer step per batch, else ``recompute``."""
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(
                f"unknown old_logprobs {self.old_logprobs!r}; valid: {', '.join(OLD_LOGPROBS)}"
            )
        n = self.updates_per_batch(batch_rows)
        if self.old_logprobs == "auto":
            return "current" if n == 1 else "recompute"
        if self.old_logprobs == "current" and n != 1:
            raise ValueError(
                f"old_logprobs='current' needs exactly one optimizer step per batch, got {n} "
                "(ppo_epochs x mini-batches); use 'recompute'"
            )
        return self.old_logprobs

    def can_skip_rows(self, kl_in_loss: bool, value_model: object | None) -> bool:
        """Zero-advantage rows may be skipped: on, and no loss term that does not scale with A."""
        return (
            self.skip_zero_advantage
            and not kl_in_loss
            and self.entropy_coef == 0
            and value_model is None
        )


def _nonzero_rows(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(B,) bool: rows with a nonzero advantage on some policy token."""
    if advantages.dim() == 1:
        return advantages != 0
    return ((advantages * loss_mask) != 0).any(dim=1)


def _micro_slices(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _mini_slices(n: int, s: GRPOSettings) -> list[slice]:
    size = s.mini_batch_size if s.mini_batch_size > 0 else -(-n // s.mini_batches)
    return _micro_slices(n, size)


@torch.no_grad()
def prepare_batch(
    model: torch.nn.Module,
    batch: TokenBatch,
    settings: GRPOSettings,
    ref_model: torch.nn.Module | None = None,
    value_model: ValueModel | None = None,
    rows: torch.Tensor | None = None,
) -> dict[str, float]:
    """Fill ``batch.extras`` with what must be scored before the weights change.

    ``old_logprobs`` when the resolved mode is ``recompute`` or KL goes into the reward (the
    reward's KL is the old policy's); ``ref_logprobs`` for KL in the reward; ``values`` for GAE.
    Returns metrics (the train-vs-rollout log-prob gap).

    With ``skip_zero_advantage`` and only old log-probs to compute, nothing is done here: the
    advantages are not known yet, so :func:`policy_update` computes them later (same weights)
    for the rows it trains, passing ``rows`` (a (B,) bool mask); other rows keep the engine's.
    """
    mode = settings.resolve_old_logprobs(batch.input_ids.shape[0])
    need_ref = ref_model is not None and settings.kl_coef > 0 and settings.kl_in == "reward"
    need_old = mode == "recompute" or (need_ref and mode == "current")
    if not need_old and not need_ref and value_model is None:
        return {}
    if settings.skip_zero_advantage and not need_ref and value_model is None and rows is None:
        return {}  # deferred to policy_update, which knows which rows train
    if rows is not None:
        if need_ref or value_model is not None:
            raise ValueError("prepare_batch(rows=...) computes old log-probs only")
        idx = rows.nonzero().flatten()
        sub = batch.rows(idx)
        whole = dataclasses.replace(settings, skip_zero_advantage=False)
        out = prepare_batch(model, sub, whole) if len(idx) else {}
        old = batch.rollout_logprobs.detach().clone()
        if len(idx):
            width = sub.extras["old_logprobs"].shape[1]
            old[idx, :width] = sub.extras["old_logprobs"]
        batch.extras["old_logprobs"] = old * batch.loss_mask
        return out
    was_training = model.training
    model.eval()
    parts: dict[str, list[torch.Tensor]] = {"old_logprobs": [], "ref_logprobs": [], "values": []}
    B, T = batch.input_ids.shape
    for sl in _micro_slices(B, settings.micro_batch_size):
        mb = batch.rows(sl)
        pad = T - mb.input_ids.shape[1]
        if need_old or value_model is not None:
            logp, _, values = policy_forward(
                model, mb, settings.temperature, settings.top_p, value_model=value_model
            )
            if need_old:
                parts["old_logprobs"].append(torch.nn.functional.pad(logp, (0, pad)))
            if values is not None:
                parts["values"].append(torch.nn.functional.pad(values * mb.loss_mask, (0, pad)))
        if need_ref:
            assert ref_model is not None
            ref, _ = token_logprobs(
                ref_model, mb, settings.temperature, settings.top_p, score_mask=mb.loss_mask
            )
            parts["ref_logprobs"].append(torch.nn.functional.pad(ref, (0, pad)))
    model.train(was_training)
    for key, chunks in parts.items():
        if chunks:
            batch.extras[key] = torch.cat(chunks) * batch.loss_mask
    out: dict[str, float] = {}
    if "old_logprobs" in batch.extras:
        gap = (batch.extras["old_logprobs"] - batch.rollout_logprobs).abs()
        out["train/rollout_logprob_gap"] = float(
            masked_token_sum(gap, batch.loss_mask) / max(batch.num_tokens, 1)
        )
    return out


def batch_advantages(
    name: str,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    batch: TokenBatch,
    settings: GRPOSettings,
    *,
    eps: float = 1e-6,
    gamma: float = 1.0,
    lam: float = 1.0,
    **estimator: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages (B,) or (B, T) for ``batch``; value targets land in ``batch.extras``.
    ``estimator``: further keywords of :func:`gyre.algos.compute_advantages` (``turns``, ...).

    KL in the reward (``kl_in == 'reward'``, needs ``ref_logprobs`` from :func:`prepare_batch`):
    token estimators get -kl_coef * KL_t per policy token; outcome estimators get the reward
    minus kl_coef * sum_t KL_t (the sequence's KL).
    """
    metrics: dict[str, float] = {}
    token_rewards = None
    mask = batch.loss_mask
    rewards = rewards.float().to(mask.device)
    if settings.kl_in == "reward" and "ref_logprobs" in batch.extras:
        old = batch.extras.get("old_logprobs", batch.rollout_logprobs)
        kl = get_kl_fn(settings.kl_type)(old, batch.extras["ref_logprobs"]) * mask  # (B, T)
        metrics["train/kl"] = float(kl.sum() / mask.sum().clamp(min=1))
        if name in TOKEN_LEVEL:
            token_rewards = -settings.kl_coef * kl
        else:
            rewards = rewards - settings.kl_coef * kl.sum(dim=1)
    adv, returns = compute_advantages(
        name,
        rewards.cpu() if name not in TOKEN_LEVEL else rewards,
        group_ids,
        loss_mask=mask,
        token_rewards=token_rewards,
        values=batch.extras.get("values"),
        eps=eps,
        gamma=gamma,
        lam=lam,
        **estimator,
    )
    if returns is not None:
        batch.extras["returns"] = returns
    return adv.to(mask.device), metrics


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


def policy_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TokenBatch,
    advantages: torch.Tensor,
    settings: GRPOSettings,
    ref_model: torch.nn.Module | None = None,
    generator: torch.Generator | None = None,
    value_model: ValueModel | None = None,
    reduce_counts: Callable[[StepCounts], StepCounts] | None = None,
    sync_grads: Callable[[torch.nn.Module], None] | None = None,
) -> dict[str, float]:
    """One rollout batch -> ``ppo_epochs`` x mini-batches optimizer steps.

    ``advantages`` is (B,) (one per sequence) or (B, T) (per token). Old log-probs: the batch's
    ``extras['old_logprobs']`` if :func:`prepare_batch` recomputed them, else the current
    detached log-probs (``current``) or the engine's (``rollout``). Each optimizer step's loss is
    ``sum over its tokens of l * w`` with w from :func:`gyre.algos.agg_weights` and the step's
    :class:`StepCounts`, accumulated over micro-batches. ``reduce_counts`` turns this process's
    counts into the global ones before the micro-batch loop: a data-parallel runner passes an
    all-reduce (sum) over ranks, so every rank divides by the same global denominators, and
    ``sync_grads`` that sums the gradients over ranks once per optimizer step, before clipping.
    """
    check_mode(settings.loss_agg)
    loss_fn = get_policy_loss_fn(settings.policy_loss)
    kl_fn = get_kl_fn(settings.kl_type)
    params = settings.loss_params()
    B = batch.input_ids.shape[0]
    old_mode = settings.resolve_old_logprobs(B)
    kl_in_loss = ref_model is not None and settings.kl_coef > 0 and settings.kl_in == "loss"
    skip = settings.can_skip_rows(kl_in_loss, value_model)
    trains = _nonzero_rows(advantages, batch.loss_mask) if skip else None
    if old_mode == "recompute" and "old_logprobs" not in batch.extras:
        prepare_batch(model, batch, settings, value_model=None, rows=trains)
    if advantages.dim() == 2:
        batch.extras["advantages"] = advantages
    if value_model is not None and "returns" not in batch.extras:
        raise ValueError("a value model needs value targets: call batch_advantages with 'gae'")
    model.train()
    minis: list[torch.Tensor] = []
    for _ in range(settings.ppo_epochs):
        multi = len(_mini_slices(B, settings)) > 1 or settings.ppo_epochs > 1
        perm = torch.randperm(B, generator=generator) if multi else torch.arange(B)
        minis += [perm[s] for s in _mini_slices(B, settings)]
    sums = {"kl": 0.0, "clipfrac": 0.0, "entropy": 0.0, "logprob_gap": 0.0}
    extra_sums: dict[str, float] = {}
    grad_norms = []
    total_tokens = 0
    scored_tokens = 0  # tokens of the rows actually run (all of them unless rows are skipped)
    skipped_rows = 0
    objective = 0.0  # the aggregated loss that was minimised, summed over optimizer steps
    skipped = 0  # optimizer steps dropped for a non-finite loss or gradient
    for mini_idx in minis:
        objective_before = objective
        mini = batch.rows(mini_idx)
        step_tokens = max(mini.num_tokens, 1)  # loss tokens of this optimizer step (for metrics)
        total_tokens += step_tokens
        optimizer.zero_grad(set_to_none=True)
        if value_model is not None:
            value_model.optimizer.zero_grad(set_to_none=True)
        # Denominators of the whole optimizer step, fixed before the micro-batch loop.
        counts = StepCounts.of(mini.loss_mask, settings.loss_norm_len, settings.count_masked_rows)
        if reduce_counts is not None:
            counts = reduce_counts(counts)
        n_rows = len(mini_idx)
        if trains is not None:  # leave out rows that cannot move the weights (counts kept)
            mini_idx = mini_idx[trains[mini_idx]]
            skipped_rows += n_rows - len(mini_idx)
            n_rows = len(mini_idx)
            if n_rows:
                mini = batch.rows(mini_idx)
        scored_tokens += mini.num_tokens if n_rows else 0
        adv_mini = advantages[mini_idx] if advantages.dim() == 1 else None
        for sl in _micro_slices(n_rows, settings.micro_batch_size):
            mb = mini.rows(sl)
            w = agg_weights(mb.loss_mask, settings.loss_agg, counts)  # (b, T)
            adv = adv_mini[sl].unsqueeze(-1) if adv_mini is not None else mb.extras["advantages"]
            logp, ent, values = policy_forward(
                model,
                mb,
                settings.temperature,
                settings.top_p,
                with_entropy=True,
                entropy_grad=settings.entropy_coef != 0,
                value_model=value_model,
            )
            if "old_logprobs" in mb.extras:
                old = mb.extras["old_logprobs"]
            elif old_mode == "current":
                old = logp.detach()
            else:
                old = mb.rollout_logprobs
            pg, clipped = loss_fn(logp, old, adv, mb.loss_mask, params)
            if settings.rollout_is != "none":
                is_w, affected = rollout_is_weights(
                    old.detach(),
                    mb.rollout_logprobs,
                    mb.loss_mask,
                    settings.rollout_is,
                    settings.rollout_is_level,
                    settings.rollout_is_threshold,
                    settings.rollout_is_threshold_lower,
                )
                pg = pg * is_w
                _acc(extra_sums, "is_weight", masked_token_sum(is_w, mb.loss_mask))
                _acc(extra_sums, "is_affected_frac", masked_token_sum(affected, mb.loss_mask))
            loss_tok = pg
            if kl_in_loss:
                assert ref_model is not None
                if "ref_logprobs" in mb.extras:
                    ref_logp = mb.extras["ref_logprobs"]
                else:
                    with torch.no_grad():
                        ref_logp, _ = token_logprobs(
                            ref_model,
                            mb,
                            settings.temperature,
                            settings.top_p,
                            score_mask=mb.loss_mask,
                        )
                kl = kl_fn(logp, ref_logp)
                loss_tok = loss_tok + settings.kl_coef * kl
                sums["kl"] += float(masked_token_sum(kl.detach(), mb.loss_mask))
            assert ent is not None
            if settings.entropy_coef != 0:
                loss_tok = loss_tok - settings.entropy_coef * ent
            loss = masked_token_sum(loss_tok, w)
            if value_model is not None:
                assert values is not None
                vl, vclip = clipped_value_loss(
                    values, mb.extras["values"], mb.extras["returns"], settings.value_clip
                )
                # The value loss is a per-token mean over the step, whatever loss_agg says.
                v_loss = masked_token_sum(vl, mb.loss_mask) / max(counts.tokens, 1.0)
                loss = loss + settings.vf_coef * v_loss
                _acc(extra_sums, "value_loss", masked_token_sum(vl.detach(), mb.loss_mask))
                _acc(extra_sums, "vf_clipfrac", masked_token_sum(vclip, mb.loss_mask))
            loss.backward()
            objective += float(loss.detach())
            sums["clipfrac"] += float(masked_token_sum(clipped.float(), mb.loss_mask))
            sums["entropy"] += float(masked_token_sum(ent.detach(), mb.loss_mask))
            gap = (logp.detach() - mb.rollout_logprobs).abs()
            sums["logprob_gap"] += float(masked_token_sum(gap, mb.loss_mask))
            if old_mode != "rollout":
                ppo_kl = old - logp.detach()
                _acc(extra_sums, "ppo_kl", masked_token_sum(ppo_kl, mb.loss_mask))
                _acc(
                    extra_sums,
                    "rollout_logprob_gap",
                    masked_token_sum((old - mb.rollout_logprobs).abs(), mb.loss_mask),
                )
        if n_rows == 0:  # every row skipped: the zero gradient AdamW would have seen
            for p in model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        if sync_grads is not None:
            sync_grads(model)
        gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm))
        if finite_step(optimizer, gn, objective - objective_before):
            grad_norms.append(gn)
        else:
            skipped += 1
        if value_model is not None:
            own = [p for p in value_model.parameters() if p.grad is not None]
            vgn = float(torch.nn.utils.clip_grad_norm_(own, settings.max_grad_norm))
            finite_step(value_model.optimizer, vgn, 0.0)
    model.eval()
    out = {f"train/{k}": v / max(scored_tokens, 1) for k, v in sums.items()}
    out.update({f"train/{k}": v / max(scored_tokens, 1) for k, v in extra_sums.items()})
    if trains is not None:
        out["train/skipped_rows"] = float(skipped_rows)
    out["train/loss"] = objective / len(minis)
    out["train/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    out["train/nonfinite_skipped"] = float(skipped)
    out["train/tokens"] = float(total_tokens)
    out["train/optimizer_steps"] = float(len(minis))
    return out


def _acc(sums: dict[str, float], key: str, value: torch.Tensor) -> None:
    sums[key] = sums.get(key, 0.0) + float(value)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token: 0.5 max((V - R)^2, (V_old + clip(V - V_old) - R)^2).

    Returns (loss (B, T), clipped (B, T) bool: where the clipped branch was the larger).
    """
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    a = (values - returns) ** 2
    b = (v_clipped - returns) ** 2
    return 0.5 * torch.maximum(a, b), b > a


def settings_from_config(train: TrainConfig) -> GRPOSettings:
    """The update settings of a ``train`` config section (``train.*`` and ``train.algo.*``)."""
    a = train.algo
    return GRPOSettings(
        clip_eps=train.clip_eps,
        kl_coef=train.kl_coef,
        mini_batches=train.mini_batches,
        micro_batch_size=train.micro_batch_size,
        max_grad_norm=train.max_grad_norm,
        temperature=train.sampling.temperature,
        top_p=train.sampling.top_p,
        loss_agg=train.loss_agg,
        policy_loss=a.policy_loss,
        clip_eps_high=a.clip_eps_high,
        dual_clip=a.dual_clip,
        kl_type=a.kl_type,
        kl_in=a.kl_in,
        entropy_coef=a.entropy_coef,
        ppo_epochs=a.ppo_epochs,
        mini_batch_size=a.mini_batch_size,
        loss_norm_len=float(a.loss_norm_len),
        old_logprobs=a.old_logprobs,
        skip_zero_advantage=a.skip_zero_advantage,
        rollout_is=a.rollout_is,
        rollout_is_level=a.rollout_is_level,
        rollout_is_threshold=a.rollout_is_threshold,
        rollout_is_threshold_lower=a.rollout_is_threshold_lower,
        vf_coef=a.vf_coef,
        value_clip=a.value_clip,
        count_masked_rows=a.count_masked_rows,
    )
