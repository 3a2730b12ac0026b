"""Held-out evaluation: success rate, mean reward and mean moves (greedy, sampled) on fixed seeds.

Three disjoint seed ranges (``eval.episodes`` and ``eval.validation_episodes`` are at most 2^31):

    training (SFT demos, GRPO tasks)   [0, 2^31)                      train_seed
    held-out evaluation                [2^31, 2^31 + episodes)        eval_seeds
    validation                         [2^32, 2^32 + episodes)        validation_seeds

so no held-out or validation task is ever trained on, and a choice made on validation results
(e.g. which checkpoint to keep) never looks at the held-out tasks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase

from gyre.engines.base import Engine
from gyre.envs.base import Env
from gyre.rollout.chat import ChatMode
from gyre.rollout.episodes import EpisodeOptions, run_episodes
from gyre.rollout.stops import Stops, derive_stops
from gyre.rollout.window import Window
from gyre.types import SamplingParams, Trajectory

log = logging.getLogger(__name__)

EVAL_SEED_BASE = 2**31
VAL_SEED_BASE = 2**32
MAX_EPISODES = 2**31  # eval.episodes / eval.validation_episodes bound: the ranges never meet


def eval_seeds(episodes: int) -> list[int]:
    return _seed_range(EVAL_SEED_BASE, episodes)


def validation_seeds(episodes: int) -> list[int]:
    return _seed_range(VAL_SEED_BASE, episodes)


def _seed_range(base: int, episodes: int) -> list[int]:
    if not 0 <= episodes <= MAX_EPISODES:
        raise ValueError(f"episodes must lie in [0, 2^31], got {episodes}")
    return [base + i for i in range(episodes)]


def train_seed(run_seed: int, stream: int, index: int) -> int:
    """The ``index``-th task seed of a training stream (SFT demos, GRPO tasks), < EVAL_SEED_BASE."""
    state = np.random.SeedSequence([run_seed, stream, index]).generate_state(1, dtype=np.uint64)
    return int(state[0] % EVAL_SEED_BASE)


@dataclass(frozen=True)
class EvalSettings:
    """How :func:`evaluate` plays (a run's ``train.sampling``, ``eval``, ``perf`` and
    ``rollout`` keys): greedy and, with ``sampled``, at ``temperature`` / ``top_p``.
    ``continuous`` is ``perf.continuous`` (see :func:`gyre.rollout.episodes.run_episodes`);
    ``stops`` the run's (default: derived from the tokenizer); ``chat``: message mode;
    ``window``: ``rollout.history_turns``."""

    temperature: float
    max_new_tokens: int
    sampled: bool = True
    seed: int = 0
    top_p: float = 1.0
    continuous: bool = True
    stops: Stops | None = None
    chat: ChatMode | None = None
    window: Window | None = None


def evaluate(
    engine: Engine,
    make_env: Callable[[], Env],
    tokenizer: PreTrainedTokenizerBase,
    episodes: int,
    settings: EvalSettings,
    split: str = "eval",
    score: Callable[[list[Trajectory]], object] | None = None,
) -> dict[str, float]:
    """Success rate, mean reward, mean moves of ``episodes`` tasks of ``split`` (``eval``: held-out
    seeds, ``val``: validation), greedy and (with ``settings.sampled``) sampled; metrics
    ``<split>/success_greedy`` ...; ``score``: the run's reward functions
    (:meth:`gyre.rewards.Rewarder.score`), which set each trajectory's reward as in training --
    the held-out reward is then the one GRPO optimises, with ``<split>/reward_<term>_<mode>``
    for each term; success stays the env's own."""
    if split not in ("eval", "val"):
        raise ValueError(f"unknown evaluation split {split!r}; valid: eval, val")
    seeds = eval_seeds(episodes) if split == "eval" else validation_seeds(episodes)
    st = settings
    stops = derive_stops(tokenizer) if st.stops is None else st.stops
    out: dict[str, float] = {}
    modes = [("greedy", 0.0, 1.0)] + ([("sampled", st.temperature, st.top_p)] if st.sampled else [])
    for name, temp, tp in modes:
        params = SamplingParams(
            temperature=temp,
            top_p=tp,
            max_new_tokens=st.max_new_tokens,
            stop_token_ids=stops.token_ids,
            seed=st.seed,
            stop_strings=stops.strings,
        )
        mode: EpisodeOptions = {"continuous": st.continuous, "chat": st.chat, "window": st.window}
        trajs = run_episodes(make_env, engine, tokenizer, seeds, 1, params, **mode)
        if score is not None and trajs:
            score(trajs)
            for term in trajs[0].info.get("rewards", {}):
                vals = [t.info["rewards"][term] for t in trajs]
                out[f"{split}/reward_{term}_{name}"] = float(np.mean(vals))
        out[f"{split}/success_{name}"] = float(np.mean([t.success for t in trajs]))
        out[f"{split}/moves_{name}"] = float(np.mean([t.num_turns for t in trajs]))
        # the mean return: the score where the reward gives partial credit (reasoning-gym)
        out[f"{split}/reward_{name}"] = float(np.mean([t.reward for t in trajs]))
        if trajs and all("bumps" in t.info for t in trajs):  # envs that count wall bumps (maze)
            bumps = sum(int(t.info["bumps"]) for t in trajs)
            out[f"{split}/bump_frac_{name}"] = bumps / max(1, sum(t.num_turns for t in trajs))
    return out


def demonstrator_success(make_env: Callable[[], Env], episodes: int) -> dict[str, float] | None:
    """The env's own demonstrator (``expert_action``, no noise) on the held-out seeds: the
    before/after table's reference line; None for an env without one. Pure env code, no model.
    """
    from gyre.envs.base import Demonstrator

    if episodes == 0 or not isinstance(make_env(), Demonstrator):
        return None
    rng = np.random.default_rng(0)  # seeded: a mixed teacher (env.maze.demonstrator_mix) draws
    wins, moves, returns = [], [], []
    for seed in eval_seeds(episodes):
        env = make_env()
        done, info, turns, ret = False, {}, 0, 0.0
        try:
            env.reset(seed)
            while not done and turns < 10_000:  # an env that never ends is no demonstration
                _, r, done, info = env.step(env.expert_action(rng))  # type: ignore[attr-defined]
                turns, ret = turns + 1, ret + float(r)
        except Exception as exc:  # a reference line, never a reason to lose a finished run
            log.warning("demonstrator evaluation skipped: seed %d raised %r", seed, exc)
            return None
        wins.append(bool(info.get("success", False)))
        moves.append(turns)
        returns.append(ret)
    return {
        "eval/success_greedy": float(np.mean(wins)),
        "eval/moves_greedy": float(np.mean(moves)),
        "eval/reward_greedy": float(np.mean(returns)),
    }
