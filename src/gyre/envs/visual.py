"""The image envs' factory: ``env.name=visual_maze`` and ``env.name=minigrid`` (docs/vision.md).

Kept apart from :mod:`gyre.envs` so that MiniGrid (an optional extra) is imported only when a
run names it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gyre.envs.base import MessageEnv
from gyre.envs.maze import MazeEnv
from gyre.envs.visual_maze import Drawing, VisualMazeEnv

if TYPE_CHECKING:  # gyre.config imports gyre.envs.maze for its env section
    from gyre.config import EnvConfig


def image_env_factory(cfg: EnvConfig) -> Callable[[], MessageEnv]:
    """A zero-argument constructor for ``cfg.name`` (``visual_maze`` or ``minigrid``); one env
    is built now, so a missing extra or a bad env id fails before the first rollout."""
    if cfg.name == "visual_maze":
        m, v = cfg.maze, cfg.visual_maze

        def make_visual_maze() -> VisualMazeEnv:
            # MazeEnv.from_config reads every env.maze.* field: the rules stay the text maze's
            maze = MazeEnv.from_config(m)
            drawing = Drawing(v.cell_px, v.pad_to, v.draw_visited, v.grid_lines, v.view, v.radius)
            return VisualMazeEnv(
                maze, drawing, v.feedback, v.text_observation, v.image_last, v.describe
            )

        make_visual_maze()
        return make_visual_maze
    if cfg.name == "minigrid":
        from gyre.envs.minigrid import MiniGridEnv

        g = cfg.minigrid

        def make_minigrid() -> MiniGridEnv:
            return MiniGridEnv(g.env_id, g.max_steps, g.image, g.tile_size, g.reward)

        make_minigrid()
        return make_minigrid
    raise ValueError(f"env.name={cfg.name!r} is not an image env (visual_maze, minigrid)")
