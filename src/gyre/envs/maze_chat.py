"""The text maze in chat messages: ``env.name=maze_chat`` (docs/envs.md, "Message mode").

The same mazes, budget, sparse reward, demonstrators and seeds as ``env.name=maze``
(:mod:`gyre.envs.maze`, set by ``env.maze.*``), spoken as a conversation so that an instruct
model reads them through its own chat template: the opening is a system message (the rules,
``env.maze_chat.system``) and a user message holding the maze's first observation; each reply is
one move, and the env answers with a user message holding the next observation. The reply is
the move itself (``u``, ``d``, ``l``, ``r`` or ``up`` ... ``right``; surrounding whitespace and
a trailing full stop are ignored); anything else is a wasted move, as in the text maze.

With ``rollout.history_turns: 0`` each turn's prompt is the system message and the current
observation alone (the memoryless policy of the maze recipe), rendered by the template.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gyre.envs.base import Message
from gyre.envs.maze import MazeEnv


class MazeChatEnv:
    """The text maze's episode as chat messages (see the module docstring)."""

    message_mode = True

    def __init__(self, maze: MazeEnv | None = None, system: str = "") -> None:
        self.maze = maze if maze is not None else MazeEnv()
        self.system = system

    def reset(self, seed: int) -> list[Message]:
        first = self.maze.reset(seed)
        opening: list[Message] = [{"role": "system", "content": self.system}] if self.system else []
        return [*opening, {"role": "user", "content": first}]

    def step(self, action: str) -> tuple[list[Message], float, bool, dict[str, Any]]:
        text, reward, done, info = self.maze.step(action.strip().rstrip("."))
        return [{"role": "user", "content": text}], reward, done, info

    def state_key(self) -> tuple[int, int]:
        """The agent's cell (the text maze's key: turn-level credit, GiGPO)."""
        return self.maze.state_key()

    def render_episode(self, seed: int, actions: Sequence[str]) -> dict[str, Any]:
        """The text maze's replay of ``actions`` (the report draws it)."""
        return self.maze.render_episode(seed, [a.strip().rstrip(".") for a in actions])

    # -- demonstrations: the text maze's own demonstrator ---------------------------------------
    def expert_action(self, rng: np.random.Generator) -> str:
        return self.maze.expert_action(rng)

    def random_action(self, rng: np.random.Generator) -> str:
        return self.maze.random_action(rng)


__all__ = ["MazeChatEnv"]
