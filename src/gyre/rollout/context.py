"""Refuse tasks whose prompt cannot fit the policy's context, before the first rollout.

A prompt longer than the model's ``max_position_embeddings`` (minus room for the answer,
``train.sampling.max_new_tokens``) would run past the positions the model was built for: rotary
models silently produce garbage there, others fail deep inside the forward. A dataset task is
named by ``file:line``; a built-in env by its config keys (its first observation is probed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gyre.config import Config
from gyre.engines.base import Engine
from gyre.errors import InputError
from gyre.rollout.transcript import prompt_ids


def context_limit(engine: Engine) -> int | None:
    """The policy's context in tokens (``max_position_embeddings``), None when unknown (an HTTP
    engine: the server checks its own limit)."""
    if not engine.features.in_process:
        return None
    n = getattr(engine.model.config, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def check_prompts(
    cfg: Config, make_env: Callable[[], Any], tokenizer: Any, limit: int | None
) -> None:
    """Raise :class:`InputError` for the first task whose prompt + one answer exceeds ``limit``."""
    if limit is None:
        return
    room = limit - cfg.train.sampling.max_new_tokens
    hint = "model.max_positions" if not cfg.model.path else f"{cfg.model.path}/config.json"
    if cfg.env.name == "dataset":
        env = make_env()
        for task in env.tasks:
            n = len(prompt_ids(tokenizer, task.prompt))
            if n > room:
                raise InputError(
                    f"{cfg.env.dataset.path}:{task.line}: prompt is {n} tokens; with "
                    f"train.sampling.max_new_tokens={cfg.train.sampling.max_new_tokens} it needs "
                    f"more than the model's {limit} positions ({hint})"
                )
        return
    env = make_env()
    n = len(prompt_ids(tokenizer, env.reset(0)))
    if n > room:
        raise InputError(
            f"env.name={cfg.env.name}: the first observation is {n} tokens; with "
            f"train.sampling.max_new_tokens={cfg.train.sampling.max_new_tokens} it needs more "
            f"than the model's {limit} positions ({hint}); make the env smaller "
            f"(env.{cfg.env.name}.*)"
        )
