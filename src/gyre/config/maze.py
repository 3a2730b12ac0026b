"""``env.maze``: the settings of the text maze (:mod:`gyre.envs.maze`), which the visual maze
draws too. Here, with the other envs' sections, because the config sits below the envs: an env
reads its section, the config never imports an env."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gyre.config.base import Section

DemonstratorName = Literal["shortest", "greedy", "lookahead", "careful"]


class MazeConfig(Section):
    """``env.maze``: the maze of ``env.name=maze`` (and of ``visual_maze``, which draws it).

    The run's settings; :class:`MazeEnv`'s own keyword defaults are the plain text maze of the
    Python API (``compass`` view, ``shortest`` demonstrator).
    """

    size: int = Field(5, ge=5, description="Maze side length in cells (at least 5).")
    wall_density: float = Field(
        0.3, ge=0.0, lt=0.7, description="Fraction of cells that are walls."
    )
    min_distance: int = Field(
        4, ge=4, description="Shortest start-to-goal path, in moves, is at least this."
    )
    budget_factor: float = Field(
        2.0, ge=1.0, le=2.0, description="Move budget = floor(factor * shortest path), at most 2x."
    )
    observation: Literal["compass", "exits", "window", "grid"] = Field(
        "exits",
        description="compass: grid once, then neighbours + goal offset; exits: grid once, then "
        "the open moves + goal offset; window: a local square; grid: the whole grid every turn.",
    )
    view: int = Field(
        2,
        ge=1,
        description="View radius: compass cells within this many moves; exits looks 1 or 2"
        " moves ahead; window half-width.",
    )
    demonstrator: DemonstratorName = Field(
        "careful",
        description="SFT demonstrator: shortest = a move along a shortest path (solves every "
        "maze); greedy = the legal move that brings the agent closest to the goal (never bumps, "
        "but ignores dead ends and visited cells); lookahead = greedy, but a neighbour that is a "
        "dead end (nothing open beyond it) only when every move is one; careful = lookahead, "
        "then an unvisited cell before a visited one.",
    )
    demonstrator_mix: dict[DemonstratorName, float] = Field(
        default_factory=dict,
        description="A mixed teacher: each turn's move is drawn from these demonstrators with "
        "these probabilities (summing to at most 1), the rest of the time `demonstrator`'s, e.g. "
        "{careful: 0.35} with demonstrator=greedy. SFT on it learns both rules, the more likely "
        "one as its greedy move; GRPO can then find which is worth more.",
    )

    @model_validator(mode="after")
    def _check_reachable(self) -> MazeConfig:
        for name, p in self.demonstrator_mix.items():
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"env.maze.demonstrator_mix.{name}={p} must lie in [0, 1]")
        if sum(self.demonstrator_mix.values()) > 1.0 + 1e-9:
            raise ValueError(
                f"env.maze.demonstrator_mix={self.demonstrator_mix} sums to more than 1"
            )
        far = 2 * (self.size - 1)
        if self.min_distance > far:
            raise ValueError(
                f"env.maze.min_distance={self.min_distance} cannot be drawn in a maze of "
                f"env.maze.size={self.size}: corner to corner is {far} moves"
            )
        return self


MAZE_CHAT_SYSTEM = "Walk the maze to the goal G. Reply with one move: u, d, l or r."


class MazeChatConfig(Section):
    """``env.maze_chat``: the text maze spoken in chat messages (``env.name=maze_chat``); the
    maze itself is ``env.maze.*``."""

    system: str = Field(
        MAZE_CHAT_SYSTEM,
        description="The system message that opens every episode (the rules); empty = none "
        "(the chat template's own default system prompt, if it has one).",
    )
