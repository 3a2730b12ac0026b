"""The policy update of one rollout batch, for every estimator / loss / aggregation mode.

Every function here takes the typed ``train`` config section (:class:`gyre.config.TrainConfig`,
``cfg.train``) itself; what is derived from it (the resolved old-logprob mode, whether rows may
be skipped, the clip ``LossParams``) is a small function of that config. Three steps, called by
the loop in order:

1. :func:`prepare_batch` -- no-grad forwards before any weight changes: the trainer's own
   log-probs of the sampled tokens (the *old* policy of PPO's ratio), the reference policy's
   (KL), and the value model's (GAE). Stored in ``batch.extras``.
2. :func:`~gyre.trainer.advantages.batch_advantages` -- KL-in-reward shaping, then the named
   estimator.
3. :func:`policy_update` -- ``ppo_epochs`` x mini-batches optimizer steps. Per micro-batch: one
   forward, the loss as the sum of the named terms of :mod:`gyre.algos.terms`
   (:func:`gyre.trainer.loss.micro_batch_loss`) aggregated with weights fixed from the whole
   optimizer step's counts, and a backward; per optimizer step: gradient sync, clip, step.

Old log-probs (``train.algo.old_logprobs``): ``recompute`` scores the batch with the trainer
before the first update, so the first ratio is exactly 1 and later ones measure only the
policy's own drift, not the sampler-trainer numerical gap (that gap is corrected separately, by
rollout IS). ``current`` skips that forward when it is provably unnecessary -- exactly one
optimizer step per batch: the old policy *is* the current one, so old = current log-probs,
detached, in the same forward. ``rollout`` uses the engine's log-probs as old. ``auto`` (the
default) picks ``current`` for one step per batch, else ``recompute``.

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

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict, Unpack

import torch

from gyre.algos import (
    StepCounts,
    agg_weights,
    masked_token_sum,
)
from gyre.algos.aggregate import check_mode
from gyre.config import TrainConfig
from gyre.trainer.batch import TokenBatch, consecutive_slices, micro_batches, token_logprobs
from gyre.trainer.critic import ValueModel, policy_forward
from gyre.trainer.loss import TokenTerms, micro_batch_loss
from gyre.trainer.scoring import ScoringOptions

OLD_LOGPROBS = ("auto", "recompute", "current", "rollout")


# -- what the config implies ---------------------------------------------------------------------
def _mini_slices(n: int, train: TrainConfig) -> list[slice]:
    """The optimizer steps of one epoch over ``n`` rows: ``algo.mini_batch_size`` rows each, or
    ``mini_batches`` equal parts when that is 0."""
    rows = train.algo.mini_batch_size
    size = rows if rows > 0 else -(-n // train.mini_batches)
    return consecutive_slices(n, size)


def updates_per_batch(train: TrainConfig, batch_rows: int) -> int:
    """Optimizer steps one rollout batch of ``batch_rows`` rows gets (epochs x mini-batches)."""
    return train.algo.ppo_epochs * len(_mini_slices(batch_rows, train))


def resolve_old_logprobs(train: TrainConfig, batch_rows: int) -> str:
    """``auto`` -> ``current`` when one optimizer step per batch, else ``recompute``."""
    mode = train.algo.old_logprobs
    if mode not in OLD_LOGPROBS:
        raise ValueError(f"unknown old_logprobs {mode!r}; valid: {', '.join(OLD_LOGPROBS)}")
    n = updates_per_batch(train, batch_rows)
    if mode == "auto":
        return "current" if n == 1 else "recompute"
    if mode == "current" and n != 1:
        raise ValueError(
            f"old_logprobs='current' needs exactly one optimizer step per batch, got {n} "
            "(ppo_epochs x mini-batches); use 'recompute'"
        )
    return mode


def kl_in_loss(train: TrainConfig, ref_model: torch.nn.Module | None) -> bool:
    """A KL-to-reference term goes into the loss (not into the reward)."""
    return ref_model is not None and train.kl_coef > 0 and train.algo.kl_in == "loss"


def can_skip_rows(train: TrainConfig, kl_loss: bool, value_model: object | None) -> bool:
    """Zero-advantage rows may be skipped: on, and no loss term that does not scale with A."""
    a = train.algo
    return a.skip_zero_advantage and not kl_loss and a.entropy_coef == 0 and value_model is None


def _nonzero_rows(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(B,) bool: rows with a nonzero advantage on some policy token."""
    if advantages.dim() == 1:
        return advantages != 0
    return ((advantages * loss_mask) != 0).any(dim=1)


# -- 1. before the weights change ----------------------------------------------------------------
@torch.no_grad()
def prepare_batch(
    model: torch.nn.Module,
    batch: TokenBatch,
    train: TrainConfig,
    ref_model: torch.nn.Module | None = None,
    value_model: ValueModel | None = None,
    rows: torch.Tensor | None = None,
    scoring: ScoringOptions | None = None,
) -> dict[str, float]:
    """Fill ``batch.extras`` with what must be scored before the weights change.

    ``scoring``: the trainer's scoring paths (the run's ``perf.*``; default: the defaults).

    ``old_logprobs`` when the resolved mode is ``recompute`` or KL goes into the reward (the
    reward's KL is the old policy's); ``ref_logprobs`` for KL in the reward; ``values`` for GAE.
    Returns metrics (the train-vs-rollout log-prob gap).

    With ``skip_zero_advantage`` and only old log-probs to compute, nothing is done here: the
    advantages are not known yet, so :func:`policy_update` computes them later (same weights)
    for the rows it trains, passing ``rows`` (a (B,) bool mask); other rows keep the engine's.
    """
    mode = resolve_old_logprobs(train, batch.input_ids.shape[0])
    need_ref = ref_model is not None and train.kl_coef > 0 and train.algo.kl_in == "reward"
    need_old = mode == "recompute" or (need_ref and mode == "current")
    if not need_old and not need_ref and value_model is None:
        return {}
    if rows is not None:
        if need_ref or value_model is not None:
            raise ValueError("prepare_batch(rows=...) computes old log-probs only")
        return _old_logprobs_of_rows(model, batch, train, rows, scoring)
    if train.algo.skip_zero_advantage and not need_ref and value_model is None:
        return {}  # deferred to policy_update, which knows which rows train
    ref = ref_model if need_ref else None
    _score_batch(model, batch, train, need_old, ref, value_model, scoring)
    return _rollout_gap(batch)


def _score_batch(
    model: torch.nn.Module,
    batch: TokenBatch,
    train: TrainConfig,
    need_old: bool,
    ref_model: torch.nn.Module | None,
    value_model: ValueModel | None,
    scoring: ScoringOptions | None = None,
) -> None:
    """No-grad micro-batched forwards: old log-probs, reference log-probs, values -> extras."""
    was_training = model.training
    model.eval()
    temperature, top_p = train.sampling.temperature, train.sampling.top_p
    out: dict[str, torch.Tensor] = {}

    def put(key: str, sel: slice | torch.Tensor, value: torch.Tensor) -> None:
        if key not in out:
            out[key] = batch.loss_mask.new_zeros(batch.loss_mask.shape)
        out[key][sel, : value.shape[1]] = value

    for sel in micro_batches(batch, train.micro_batch_size):
        mb = batch.rows(sel)
        if need_old or value_model is not None:
            logp, _, values = policy_forward(
                model, mb, temperature, top_p, value_model=value_model, options=scoring
            )
            if need_old:
                put("old_logprobs", sel, logp)
            if values is not None:
                put("values", sel, values * mb.loss_mask)
        if ref_model is not None:
            ref, _ = token_logprobs(
                ref_model, mb, temperature, top_p, options=scoring, score_mask=mb.loss_mask
            )
            put("ref_logprobs", sel, ref)
    model.train(was_training)
    for key, value in out.items():
        batch.extras[key] = value * batch.loss_mask


def _rollout_gap(batch: TokenBatch) -> dict[str, float]:
    """Mean |old train log-prob - rollout log-prob| over the policy tokens, when recomputed."""
    if "old_logprobs" not in batch.extras:
        return {}
    gap = (batch.extras["old_logprobs"] - batch.rollout_logprobs).abs()
    tokens = max(batch.num_tokens, 1)
    return {"train/rollout_logprob_gap": float(masked_token_sum(gap, batch.loss_mask) / tokens)}


@torch.no_grad()
def _old_logprobs_of_rows(
    model: torch.nn.Module,
    batch: TokenBatch,
    train: TrainConfig,
    rows: torch.Tensor,
    scoring: ScoringOptions | None = None,
) -> dict[str, float]:
    """Recompute the old log-probs of the ``rows`` (B,) bool only; other rows keep the engine's.
    Returns the rows' log-prob gap metric."""
    idx = rows.nonzero().flatten()
    old = batch.rollout_logprobs.detach().clone()
    out: dict[str, float] = {}
    if len(idx):
        sub = batch.rows(idx)
        _score_batch(model, sub, train, True, None, None, scoring)
        out = _rollout_gap(sub)
        width = sub.extras["old_logprobs"].shape[1]
        old[idx, :width] = sub.extras["old_logprobs"]
    batch.extras["old_logprobs"] = old * batch.loss_mask
    return out


# -- 3. the update -------------------------------------------------------------------------------
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
class _Run:
    """What one :func:`policy_update` call keeps fixed over its optimizer steps."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train: TrainConfig
    old_mode: str
    ref_model: torch.nn.Module | None  # set only when KL is a loss term
    value_model: ValueModel | None
    trains: torch.Tensor | None  # (B,) bool rows that train, when zero rows are skipped
    reduce_counts: Callable[[StepCounts], StepCounts] | None
    sync_grads: Callable[[torch.nn.Module], None] | None
    scoring: ScoringOptions | None = None  # the trainer's scoring paths (perf.*)


@dataclass
class _Tally:
    """Running sums of one :func:`policy_update` (token sums become means at the end)."""

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


class UpdateOptions(TypedDict, total=False):
    """:func:`policy_update`'s keyword options."""

    ref_model: torch.nn.Module | None  # the KL reference (with a KL loss)
    generator: torch.Generator | None  # the mini-batch order's random stream
    value_model: ValueModel | None  # GAE's critic, trained on the batch's returns
    reduce_counts: Callable[[StepCounts], StepCounts] | None  # data-parallel: the global counts
    sync_grads: Callable[[torch.nn.Module], None] | None  # data-parallel: sum the gradients
    scoring: ScoringOptions | None  # how log-probs are computed (perf.*)


def policy_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TokenBatch,
    advantages: torch.Tensor,
    train: TrainConfig,
    **options: Unpack[UpdateOptions],
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
    ref_model, value_model = options.get("ref_model"), options.get("value_model")
    scoring = options.get("scoring")
    check_mode(train.loss_agg)
    B = batch.input_ids.shape[0]
    old_mode = resolve_old_logprobs(train, B)
    kl_loss = kl_in_loss(train, ref_model)
    skip = can_skip_rows(train, kl_loss, value_model)
    trains = _nonzero_rows(advantages, batch.loss_mask) if skip else None
    if old_mode == "recompute" and "old_logprobs" not in batch.extras:
        if trains is not None:
            _old_logprobs_of_rows(model, batch, train, trains, scoring)
        else:
            with torch.no_grad():
                _score_batch(model, batch, train, True, None, None, scoring)
    if advantages.dim() == 2:
        batch.extras["advantages"] = advantages
    if value_model is not None and "returns" not in batch.extras:
        raise ValueError("a value model needs value targets: call batch_advantages with 'gae'")
    run = _Run(
        model,
        optimizer,
        train,
        old_mode,
        ref_model if kl_loss else None,
        value_model,
        trains,
        options.get("reduce_counts"),
        options.get("sync_grads"),
        scoring,
    )
    tally = _Tally()
    model.train()
    minis = _mini_batch_rows(B, train, options.get("generator"))
    for mini_idx in minis:
        _optimizer_step(run, tally, batch, mini_idx, advantages)
    model.eval()
    return tally.metrics(len(minis), skipping=trains is not None)


def _mini_batch_rows(
    n: int, train: TrainConfig, generator: torch.Generator | None
) -> list[torch.Tensor]:
    """Row indices of every optimizer step: per epoch a fresh permutation (unless the batch is
    one step of one epoch) cut into mini-batches."""
    slices = _mini_slices(n, train)
    multi = len(slices) > 1 or train.algo.ppo_epochs > 1
    minis: list[torch.Tensor] = []
    for _ in range(train.algo.ppo_epochs):
        perm = torch.randperm(n, generator=generator) if multi else torch.arange(n)
        minis += [perm[s] for s in slices]
    return minis


def _optimizer_step(
    run: _Run, tally: _Tally, batch: TokenBatch, mini_idx: torch.Tensor, advantages: torch.Tensor
) -> None:
    """One optimizer step over the rows ``mini_idx``: micro-batches accumulate the gradient with
    weights from the whole step's counts, then sync, clip and step."""
    objective_before = tally.objective
    mini = batch.rows(mini_idx)
    tally.total_tokens += max(mini.num_tokens, 1)
    run.optimizer.zero_grad(set_to_none=True)
    if run.value_model is not None:
        run.value_model.optimizer.zero_grad(set_to_none=True)
    # Denominators of the whole optimizer step, fixed before the micro-batch loop.
    algo = run.train.algo
    counts = StepCounts.of(mini.loss_mask, algo.loss_norm_len, algo.count_masked_rows)
    if run.reduce_counts is not None:
        counts = run.reduce_counts(counts)
    n_rows = len(mini_idx)
    if run.trains is not None:  # leave out rows that cannot move the weights (counts kept)
        mini_idx = mini_idx[run.trains[mini_idx]]
        tally.skipped_rows += n_rows - len(mini_idx)
        n_rows = len(mini_idx)
        if n_rows:
            mini = batch.rows(mini_idx)
    tally.scored_tokens += mini.num_tokens if n_rows else 0
    adv_mini = advantages[mini_idx] if advantages.dim() == 1 else None
    for sel in micro_batches(mini, run.train.micro_batch_size) if n_rows else []:
        mb = mini.rows(sel)
        adv = adv_mini[sel].unsqueeze(-1) if adv_mini is not None else mb.extras["advantages"]
        _micro_step(run, tally, mb, adv, counts)
    if n_rows == 0:  # every row skipped: the zero gradient AdamW would have seen
        for p in run.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    _clip_and_step(run, tally, tally.objective - objective_before)


def _micro_step(
    run: _Run, tally: _Tally, mb: TokenBatch, adv: torch.Tensor, counts: StepCounts
) -> None:
    """Forward, the sum of the loss terms, weighted aggregation and backward of one micro-batch."""
    train = run.train
    weights = agg_weights(mb.loss_mask, train.loss_agg, counts)  # (b, T)
    logp, ent, values = policy_forward(
        run.model,
        mb,
        train.sampling.temperature,
        train.sampling.top_p,
        entropy="grad" if train.algo.entropy_coef != 0 else "metric",
        value_model=run.value_model,
        options=run.scoring,
    )
    assert ent is not None
    if "old_logprobs" in mb.extras:
        old = mb.extras["old_logprobs"]
    elif run.old_mode == "current":
        old = logp.detach()
    else:
        old = mb.rollout_logprobs
    ref_logp = _ref_logprobs(run, mb) if run.ref_model is not None else None
    terms = TokenTerms(logp, old, adv, ent, ref_logp, values)
    loss, metrics = micro_batch_loss(train, mb, weights, counts.tokens, terms)
    loss.backward()
    tally.objective += float(loss.detach())
    tally.add(metrics)
    tally.add(_drift_metrics(mb, logp.detach(), old, run.old_mode))


@torch.no_grad()
def _ref_logprobs(run: _Run, mb: TokenBatch) -> torch.Tensor:
    """The reference policy's log-probs of the micro-batch (prepared ones when present)."""
    if "ref_logprobs" in mb.extras:
        return mb.extras["ref_logprobs"]
    assert run.ref_model is not None
    s = run.train.sampling
    ref, _ = token_logprobs(
        run.ref_model, mb, s.temperature, s.top_p, options=run.scoring, score_mask=mb.loss_mask
    )
    return ref


def _drift_metrics(
    mb: TokenBatch, logp: torch.Tensor, old: torch.Tensor, old_mode: str
) -> dict[str, torch.Tensor]:
    """Token sums of |current - rollout| and, unless old is the engine's, of old - current
    (``ppo_kl``) and |old - rollout|."""
    mask = mb.loss_mask
    out = {"logprob_gap": masked_token_sum((logp - mb.rollout_logprobs).abs(), mask)}
    if old_mode != "rollout":
        out["ppo_kl"] = masked_token_sum(old - logp, mask)
        out["rollout_logprob_gap"] = masked_token_sum((old - mb.rollout_logprobs).abs(), mask)
    return out


def _clip_and_step(run: _Run, tally: _Tally, step_loss: float) -> None:
    """Sum the gradients over ranks, clip, and step the policy (and the value model) when the
    loss and the gradient norm are finite."""
    if run.sync_grads is not None:
        run.sync_grads(run.model)
    max_norm = run.train.max_grad_norm
    gn = float(torch.nn.utils.clip_grad_norm_(run.model.parameters(), max_norm))
    if finite_step(run.optimizer, gn, step_loss):
        tally.grad_norms.append(gn)
    else:
        tally.nonfinite += 1
    if run.value_model is not None:
        own = [p for p in run.value_model.parameters() if p.grad is not None]
        vgn = float(torch.nn.utils.clip_grad_norm_(own, max_norm))
        finite_step(run.value_model.optimizer, vgn, 0.0)


def __getattr__(name: str) -> object:
    """Step 2 moved to :mod:`gyre.trainer.advantages`; its names are kept here one version."""
    if name not in ("batch_advantages", "advantage_settings"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings

    from gyre.trainer.advantages import advantage_settings, batch_advantages

    warnings.warn(
        f"gyre.trainer.update.{name} moved to gyre.trainer.advantages.{name}",
        DeprecationWarning,
        stacklevel=2,
    )
    return {"batch_advantages": batch_advantages, "advantage_settings": advantage_settings}[name]
