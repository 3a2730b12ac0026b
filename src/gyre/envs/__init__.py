"""Built-in environments and the registry that builds them from config."""

from __future__ import annotations

from collections.abc import Callable

from gyre.config import EnvConfig
from gyre.envs.arithmetic import ArithmeticEnv
from gyre.envs.base import Demonstrator, Env
from gyre.envs.dataset import DatasetEnv, load_jsonl_tasks
from gyre.envs.maze import MazeEnv

__all__ = ["ArithmeticEnv", "DatasetEnv", "Demonstrator", "Env", "MazeEnv", "env_factory"]


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
    if cfg.name == "dataset":
        d = cfg.dataset
        tasks = load_jsonl_tasks(d.path, d.prompt_field, d.answer_field)  # read once, shared
        DatasetEnv(tasks, d.eval_rows, d.path)  # validate eval_rows now, not in the first rollout
        return lambda: DatasetEnv(tasks, d.eval_rows, d.path)
    raise ValueError(f"unknown env.name {cfg.name!r}; valid: maze, arithmetic, dataset")
