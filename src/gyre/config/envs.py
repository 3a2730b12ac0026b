"""The ``env`` section, built from a registry of the built-in envs' own sections.

Each built-in env declares its settings once, as a section class in a small module of its own
(``gyre.config.maze``, ``gyre.config.adapters``, ``gyre.config.visual``, ``gyre.config.run``):
the envs import their sections, never the other way round. The core
config knows them only through :data:`ENV_SECTIONS`: one entry per built-in ``env.name``, whose
section is ``env.<name>``. Adding a built-in env is one entry here.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, create_model, field_validator, model_validator

from gyre.config.adapters import GymnasiumConfig, ReasoningGymConfig
from gyre.config.base import Section
from gyre.config.maze import MazeChatConfig, MazeConfig
from gyre.config.run import ArithmeticConfig, DatasetConfig
from gyre.config.visual import MiniGridConfig, VisualMazeConfig

# env.name -> (its section class, the section's one-line description)
ENV_SECTIONS: dict[str, tuple[type[Section], str]] = {
    "maze": (MazeConfig, "Maze settings (gyre.envs.maze)."),
    "arithmetic": (ArithmeticConfig, "Arithmetic settings."),
    "dataset": (DatasetConfig, "Prompt-dataset (JSONL / JSON / Parquet / Arrow) settings."),
    "gymnasium": (GymnasiumConfig, "gymnasium adapter settings."),
    "reasoning_gym": (ReasoningGymConfig, "reasoning-gym adapter settings."),
    "visual_maze": (VisualMazeConfig, "Visual maze rendering (the maze itself is env.maze.*)."),
    "minigrid": (MiniGridConfig, "MiniGrid adapter settings."),
    "maze_chat": (MazeChatConfig, "The text maze in chat messages (the maze is env.maze.*)."),
}
BUILTIN_ENVS = tuple(ENV_SECTIONS)


class _EnvBase(Section):
    name: str = Field(
        "maze",
        description="A built-in env (maze, arithmetic, dataset, gymnasium, reasoning_gym, "
        "visual_maze, minigrid, maze_chat), a name given to gyre.envs.register, an import path "
        "'module:Class' or a file path 'envs.py:Class' "
        "(docs/envs.md).",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of a plug-in env's class or factory (built-in envs "
        "take their own sections instead).",
    )

    @field_validator("name")
    @classmethod
    def _env_name(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError("empty; give a built-in env, a registered name or 'module:Class'")
        mod, sep, attr = v.rpartition(":")
        if sep and (not mod.strip() or not attr.strip()):
            raise ValueError(f"expected 'module:Class' or 'file.py:Class', got {v!r}")
        from gyre.plugins import ENV_REGISTRY

        if not sep and v not in BUILTIN_ENVS and v not in ENV_REGISTRY:
            raise ValueError(
                f"unknown env; valid: {', '.join([*BUILTIN_ENVS, *sorted(ENV_REGISTRY)])}, a "
                "name given to gyre.envs.register, 'module:Class' or 'file.py:Class'"
            )
        return v

    @model_validator(mode="after")
    def _kwargs_for_plugins(self) -> _EnvBase:
        if self.kwargs and self.name in BUILTIN_ENVS:
            raise ValueError(
                f"env.kwargs is for plug-in envs; the built-in env {self.name!r} takes "
                f"env.{self.name}.* settings"
            )
        return self


EnvConfig: Any = create_model(
    "EnvConfig",
    __base__=_EnvBase,
    __module__=__name__,
    __doc__="The env: ``env.name`` and one section per built-in env (:data:`ENV_SECTIONS`).",
    **{
        name: (cls, Field(default_factory=cls, description=doc))
        for name, (cls, doc) in ENV_SECTIONS.items()
    },
)
