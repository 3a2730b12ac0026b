"""The environment protocol: text in, text out, multi-turn.

``reset(seed) -> observation`` starts an episode; ``step(action_text) -> (observation, reward,
done, info)`` advances it. A single-turn task is an env whose first step is always done. The env
never sees tokens: the rollout code tokenises observations and builds the loss mask.

Envs that can demonstrate (for SFT warm starts) also implement :class:`Demonstrator`.

**Message mode** (:class:`MessageEnv`, docs/envs.md): an env with the class attribute
``message_mode = True`` speaks in chat messages (``{"role": ..., "content": ...}`` dicts)
instead of raw text. ``reset(seed)`` returns the opening messages (``system`` / ``user``);
``step(text)`` gets the assistant's reply (its decoded sampled text, without the end-of-turn
token) and returns ``(new_messages, reward, done, info)``, the new messages being ``user`` or
``tool`` ones. The rollout renders the conversation with the tokenizer's own chat template
(:mod:`gyre.rollout.chat`); tools are added by wrapping the env in
:class:`gyre.rollout.tools.ToolEnv`, which answers tool calls itself, so the inner env sees only
replies without a tool call.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Env(Protocol):
    def reset(self, seed: int) -> str:
        """Start the episode determined by ``seed``; return the first observation."""
        ...

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Apply the policy's text; return (observation, reward, done, info).

        ``info`` of the final step carries ``success`` (bool). An env may put a hashable
        ``info["state"]`` (the state the next action starts from) and offer ``state_key()`` (the
        state after ``reset``): the turn-level estimators (``gigpo``) group turns by it.
        ``info["invalid"]`` true says the action changed nothing (a wall bump, an unparsable
        move): with ``train.sampling.retry_temperature`` the next turn is sampled hotter.
        """
        ...


Message = dict[str, Any]


@runtime_checkable
class MessageEnv(Protocol):
    """An env that speaks chat messages; see the module docstring."""

    message_mode: bool  # True (a class attribute): this env speaks messages

    def reset(self, seed: int) -> list[Message]:
        """Start the episode determined by ``seed``; return its opening messages."""
        ...

    def step(self, action: str) -> tuple[list[Message], float, bool, dict[str, Any]]:
        """Apply the assistant's reply; return (new messages, reward, done, info)."""
        ...


def is_message_env(env: object) -> bool:
    """True for an env in message mode (``message_mode = True``)."""
    return getattr(env, "message_mode", False) is True


@runtime_checkable
class Demonstrator(Protocol):
    def expert_action(self, rng: np.random.Generator) -> str:
        """A correct action for the current state."""
        ...

    def random_action(self, rng: np.random.Generator) -> str:
        """A uniformly random (well-formed) action, for noisy demonstrations."""
        ...
