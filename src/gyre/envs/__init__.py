"""Built-in environments and the registry that builds them from config."""

from __future__ import annotations

from collections.abc import Callable

from gyre.config import EnvConfig
from gyre.envs.arithmetic import ArithmeticEnv
from gyre.envs.base import Demonstrator, Env
from gyre.envs.maze import MazeEnv

__all__ = ["ArithmeticEnv", "Demonstrator", "Env", "MazeEnv", "env_factory"]


def env_factory(cfg: EnvConfig) -> Callable[[], Env]:
    """A zero-argument constructor for the env named by ``cfg.name``."""
    if cfg.name == "maze":
        m = cfg.maze
        return lambda: MazeEnv(
            m.size, m.wall_density, m.min_distance, m.budget_factor, m.view, m.observation
        )
    if cfg.name == "arithmetic":
        a = cfg.arithmetic
        return lambda: ArithmeticEnv(a.max_operand, a.ops)
    raise ValueError(f"unknown env.name {cfg.name!r}; valid: maze, arithmetic")
