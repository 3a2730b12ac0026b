"""The environment protocol: text in, text out, multi-turn.

``reset(seed) -> observation`` starts an episode; ``step(action_text) -> (observation, reward,
done, info)`` advances it. A single-turn task is an env whose first step is always done. The env
never sees tokens: the rollout code tokenises observations and builds the loss mask.

Envs that can demonstrate (for SFT warm starts) also implement :class:`Demonstrator`.
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
        """
        ...


@runtime_checkable
class Demonstrator(Protocol):
    def expert_action(self, rng: np.random.Generator) -> str:
        """A correct action for the current state."""
        ...

    def random_action(self, rng: np.random.Generator) -> str:
        """A uniformly random (well-formed) action, for noisy demonstrations."""
        ...
