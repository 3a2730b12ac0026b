"""Advantage estimators: pure tensor functions, looked up by name in :data:`ADVANTAGES`.

Two kinds, both in the one registry:

- **outcome** estimators map one scalar reward per trajectory to one advantage per trajectory:
  ``fn(rewards (N,), group_ids (N,), *, eps) -> (N,)`` -- ``grpo``, ``dr_grpo``, ``rloo``.
- **token** estimators need the loss mask and give one advantage per token:
  ``fn(rewards (N,), group_ids (N,), *, loss_mask (N, T), token_rewards (N, T) | None, ...)
  -> (N, T)`` -- ``reinforce_pp``, ``reinforce_pp_baseline``, ``gae`` (which reads the mask,
  the token rewards and a value model's values as one :class:`AdvantageInputs`, and also
  returns the value targets), and the turn-level ``gigpo`` (its step-level knobs one
  :class:`~gyre.algos.turns.StepTerms`) and ``turn_returns`` (:mod:`gyre.algos.turns`), which
  also read the trajectories' turns.

:func:`compute_advantages` calls any of them with what its record says it reads, so the
training loop does not branch on the name. To add one: write the function and add its
:class:`Estimator` record (the function, its level, what it reads) to :data:`ESTIMATORS`. The
formulas and papers are in docs/algorithms.md.

Token convention (see gyre.types): position t of a row holds token t; ``loss_mask[t] == 1`` on
policy-written tokens. In a multi-turn episode the observation tokens between turns are not
time steps: discounting and GAE run over the policy tokens only, in order.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from gyre.algos.groups import group_stats, grpo_advantages
from gyre.algos.registry import lookup
from gyre.algos.turns import StepTerms, Turns, gigpo_advantages, turn_returns_advantages


def dr_grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): A_i = r_i - mean_G, no std division.

    Dividing by the group std up-weights groups whose rewards barely differ (question-difficulty
    bias); Dr. GRPO drops it. ``eps`` is accepted for a uniform signature and unused.
    """
    rewards = rewards.float().cpu()
    mean, _, _ = group_stats(rewards, group_ids.cpu())
    return rewards - mean


def rloo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): A_i = r_i - mean_{j != i} r_j.

    Equal to G / (G - 1) * (r_i - mean_G). A group of one has no baseline: its advantage is 0.
    ``eps`` is accepted for a uniform signature and unused.
    """
    rewards = rewards.float().cpu()
    mean, _, count = group_stats(rewards, group_ids.cpu())
    loo = (rewards - mean) * count / (count - 1).clamp(min=1)
    return torch.where(count > 1, loo, torch.zeros_like(loo))


WHITEN_STD = ("population", "unbiased")


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, std: str = "population"
) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries of the whole tensor; 0 off the mask.

    ``std='population'``: the population std of the n masked entries (OpenRLHF's
    ``masked_normalize``, gyre's default); ``'unbiased'``: var * n / (n - 1), as verl's
    ``masked_whiten`` (the whitened values differ by the factor sqrt((n - 1) / n)).
    """
    if std not in WHITEN_STD:
        raise ValueError(f"unknown whitening std {std!r}; valid: {', '.join(WHITEN_STD)}")
    n = mask.sum().clamp(min=1)
    mean = (values * mask).sum() / n
    var = (((values - mean) * mask) ** 2).sum() / n
    if std == "unbiased":
        var = var * n / (n - 1).clamp(min=1)
    return (values - mean) / (var.sqrt() + eps) * mask


def last_token_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(N, T) tensor with r_i on the last policy token of row i and 0 elsewhere."""
    T = loss_mask.shape[1]
    pos = torch.arange(T, device=loss_mask.device).expand_as(loss_mask)
    last = torch.where(loss_mask > 0, pos, torch.full_like(pos, -1)).max(dim=1).values  # (N,)
    out = torch.zeros_like(loss_mask, dtype=torch.float32)
    has = last >= 0
    out[has.nonzero().squeeze(-1), last[has]] = rewards.float().to(out.device)[has]
    return out


def discounted_returns(
    token_rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """G_t = sum_{k >= t, mask_k = 1} gamma^(#policy tokens between t and k) r_k, on the mask.

    A backward scan over T; off-mask positions carry the running return unchanged (they are
    not time steps) and get 0 in the output.
    """
    running = torch.zeros(token_rewards.shape[0], device=token_rewards.device)
    out = torch.zeros_like(token_rewards, dtype=torch.float32)
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        m = loss_mask[:, t]
        running = torch.where(m > 0, token_rewards[:, t] + gamma * running, running)
        out[:, t] = running * m
    return out


def _kl_shaped(
    rewards: torch.Tensor, loss_mask: torch.Tensor, token_rewards: torch.Tensor | None
) -> torch.Tensor:
    """Outcome reward on the last policy token plus any per-token term (e.g. -beta * KL_t)."""
    shaped = last_token_rewards(rewards, loss_mask)
    if token_rewards is not None:
        shaped = shaped + token_rewards * loss_mask
    return shaped


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    loss_mask: torch.Tensor,
    token_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-8,
    whiten_std: str = "population",
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): whitened discounted return, per token.

    Per-token reward = ``token_rewards`` (the caller passes -beta * KL_t for KL-in-reward) plus
    r_i on the last policy token; A_t = discounted return from t, whitened over every policy token
    of the batch. ``group_ids`` is unused (no group baseline in this variant).
    """
    returns = discounted_returns(_kl_shaped(rewards, loss_mask, token_rewards), loss_mask, gamma)
    return masked_whiten(returns, loss_mask, eps, whiten_std)


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    loss_mask: torch.Tensor,
    token_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-8,
    whiten_std: str = "population",
) -> torch.Tensor:
    """REINFORCE++-baseline (arXiv:2501.03262 v3+): r_i - mean_G, then as ``reinforce_pp``.

    The group mean replaces the missing critic; the whitening over the batch keeps the scale
    stable across batches (OpenRLHF's ``reinforce_baseline``).
    """
    rewards = rewards.float().cpu()
    mean, _, _ = group_stats(rewards, group_ids.cpu())
    return reinforce_pp_advantages(
        (rewards - mean).to(loss_mask.device),
        group_ids,
        loss_mask=loss_mask,
        token_rewards=token_rewards,
        gamma=gamma,
        eps=eps,
        whiten_std=whiten_std,
    )


@dataclass(frozen=True)
class Whitening:
    """How :func:`masked_whiten` whitens: ``(x - mean) / (std + eps)``, ``std`` population
    (OpenRLHF) or unbiased (verl)."""

    eps: float = 1e-8
    std: str = "population"


def gae_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    inputs: AdvantageInputs,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: Whitening | None = Whitening(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016, arXiv:1506.02438) for PPO with a value model.

    Reads ``inputs.loss_mask``, ``inputs.values`` and ``inputs.token_rewards`` (optional).
    Over the policy tokens of each row (in order; observation tokens are skipped):
    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lambda A_{t+1}, with V = 0 after
    the last policy token. ``values[:, t]`` is V of the state before token t. Returns
    (advantages (N, T), returns (N, T) = A + V, the value targets, computed before whitening).
    The advantages are then whitened over the batch's policy tokens as ``whiten`` says (None:
    not whitened; see :func:`masked_whiten`).
    """
    loss_mask, values = inputs.loss_mask, inputs.values
    if loss_mask is None or values is None:
        raise ValueError("gae needs inputs.loss_mask and inputs.values (a value model's)")
    r = _kl_shaped(rewards, loss_mask, inputs.token_rewards)
    values = values.float() * loss_mask
    N, T = r.shape
    next_v = torch.zeros(N, device=r.device)
    next_a = torch.zeros(N, device=r.device)
    adv = torch.zeros_like(r)
    for t in range(T - 1, -1, -1):
        m = loss_mask[:, t] > 0
        delta = r[:, t] + gamma * next_v - values[:, t]
        a = delta + gamma * lam * next_a
        next_a = torch.where(m, a, next_a)
        next_v = torch.where(m, values[:, t], next_v)
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
    returns = (adv + values) * loss_mask
    if whiten is not None:
        adv = masked_whiten(adv, loss_mask, whiten.eps, whiten.std)
    return adv, returns


AdvantageFn = Callable[..., Any]


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator and what it reads; :data:`ESTIMATORS` holds them by name.

    ``level``: ``"outcome"`` (one advantage per trajectory, (N,)) or ``"token"`` ((N, T); reads
    the loss mask). ``needs_turns``: reads the trajectories' turns (:class:`Turns`);
    ``needs_values``: reads a value model's values and returns value targets (GAE);
    ``whitens``: whitens with ``whiten_std``; ``step_terms``: reads GiGPO's ``step_weight`` and
    ``step_norm``.
    """

    fn: AdvantageFn
    level: Literal["outcome", "token"] = "outcome"
    needs_turns: bool = False
    needs_values: bool = False
    whitens: bool = False
    step_terms: bool = False

    @property
    def token_level(self) -> bool:
        return self.level == "token"


@dataclass(frozen=True)
class AdvantageInputs:
    """What a token estimator reads beyond the rewards (N,) and group ids (N,)."""

    loss_mask: torch.Tensor | None = None  # (N, T)
    token_rewards: torch.Tensor | None = None  # (N, T): a per-token reward (KL in the reward)
    values: torch.Tensor | None = None  # (N, T): the value model's (needs_values)
    turns: Turns | None = None  # needs_turns


@dataclass(frozen=True)
class AdvantageSettings:
    """The estimators' numbers (``train.adv_eps`` and ``train.algo.*``); each reads its own."""

    eps: float = 1e-6
    gamma: float = 1.0
    lam: float = 1.0
    step_weight: float = 1.0
    step_norm: str = "std"
    whiten_std: str = "population"
    self_loops: str = "keep"


_TOKEN: Literal["token"] = "token"
ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(grpo_advantages),
    "dr_grpo": Estimator(dr_grpo_advantages),
    "rloo": Estimator(rloo_advantages),
    "reinforce_pp": Estimator(reinforce_pp_advantages, _TOKEN, whitens=True),
    "reinforce_pp_baseline": Estimator(reinforce_pp_baseline_advantages, _TOKEN, whitens=True),
    "gae": Estimator(gae_advantages, _TOKEN, needs_values=True, whitens=True),
    "gigpo": Estimator(gigpo_advantages, _TOKEN, needs_turns=True, step_terms=True),
    "turn_returns": Estimator(turn_returns_advantages, _TOKEN, needs_turns=True),
}
ADVANTAGES: dict[str, AdvantageFn] = {name: e.fn for name, e in ESTIMATORS.items()}

# The name sets these four once were, derived from ESTIMATORS; kept one version.
_DEPRECATED_SETS: dict[str, Callable[[Estimator], bool]] = {
    "TOKEN_LEVEL": lambda e: e.token_level,
    "NEEDS_VALUES": lambda e: e.needs_values,
    "NEEDS_TURNS": lambda e: e.needs_turns,
    "WHITENS": lambda e: e.whitens,
}


def deprecated_name_set(name: str, stacklevel: int = 2) -> frozenset[str]:
    """One of the deprecated name sets, derived from :data:`ESTIMATORS`, with a warning; an
    AttributeError for any other name (a module ``__getattr__``)."""
    if name not in _DEPRECATED_SETS:
        raise AttributeError(f"module 'gyre.algos' has no attribute {name!r}")
    warnings.warn(
        f"gyre.algos.{name} is deprecated: read gyre.algos.ESTIMATORS[name] "
        "(.level, .needs_turns, .needs_values, .whitens)",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
    return frozenset(n for n, e in ESTIMATORS.items() if _DEPRECATED_SETS[name](e))


def __getattr__(name: str) -> frozenset[str]:
    return deprecated_name_set(name)


def get_estimator(name: str) -> Estimator:
    return lookup(ESTIMATORS, name, "advantage estimator")


def get_advantage_fn(name: str) -> AdvantageFn:
    return get_estimator(name).fn


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    inputs: AdvantageInputs | None = None,
    settings: AdvantageSettings | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run estimator ``name``; returns (advantages (N,) or (N, T), value targets or None).

    Outcome estimators see ``rewards`` already shaped by the caller (a KL-in-reward penalty is
    summed into the per-trajectory reward); token estimators get ``inputs.token_rewards`` per
    token. Each estimator is passed what its :class:`Estimator` record says it reads.
    """
    est = get_estimator(name)
    x = inputs or AdvantageInputs()
    s = settings or AdvantageSettings()
    if not est.token_level:
        return est.fn(rewards, group_ids, eps=s.eps), None
    if x.loss_mask is None:
        raise ValueError(f"advantage estimator {name!r} needs the loss mask (token level)")
    if est.needs_values:
        if x.values is None:
            raise ValueError(f"advantage estimator {name!r} needs values from a value model")
        whiten = Whitening(std=s.whiten_std)
        return est.fn(rewards, group_ids, inputs=x, gamma=s.gamma, lam=s.lam, whiten=whiten)
    kw: dict[str, Any] = {"loss_mask": x.loss_mask}
    if est.step_terms:
        step = StepTerms(s.gamma, s.step_weight, s.step_norm, s.self_loops)
        kw |= {"turns": x.turns, "step": step, "eps": s.eps}
    elif est.needs_turns:
        kw |= {"turns": x.turns, "gamma": s.gamma, "eps": s.eps, "self_loops": s.self_loops}
    else:
        kw |= {"token_rewards": x.token_rewards, "gamma": s.gamma}
    if est.whitens:
        kw["whiten_std"] = s.whiten_std
    return est.fn(rewards, group_ids, **kw), None
