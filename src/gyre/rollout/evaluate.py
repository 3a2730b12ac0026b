"""Held-out evaluation: success rate (greedy and sampled) and mean moves on fixed seeds.

Evaluation seeds live in ``[EVAL_SEED_BASE, EVAL_SEED_BASE + episodes)``; training and SFT
seeds are drawn from ``[0, EVAL_SEED_BASE)``, so no held-out task is ever trained on.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from transformers import PreTrainedTokenizerBase

from gyre.engines.base import Engine
from gyre.envs.base import Env
from gyre.rollout.chat import ChatMode
from gyre.rollout.episodes import run_episodes
from gyre.rollout.stops import Stops, derive_stops
from gyre.types import SamplingParams

EVAL_SEED_BASE = 2**31


def eval_seeds(episodes: int) -> list[int]:
    return [EVAL_SEED_BASE + i for i in range(episodes)]


def train_seed(run_seed: int, stream: int, index: int) -> int:
    """The ``index``-th task seed of a training stream (SFT demos, GRPO tasks), < EVAL_SEED_BASE."""
    state = np.random.SeedSequence([run_seed, stream, index]).generate_state(1, dtype=np.uint64)
    return int(state[0] % EVAL_SEED_BASE)


def evaluate(
    engine: Engine,
    make_env: Callable[[], Env],
    tokenizer: PreTrainedTokenizerBase,
    episodes: int,
    temperature: float,
    max_new_tokens: int,
    sampled: bool = True,
    seed: int = 0,
    top_p: float = 1.0,
    continuous: bool = True,
    stops: Stops | None = None,
    chat: ChatMode | None = None,
) -> dict[str, float]:
    """Greedy (and sampled) success and mean moves on the held-out seeds; ``continuous`` is
    ``perf.continuous`` (see :func:`gyre.rollout.episodes.run_episodes`); ``stops`` the run's
    (default: derived from the tokenizer); ``chat``: message mode."""
    seeds = eval_seeds(episodes)
    stops = derive_stops(tokenizer) if stops is None else stops
    out: dict[str, float] = {}
    modes = [("greedy", 0.0, 1.0)] + ([("sampled", temperature, top_p)] if sampled else [])
    for name, temp, tp in modes:
        params = SamplingParams(
            temperature=temp,
            top_p=tp,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stops.token_ids,
            seed=seed,
            stop_strings=stops.strings,
        )
        trajs = run_episodes(
            make_env, engine, tokenizer, seeds, 1, params, continuous=continuous, chat=chat
        )
        out[f"eval/success_{name}"] = float(np.mean([t.success for t in trajs]))
        out[f"eval/moves_{name}"] = float(np.mean([t.num_turns for t in trajs]))
    return out
