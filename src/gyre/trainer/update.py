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

from collections.abc import Callable
from dataclasses import dataclass
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
from gyre.trainer.lockstep import Lockstep, padding_row, padding_rows
from gyre.trainer.loss import TokenTerms, micro_batch_loss
from gyre.trainer.scoring import ScoringOptions
from gyre.trainer.tally import Tally, finite_step

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
    return _old_mode(train, updates_per_batch(train, batch_rows))


def _steps_per_epoch(n: int, train: TrainConfig, lockstep: Lockstep | None) -> int:
    """Optimizer steps per epoch over ``n`` rows; data-parallel: the most of any rank's."""
    steps = len(_mini_slices(n, train))
    return lockstep.most(steps) if lockstep is not None else steps


def _old_mode(train: TrainConfig, n: int) -> str:
    """The old-logprob mode of a batch that gets ``n`` optimizer steps."""
    mode = train.algo.old_logprobs
    if mode not in OLD_LOGPROBS:
        raise ValueError(f"unknown old_logprobs {mode!r}; valid: {', '.join(OLD_LOGPROBS)}")
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
class PrepareOptions(TypedDict, total=False):
    """:func:`prepare_batch`'s keyword options."""

    rows: torch.Tensor | None  # (B,) bool: recompute the old log-probs of these rows only
    scoring: ScoringOptions | None  # the trainer's scoring paths (perf.*)
    lockstep: Lockstep | None  # data-parallel: ranks keep their collectives in step


@dataclass(frozen=True)
class _Score:
    """What one no-grad scoring pass computes, and how."""

    need_old: bool
    ref_model: torch.nn.Module | None = None
    value_model: ValueModel | None = None
    scoring: ScoringOptions | None = None
    lockstep: Lockstep | None = None


@torch.no_grad()
def prepare_batch(
    model: torch.nn.Module,
    batch: TokenBatch,
    train: TrainConfig,
    ref_model: torch.nn.Module | None = None,
    value_model: ValueModel | None = None,
    **options: Unpack[PrepareOptions],
) -> dict[str, float]:
    """Fill ``batch.extras`` with what must be scored before the weights change.

    ``scoring``: the trainer's scoring paths (the run's ``perf.*``; default: the defaults).
    ``lockstep``: data-parallel ranks resolve the old-logprob mode from the most optimizer
    steps of any rank and, under FSDP2, run as many scoring forwards (:mod:`gyre.trainer.lockstep`).

    ``old_logprobs`` when the resolved mode is ``recompute`` or KL goes into the reward (the
    reward's KL is the old policy's); ``ref_logprobs`` for KL in the reward; ``values`` for GAE.
    Returns metrics (the train-vs-rollout log-prob gap).

    With ``skip_zero_advantage`` and only old log-probs to compute, nothing is done here: the
    advantages are not known yet, so :func:`policy_update` computes them later (same weights)
    for the rows it trains, passing ``rows`` (a (B,) bool mask); other rows keep the engine's.
    """
    rows, scoring, lockstep = options.get("rows"), options.get("scoring"), options.get("lockstep")
    steps = train.algo.ppo_epochs * _steps_per_epoch(batch.input_ids.shape[0], train, lockstep)
    mode = _old_mode(train, steps)
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
    _score_batch(model, batch, train, _Score(need_old, ref, value_model, scoring, lockstep))
    return _rollout_gap(batch)


def _score_batch(
    model: torch.nn.Module, batch: TokenBatch, train: TrainConfig, what: _Score
) -> None:
    """No-grad micro-batched forwards: old log-probs, reference log-probs, values -> extras.
    Under a lockstep with ``forwards``, forwards of one row follow, up to the most micro-batches
    of any rank (their results are dropped)."""
    was_training = model.training
    model.eval()
    temperature, top_p = train.sampling.temperature, train.sampling.top_p
    out: dict[str, torch.Tensor] = {}

    def put(key: str, sel: slice | torch.Tensor, value: torch.Tensor) -> None:
        if key not in out:
            out[key] = batch.loss_mask.new_zeros(batch.loss_mask.shape)
        out[key][sel, : value.shape[1]] = value

    def score(mb: TokenBatch) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        if what.need_old or what.value_model is not None:
            logp, _, values = policy_forward(
                model, mb, temperature, top_p, value_model=what.value_model, options=what.scoring
            )
            if what.need_old:
                got["old_logprobs"] = logp
            if values is not None:
                got["values"] = values * mb.loss_mask
        if what.ref_model is not None:
            opts = what.scoring
            ref, _ = token_logprobs(
                what.ref_model, mb, temperature, top_p, options=opts, score_mask=mb.loss_mask
            )
            got["ref_logprobs"] = ref
        return got

    micro = micro_batches(batch, train.micro_batch_size)
    # agreed before any forward: under FSDP2 each forward is itself a collective
    pads = what.lockstep.extra_forwards(len(micro)) if what.lockstep else 0
    for sel in micro:
        for key, value in score(batch.rows(sel)).items():
            put(key, sel, value)
    for _ in range(pads):
        score(batch.rows(padding_rows(batch)))
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
        _score_batch(model, sub, train, _Score(True, scoring=scoring))
        out = _rollout_gap(sub)
        width = sub.extras["old_logprobs"].shape[1]
        old[idx, :width] = sub.extras["old_logprobs"]
    batch.extras["old_logprobs"] = old * batch.loss_mask
    return out


# -- 3. the update -------------------------------------------------------------------------------
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
    lockstep: Lockstep | None = None  # data-parallel: pad to the ranks' most steps / forwards


class UpdateOptions(TypedDict, total=False):
    """:func:`policy_update`'s keyword options."""

    ref_model: torch.nn.Module | None  # the KL reference (with a KL loss)
    generator: torch.Generator | None  # the mini-batch order's random stream
    value_model: ValueModel | None  # GAE's critic, trained on the batch's returns
    reduce_counts: Callable[[StepCounts], StepCounts] | None  # data-parallel: the global counts
    sync_grads: Callable[[torch.nn.Module], None] | None  # data-parallel: sum the gradients
    scoring: ScoringOptions | None  # how log-probs are computed (perf.*)
    lockstep: Lockstep | None  # data-parallel: every rank runs the same steps (and FSDP2 forwards)


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
    ``lockstep`` pads this rank to the most optimizer steps (and, under FSDP2, micro-batches) of
    any rank with zero-weight work, so no collective waits on a rank that has finished.
    """
    ref_model, value_model = options.get("ref_model"), options.get("value_model")
    scoring, lockstep = options.get("scoring"), options.get("lockstep")
    check_mode(train.loss_agg)
    B = batch.input_ids.shape[0]
    per_epoch = _steps_per_epoch(B, train, lockstep)
    old_mode = _old_mode(train, train.algo.ppo_epochs * per_epoch)
    kl_loss = kl_in_loss(train, ref_model)
    skip = can_skip_rows(train, kl_loss, value_model)
    trains = _nonzero_rows(advantages, batch.loss_mask) if skip else None
    if old_mode == "recompute" and "old_logprobs" not in batch.extras:
        if trains is not None:
            _old_logprobs_of_rows(model, batch, train, trains, scoring)
        else:
            with torch.no_grad():
                _score_batch(model, batch, train, _Score(True, scoring=scoring, lockstep=lockstep))
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
        lockstep,
    )
    tally = Tally()
    model.train()
    minis = _mini_batch_rows(B, train, options.get("generator"), per_epoch)
    for mini_idx in minis:
        _optimizer_step(run, tally, batch, mini_idx, advantages)
    model.eval()
    return tally.metrics(len(minis), skipping=trains is not None)


def _mini_batch_rows(
    n: int, train: TrainConfig, generator: torch.Generator | None, per_epoch: int
) -> list[torch.Tensor]:
    """Row indices of every optimizer step: per epoch a fresh permutation (unless the batch is
    one step of one epoch) cut into mini-batches, then empty steps up to ``per_epoch`` (the
    most of any data-parallel rank)."""
    slices = _mini_slices(n, train)
    multi = len(slices) > 1 or train.algo.ppo_epochs > 1
    empty = torch.zeros(0, dtype=torch.long)
    minis: list[torch.Tensor] = []
    for _ in range(train.algo.ppo_epochs):
        perm = torch.randperm(n, generator=generator) if multi else torch.arange(n)
        minis += [perm[s] for s in slices] + [empty] * (per_epoch - len(slices))
    return minis


def _optimizer_step(
    run: _Run, tally: Tally, batch: TokenBatch, mini_idx: torch.Tensor, advantages: torch.Tensor
) -> None:
    """One optimizer step over the rows ``mini_idx``: micro-batches accumulate the gradient with
    weights from the whole step's counts, then sync, clip and step."""
    objective_before = tally.objective
    padded = len(mini_idx) == 0  # a step this rank has no rows for (data-parallel lockstep)
    mini = batch.rows(mini_idx) if not padded else batch
    mask = mini.loss_mask if not padded else batch.loss_mask[:0]
    tally.total_tokens += max(mini.num_tokens, 1) if not padded else 0
    run.optimizer.zero_grad(set_to_none=True)
    if run.value_model is not None:
        run.value_model.optimizer.zero_grad(set_to_none=True)
    # Denominators of the whole optimizer step, fixed before the micro-batch loop.
    algo = run.train.algo
    counts = StepCounts.of(mask, algo.loss_norm_len, algo.count_masked_rows)
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
    micro = micro_batches(mini, run.train.micro_batch_size) if n_rows else []
    # agreed before any forward: under FSDP2 each forward is itself a collective
    pads = run.lockstep.extra_forwards(len(micro)) if run.lockstep is not None else 0
    for sel in micro:
        mb = mini.rows(sel)
        adv = adv_mini[sel].unsqueeze(-1) if adv_mini is not None else mb.extras["advantages"]
        _micro_step(run, tally, mb, adv, counts)
    for _ in range(max(pads, int(padded))):  # DDP's empty step: one, so every grad exists
        _micro_step(run, tally, *padding_row(batch, advantages), counts, pad=True)
    if n_rows == 0:  # every row skipped: the zero gradient AdamW would have seen
        for p in run.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    _clip_and_step(run, tally, tally.objective - objective_before)


def _micro_step(
    run: _Run,
    tally: Tally,
    mb: TokenBatch,
    adv: torch.Tensor,
    counts: StepCounts,
    pad: bool = False,
) -> None:
    """Forward, the sum of the loss terms, weighted aggregation and backward of one micro-batch.
    ``pad``: a zero-weight micro-batch (lockstep): its loss is multiplied by 0 before the
    backward, so it joins the collectives and adds nothing to the gradient or the metrics."""
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
    if pad:
        (loss * 0.0).backward()
        return
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


def _clip_and_step(run: _Run, tally: Tally, step_loss: float) -> None:
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
