"""Built-in environments, plug-ins, and the factory that builds them from config.

``env.name`` is a built-in env (``maze``, ``arithmetic``, ``dataset``, the adapters
``gymnasium`` and ``reasoning_gym``, whose packages are optional extras imported only when
used, and the image envs ``visual_maze`` and ``minigrid``: :mod:`gyre.envs.visual`), a
name given to :func:`register`, an import path ``module:Class`` or a file path
``envs.py:Class`` (:mod:`gyre.plugins`); a plug-in is called with ``env.kwargs`` for every
episode. See docs/envs.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gyre.envs.arithmetic import ArithmeticEnv
from gyre.envs.base import Demonstrator, Env
from gyre.envs.data_files import load_tasks
from gyre.envs.dataset import DatasetEnv, DatasetMessageEnv, load_jsonl_tasks, message_tasks
from gyre.envs.maze import MazeEnv, Teacher
from gyre.envs.visual import image_env_factory
from gyre.plugins import ENV_REGISTRY, load_object

if TYPE_CHECKING:  # gyre.config imports gyre.envs.maze for its env section
    from gyre.config import EnvConfig

__all__ = [
    "ArithmeticEnv",
    "DatasetEnv",
    "Demonstrator",
    "Env",
    "MazeEnv",
    "Teacher",
    "env_factory",
    "load_jsonl_tasks",
    "load_tasks",
    "register",
    "registered",
]

_REGISTRY = ENV_REGISTRY  # name -> factory


def register(name: str, factory: Callable[..., Env]) -> None:
    """Make ``env.name: <name>`` build envs with ``factory(**env.kwargs)`` in this process.

    Register before the config is loaded (``load_config`` checks the name). The registry lives
    in the process that called this: a Ray rollout worker does not see it, so for
    ``runner=ray`` name the env by import path or file path instead.
    """
    from gyre.config import BUILTIN_ENVS

    if name in BUILTIN_ENVS or ":" in name or not name.strip():
        raise ValueError(f"cannot register env {name!r}: built-in names and ':' are reserved")
    if not callable(factory):
        raise TypeError(f"env factory for {name!r} is a {type(factory).__name__}, not callable")
    _REGISTRY[name] = factory


def registered() -> list[str]:
    return sorted(_REGISTRY)


def env_factory(cfg: EnvConfig) -> Callable[[], Env]:
    """A zero-argument constructor for the env named by ``cfg.name``."""
    if cfg.name == "maze":
        return lambda: MazeEnv.from_config(cfg.maze)
    if cfg.name == "maze_chat":
        from gyre.envs.maze_chat import MazeChatEnv

        m, system = cfg.maze, cfg.maze_chat.system
        return lambda: MazeChatEnv(MazeEnv.from_config(m), system)
    if cfg.name == "arithmetic":
        a = cfg.arithmetic
        return lambda: ArithmeticEnv(a.max_operand, a.ops)
    if cfg.name == "dataset":
        d = cfg.dataset
        tasks = load_tasks(d.path, d.format, d.prompt_field, d.answer_field)  # read once, shared
        cls = DatasetMessageEnv if message_tasks(tasks, d.messages, d.path) else DatasetEnv
        cls(tasks, d.eval_rows, d.path)  # validate eval_rows now, not in the first rollout
        return lambda: cls(tasks, d.eval_rows, d.path)
    if cfg.name in ("visual_maze", "minigrid"):
        return image_env_factory(cfg)
    if cfg.name == "gymnasium":
        from gyre.envs.gymnasium_env import gymnasium_factory

        return gymnasium_factory(cfg.gymnasium)
    if cfg.name == "reasoning_gym":
        from gyre.envs.reasoning_gym_env import reasoning_gym_factory

        return reasoning_gym_factory(cfg.reasoning_gym)
    return _plugin_factory(cfg)


def _plugin_factory(cfg: EnvConfig) -> Callable[[], Env]:
    if cfg.name in _REGISTRY:
        factory: Any = _REGISTRY[cfg.name]
    elif ":" in cfg.name:
        factory = load_object(cfg.name, "env.name")
    else:
        from gyre.config import BUILTIN_ENVS

        known = ", ".join([*BUILTIN_ENVS, *registered()])
        raise ValueError(
            f"unknown env.name {cfg.name!r}; valid: {known}, or an import path "
            "'module:Class' / file path 'envs.py:Class'"
        )
    if not callable(factory):
        raise ValueError(f"env.name={cfg.name!r} is a {type(factory).__name__}, not a class")
    kwargs = dict(cfg.kwargs)
    try:  # one env now: a bad kwarg or a wrong class fails before any rollout
        env = factory(**kwargs)
    except TypeError as exc:
        raise ValueError(f"env.name={cfg.name!r} with env.kwargs={kwargs}: {exc}") from exc
    if not isinstance(env, Env):
        raise ValueError(
            f"env.name={cfg.name!r} made a {type(env).__name__}, which has no reset(seed) / "
            "step(action) (the Env protocol, gyre/envs/base.py)"
        )
    return lambda: factory(**kwargs)
