"""Turn-level credit for multi-turn episodes: GiGPO and discounted per-turn returns.

Both estimators read each trajectory's turns (:class:`Turns`): the token span of every turn's
sampled action, the env's state key before it, and the env reward of its step. They return
per-token advantages (N, T) that are constant over a turn's tokens and 0 elsewhere.

- ``gigpo`` (Feng et al. 2025, *Group-in-Group Policy Optimization for LLM Agent Training*,
  arXiv:2505.10978): A_{i,k} = A^E_i + w * A^S_{i,k}, where A^E is GRPO's episode advantage and
  A^S normalises turn k's discounted return-from-there R_{i,k} = sum_{j >= k} gamma^(j-k) r_{i,j}
  within its *anchor group*: the turns of the same task group whose episodes stood in the same
  env state before acting. Within every anchor group the step advantages sum to zero; an anchor
  group of one turn (a state only one episode visited) gets step advantage 0.
- ``turn_returns``: A_{i,k} = (R_{i,k} - mean_G) / (std_G + eps), with mean and unbiased std of
  the group's episode returns R_{i,0}. With gamma = 1 and only a final reward it is GRPO.

Self-loops (``self_loops="nonpositive"``, ``train.algo.self_loop_advantage``): a turn whose
action left the env's state key unchanged (the key after it equals the key before it: a wall
bump) gets min(A, 0). In a deterministic env whose rewards are >= 0 such an action's true
advantage is (gamma - 1) V(s) <= 0 (it only spends a turn), so a positive estimate, which a
self-loop inherits from a successful episode, is noise. The last turn has no recorded key after
it and is never one.

Rewards: turn k's reward is the env's reward of that step; whatever the trajectory's final
reward adds beyond the env's (reward functions, DAPO overlong shaping, KL in the reward) is
added to the last turn, so sum_k r_{i,k} is always the reward the episode advantage uses.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from gyre.algos.groups import group_stats, grpo_advantages


@dataclass
class Turns:
    """The turns of N trajectories (row i of the batch = trajectory i); lists per row."""

    spans: list[list[tuple[int, int]]]  # [start, end) of each turn's sampled tokens
    states: list[list[Hashable]] = field(default_factory=list)  # state key before each turn
    rewards: list[list[float]] = field(default_factory=list)  # env reward of each turn

    @classmethod
    def of(cls, trajs: Sequence[object]) -> Turns:
        """From :class:`gyre.types.Trajectory` objects (their ``turn_*`` fields)."""
        return cls(
            [list(t.turn_spans) for t in trajs],  # type: ignore[attr-defined]
            [list(t.turn_states) for t in trajs],  # type: ignore[attr-defined]
            [list(t.turn_rewards) for t in trajs],  # type: ignore[attr-defined]
        )


def turn_rewards(rewards: torch.Tensor, turns: Turns) -> list[list[float]]:
    """Per-turn rewards whose sum is each row's ``rewards[i]`` (the rest goes to the last turn)."""
    out = []
    for i, spans in enumerate(turns.spans):
        if not spans:
            out.append([])
            continue
        env = list(turns.rewards[i]) if i < len(turns.rewards) else []
        env = (env + [0.0] * len(spans))[: len(spans)]
        env[-1] += float(rewards[i]) - sum(env)
        out.append(env)
    return out


def discounted_turn_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """R_k = r_k + gamma R_{k+1} (R after the last turn = 0)."""
    out, running = [0.0] * len(rewards), 0.0
    for k in range(len(rewards) - 1, -1, -1):
        running = rewards[k] + gamma * running
        out[k] = running
    return out


def group_normalise(
    values: Sequence[float], keys: Sequence[Hashable], eps: float, divide_std: bool = True
) -> list[float]:
    """(v - mean_key) / (unbiased std_key + eps) within each key (without ``divide_std``: only
    v - mean_key); 0 for a key seen once."""
    members: dict[Hashable, list[int]] = {}
    for j, key in enumerate(keys):
        members.setdefault(key, []).append(j)
    out = [0.0] * len(values)
    for idx in members.values():
        if len(idx) < 2:
            continue
        v = torch.tensor([float(values[j]) for j in idx], dtype=torch.float64)
        a = v - v.mean()
        std = float(v.std(unbiased=True))
        if divide_std and std > 0:  # equal values: all 0, whatever eps
            a = a / (std + eps)
        for j, x in zip(idx, a.tolist(), strict=True):
            out[j] = x
    return out


def _spread(
    per_turn: list[list[float]],
    turns: Turns,
    base: torch.Tensor,
    loss_mask: torch.Tensor,
    add_base: bool = True,
) -> torch.Tensor:
    """(N, T): (base[i] +) per_turn[i][k] on turn k's tokens; base[i] on a row without turns."""
    out = torch.zeros(loss_mask.shape, dtype=torch.float64)
    for i, spans in enumerate(turns.spans):
        if not spans:
            out[i] = float(base[i])
        b = float(base[i]) if add_base else 0.0
        for k, (s, e) in enumerate(spans):
            out[i, s:e] = b + per_turn[i][k]
    return out.float().to(loss_mask.device) * loss_mask


def self_loop_turns(turns: Turns) -> list[list[bool]]:
    """Per row and turn: the env's state key after the turn equals the key before it (never
    for the last turn, whose key after is not recorded, nor for a missing key)."""
    out = []
    for i, spans in enumerate(turns.spans):
        s = turns.states[i] if i < len(turns.states) else []
        out.append(
            [k + 1 < len(s) and s[k] is not None and s[k + 1] == s[k] for k in range(len(spans))]
        )
    return out


def _clamp_self_loops(per_turn: list[list[float]], turns: Turns) -> list[list[float]]:
    """min(A, 0) on the self-loop turns (:func:`self_loop_turns`)."""
    loops = self_loop_turns(turns)
    return [
        [min(a, 0.0) if loop else a for a, loop in zip(row, lp, strict=True)]
        for row, lp in zip(per_turn, loops, strict=True)
    ]


SELF_LOOPS = ("keep", "nonpositive")


def _check(turns: Turns | None, n: int, name: str) -> Turns:
    if turns is None:
        raise ValueError(f"advantage estimator {name!r} needs the trajectories' turns")
    if len(turns.spans) != n:
        raise ValueError(f"{name}: turns of {len(turns.spans)} rows for {n} rewards")
    return turns


def gigpo_step_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    turns: Turns,
    gamma: float = 0.95,
    eps: float = 1e-6,
    norm: str = "std",
) -> list[list[float]]:
    """GiGPO's step advantages A^S_{i,k}, per row and turn (see the module docstring).

    Anchor group of (i, k) = (group_ids[i], turns.states[i][k]); a ``None`` state is never
    anchored (its step advantage is 0). ``norm='none'`` only subtracts the anchor mean (the
    paper's F_norm = 1 variant).
    """
    r = turn_rewards(rewards, turns)
    flat_ret: list[float] = []
    keys: list[Hashable] = []
    where: list[tuple[int, int]] = []
    for i, spans in enumerate(turns.spans):
        ret = discounted_turn_returns(r[i], gamma)
        states = list(turns.states[i]) if i < len(turns.states) else []
        states = (states + [None] * len(spans))[: len(spans)]
        for k in range(len(spans)):
            anchored = states[k] is not None
            keys.append((int(group_ids[i]), states[k]) if anchored else ("single", i, k))
            flat_ret.append(ret[k])
            where.append((i, k))
    if norm not in ("std", "none"):
        raise ValueError(f"unknown gigpo step normalisation {norm!r}; valid: none, std")
    adv = group_normalise(flat_ret, keys, eps, divide_std=norm == "std")
    out: list[list[float]] = [[0.0] * len(s) for s in turns.spans]
    for (i, k), a in zip(where, adv, strict=True):
        out[i][k] = a
    return out


@dataclass(frozen=True)
class StepTerms:
    """GiGPO's step-level term (``train.algo.*``): the discount ``gamma`` of the turn returns,
    the ``weight`` w of A^S, its normalisation ``norm`` (``std``, or ``none``: the anchor mean
    only) and what a self-loop gets (``self_loops``; see the module docstring)."""

    gamma: float = 0.95
    weight: float = 1.0
    norm: str = "std"
    self_loops: str = "keep"


def gigpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    loss_mask: torch.Tensor,
    turns: Turns | None = None,
    step: StepTerms = StepTerms(),
    eps: float = 1e-6,
) -> torch.Tensor:
    """GiGPO: GRPO's episode advantage plus ``step.weight`` x the anchor-state step advantage,
    on each turn's tokens. Returns (N, T)."""
    turns = _check(turns, len(rewards), "gigpo")
    _check_self_loops(step.self_loops)
    rewards = rewards.float().cpu()
    episode = grpo_advantages(rewards, group_ids, eps)
    a_step = gigpo_step_advantages(rewards, group_ids, turns, step.gamma, eps, step.norm)
    scaled = [[step.weight * a for a in row] for row in a_step]
    if step.self_loops == "keep":
        return _spread(scaled, turns, episode, loss_mask)
    total = [[float(episode[i]) + a for a in row] for i, row in enumerate(scaled)]
    return _spread(_clamp_self_loops(total, turns), turns, episode, loss_mask, add_base=False)


def _check_self_loops(mode: str) -> None:
    if mode not in SELF_LOOPS:
        raise ValueError(f"self_loops must be one of {', '.join(SELF_LOOPS)}, got {mode!r}")


def turn_returns_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    loss_mask: torch.Tensor,
    turns: Turns | None = None,
    gamma: float = 1.0,
    eps: float = 1e-6,
    self_loops: str = "keep",
) -> torch.Tensor:
    """Each turn's discounted return-to-go, normalised by its group's episode-return mean and
    unbiased std (see the module docstring). Returns (N, T)."""
    turns = _check(turns, len(rewards), "turn_returns")
    _check_self_loops(self_loops)
    rewards = rewards.float().cpu()
    r = turn_rewards(rewards, turns)
    rets = [discounted_turn_returns(x, gamma) for x in r]
    first = torch.tensor([x[0] if x else float(rewards[i]) for i, x in enumerate(rets)])
    mean, std, _ = group_stats(first, group_ids.cpu())
    per_turn = [[float((R - mean[i]) / (std[i] + eps)) for R in rets[i]] for i in range(len(rets))]
    if self_loops != "keep":
        per_turn = _clamp_self_loops(per_turn, turns)
    base = (first - mean) / (std + eps)  # rows without turns: their episode advantage
    return _spread(per_turn, turns, base, loss_mask, add_base=False)
