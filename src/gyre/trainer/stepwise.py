"""Step-wise samples (``rollout.stepwise``): an episode's turns trained as separate rows.

A message-mode episode under ``rollout.stepwise`` carries one sample per assistant turn
(:attr:`gyre.types.Trajectory.steps`): the prompt the model saw at that turn, as the chat
template rendered it, and that turn's sampled ids (mask 1 only there). Everything before the
trainer -- rewards, DAPO filtering, metrics, the Ray scheduler's groups -- sees whole episodes;
:func:`expand_steps` turns them into rows just before collation.

Advantages: computed per *episode* and broadcast to its turns (:func:`episode_advantages`). The
group statistics of GRPO / Dr. GRPO / RLOO count episodes, not turns, so an episode that took
more turns does not weigh more in its group's mean and std, and every turn of an episode gets
exactly the advantage the episode would have had as one sample. (Putting each turn in the group
with the episode's reward would bias the baseline towards long episodes.) With KL in the reward,
an episode's KL is the sum over its turns. Token-level estimators and DAPO's overlong shaping are
per-sequence ideas and are refused with ``rollout.stepwise`` (config validation). The turn
estimators (``gigpo``, ``turn_returns``) run on the episodes' turns as they do on whole episodes
and give turn k's advantage to the episode's k-th row (:func:`turn_row_advantages`).

The loss then treats each turn as a row: with ``loss_agg=seq-mean-token-mean`` an episode's
turns each count as a sequence (a multi-turn episode gets more weight than under concatenation);
``token-mean`` weighs every sampled token the same either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from gyre.algos import AdvantageInputs, AdvantageSettings, Turns, compute_advantages
from gyre.types import Trajectory


def expand_steps(trajs: Sequence[Trajectory]) -> tuple[list[Trajectory], torch.Tensor | None]:
    """Rows to train and, when any episode has step-wise samples, each row's episode index.

    A row of a step-wise episode gets the episode's reward, group, version and info; an episode
    without steps (a failed one, or raw mode) is one row as it is. Without step-wise episodes
    this returns ``trajs`` itself and None (the batch is exactly as before).
    """
    if not any(t.steps for t in trajs):
        return list(trajs), None
    rows: list[Trajectory] = []
    episode: list[int] = []
    for e, t in enumerate(trajs):
        for k, s in enumerate(t.steps or [t]):
            rows.append(
                replace(
                    s,
                    reward=t.reward,
                    group_id=t.group_id,
                    policy_version=t.policy_version,
                    success=t.success,
                    task_seed=t.task_seed,
                    info=t.info,
                    steps=None,
                    traj_id=f"{t.traj_id}/{k}" if t.steps else t.traj_id,
                )
            )
            episode.append(e)
    return rows, torch.tensor(episode)


def episode_advantages(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    rewards: torch.Tensor,
    penalty: torch.Tensor | None,
    group_ids: torch.Tensor,
    episodes: torch.Tensor,
) -> torch.Tensor:
    """(B,) row advantages: ``fn(episode rewards, episode groups)`` broadcast to the rows.

    ``rewards`` (B,) hold each row's episode reward (equal within an episode); ``penalty``
    (B,) a per-row amount subtracted once per row (the row's KL), so an episode's is the sum.
    """
    E = int(episodes.max()) + 1
    first = torch.full((E,), len(episodes), dtype=torch.long)
    first = first.scatter_reduce(0, episodes, torch.arange(len(episodes)), reduce="amin")
    ep_reward = rewards.float().cpu()[first]
    if penalty is not None:
        ep_reward = ep_reward - torch.zeros(E).scatter_add_(0, episodes, penalty.float().cpu())
    adv = fn(ep_reward, group_ids.cpu()[first])
    return adv[episodes]


def _first_rows(episodes: torch.Tensor) -> torch.Tensor:
    """(E,) the index of each episode's first row (rows of an episode are consecutive)."""
    E = int(episodes.max()) + 1
    first = torch.full((E,), len(episodes), dtype=torch.long)
    return first.scatter_reduce(0, episodes, torch.arange(len(episodes)), reduce="amin")


def turn_row_advantages(
    name: str,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    episodes: torch.Tensor,
    turns: Turns | None,
    settings: AdvantageSettings,
) -> torch.Tensor:
    """(B,) row advantages of a turn estimator (``gigpo``, ``turn_returns``) on step-wise rows.

    ``turns`` holds the *episodes'* turns (state keys and env rewards per turn,
    :class:`gyre.algos.Turns`); the estimator runs on the episodes as it would on whole
    episodes, with turn k standing for one token at position k, and row r, the k-th row of its
    episode, gets that turn's value. ``rewards`` / ``group_ids`` are per row (equal within an
    episode).
    """
    if turns is None:
        raise ValueError(f"advantage estimator {name!r} needs the episodes' turns")
    first = _first_rows(episodes.cpu())
    E = len(first)
    if len(turns.spans) != E:
        raise ValueError(f"step-wise turn credit: {len(turns.spans)} episodes' turns for {E}")
    k_of = torch.arange(len(episodes)) - first[episodes.cpu()]  # each row's turn in its episode
    n_turns = [len(s) for s in turns.spans]
    K = max([*n_turns, 1])
    mask = torch.zeros(E, K)
    for e, n in enumerate(n_turns):
        mask[e, :n] = 1.0
    one_per_turn = Turns(
        [[(k, k + 1) for k in range(n)] for n in n_turns], turns.states, turns.rewards
    )
    adv, _ = compute_advantages(
        name,
        rewards.float().cpu()[first],
        group_ids.cpu()[first],
        AdvantageInputs(loss_mask=mask, turns=one_per_turn),
        settings,
    )
    n_of = torch.tensor(n_turns)[episodes.cpu()]
    # a row past its episode's turns (a failed episode's one row) gets 0
    return adv[episodes.cpu(), k_of.clamp(max=K - 1)] * (k_of < n_of)
