"""Step 2 of the update: a batch's advantages -- KL-in-reward shaping, then the named estimator
(:data:`gyre.algos.ESTIMATORS`) with the config's numbers; step-wise rows get their episode's
(or, for the turn estimators, their turn's) advantage (:mod:`gyre.trainer.stepwise`)."""

from __future__ import annotations

import torch

from gyre.algos import (
    AdvantageInputs,
    AdvantageSettings,
    Turns,
    compute_advantages,
    get_estimator,
    get_kl_fn,
)
from gyre.config import TrainConfig
from gyre.trainer.batch import TokenBatch
from gyre.trainer.stepwise import episode_advantages, turn_row_advantages


def advantage_settings(train: TrainConfig) -> AdvantageSettings:
    """The estimators' numbers from the config (``train.adv_eps``, ``train.algo.*``)."""
    a = train.algo
    return AdvantageSettings(
        eps=train.adv_eps,
        gamma=a.discount,
        lam=a.lam,
        step_weight=a.gigpo_step_weight,
        step_norm=a.gigpo_step_norm,
        whiten_std=a.whiten_std,
        self_loops=a.self_loop_advantage,
    )


def batch_advantages(
    name: str,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    batch: TokenBatch,
    train: TrainConfig,
    episodes: torch.Tensor | None = None,
    turns: Turns | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages (B,) or (B, T) for ``batch``; value targets land in ``batch.extras``.

    The estimator's numbers come from ``train`` (:func:`advantage_settings`). ``episodes`` (B,):
    step-wise rows' episode index (:mod:`gyre.trainer.stepwise`): the outcome estimator runs on
    episodes and each row gets its episode's advantage. ``turns``: the episodes' turns, which
    the turn estimators (``gigpo``, ``turn_returns``) read.
    KL in the reward (``kl_in == 'reward'``, needs ``ref_logprobs`` from :func:`prepare_batch`):
    token estimators get -kl_coef * KL_t per policy token; outcome estimators get the reward
    minus kl_coef * sum_t KL_t (the sequence's KL).
    """
    est, settings = get_estimator(name), advantage_settings(train)
    metrics: dict[str, float] = {}
    token_rewards = None
    mask = batch.loss_mask
    rewards = rewards.float().to(mask.device)
    penalty = None
    if train.algo.kl_in == "reward" and "ref_logprobs" in batch.extras:
        old = batch.extras.get("old_logprobs", batch.rollout_logprobs)
        kl = get_kl_fn(train.algo.kl_type)(old, batch.extras["ref_logprobs"]) * mask  # (B, T)
        metrics["train/kl"] = float(kl.sum() / mask.sum().clamp(min=1))
        if est.token_level:
            token_rewards = -train.kl_coef * kl
        elif episodes is not None:
            penalty = train.kl_coef * kl.sum(dim=1)
        else:
            rewards = rewards - train.kl_coef * kl.sum(dim=1)
    if episodes is not None:
        if est.needs_turns:  # turn-level credit: turn k of an episode is its k-th row
            adv = turn_row_advantages(name, rewards, group_ids, episodes, turns, settings)
            return adv.to(mask.device), metrics
        if est.token_level:
            raise ValueError(f"step-wise samples need an outcome or turn estimator, not {name!r}")
        fn = lambda r, g: compute_advantages(name, r, g, settings=settings)[0]  # noqa: E731
        adv = episode_advantages(fn, rewards, penalty, group_ids, episodes)
        return adv.to(mask.device), metrics
    values = batch.extras.get("values")
    inputs = AdvantageInputs(mask, token_rewards, values, turns)
    adv, returns = compute_advantages(
        name, rewards if est.token_level else rewards.cpu(), group_ids, inputs, settings
    )
    if returns is not None:
        batch.extras["returns"] = returns
    return adv.to(mask.device), metrics
