"""The visual maze as a gymnasium env: ``gymnasium.make("gyre/VisualMaze-v0")``.

Importing this module registers the id (gymnasium is the optional ``gymnasium`` extra), so
either ``import gyre.envs.gym_visual`` first or let gymnasium import it:
``gymnasium.make("gyre.envs.gym_visual:gyre/VisualMaze-v0")``.

- Observation: the rendered maze, ``Box(0, 255, (H, W, 3), uint8)``, exactly the image
  ``env.name=visual_maze`` shows (:func:`gyre.envs.visual_maze.render_maze`).
- Actions: ``Discrete(4)``: 0 up, 1 down, 2 left, 3 right.
- Reward 1.0 on reaching the goal (``terminated``); ``truncated`` when the move budget is spent
  without reaching it. ``info`` is the text maze's (``success``, ``moves``, ``budget``, ...).
- ``render_mode="rgb_array"``: ``render()`` returns the observation.
- ``reset(seed=s)`` draws the maze of seed ``s``, the same maze ``env.name=maze`` plays for that
  seed; ``reset()`` without a seed draws one from the env's ``np_random``.

Keyword arguments: the maze's (``size``, ``wall_density``, ``min_distance``, ``budget_factor``:
:class:`gyre.envs.maze.MazeConfig`) and the rendering's (``cell_px``, ``pad_to``,
``draw_visited``, ``grid_lines``, ``view``, ``radius``: :class:`gyre.config.VisualMazeConfig`),
with those sections' defaults and checks: the same maze and image as a run's ``env.maze`` /
``env.visual_maze``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from gyre.config.visual import VisualMazeConfig
from gyre.envs.maze import MOVES, MazeConfig, MazeEnv
from gyre.envs.visual_maze import Drawing, render_maze

try:
    import gymnasium
    from gymnasium import spaces
except ImportError as exc:
    raise ImportError("gyre/VisualMaze-v0 needs gymnasium: pip install 'gyre[gymnasium]'") from exc

ENV_ID = "gyre/VisualMaze-v0"
ACTION_MOVES = tuple(MOVES)  # Discrete index -> the text maze's move letter: u, d, l, r
MAZE_KEYS = ("size", "wall_density", "min_distance", "budget_factor")
RENDER_KEYS = ("cell_px", "pad_to", "draw_visited", "grid_lines", "view", "radius")


class VisualMazeGymEnv(gymnasium.Env):
    """The visual maze behind gymnasium's API (see the module docstring)."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 4}

    def __init__(self, render_mode: str | None = "rgb_array", **kwargs: Any) -> None:
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode must be 'rgb_array' or None, got {render_mode!r}")
        unknown = sorted(set(kwargs) - {*MAZE_KEYS, *RENDER_KEYS})
        if unknown:
            valid = ", ".join(MAZE_KEYS + RENDER_KEYS)
            raise TypeError(f"{ENV_ID}: unknown keyword {unknown}; valid: {valid}")
        maze = MazeConfig(**{k: v for k, v in kwargs.items() if k in MAZE_KEYS})
        render = VisualMazeConfig(**{k: v for k, v in kwargs.items() if k in RENDER_KEYS})
        self.maze = MazeEnv(maze.size, maze.wall_density, maze.min_distance, maze.budget_factor)
        self.drawing = Drawing(**render.model_dump(include=set(RENDER_KEYS)))
        self.render_mode = render_mode
        side = render_maze(self.maze, self.drawing).shape[0]
        self.observation_space = spaces.Box(0, 255, (side, side, 3), dtype=np.uint8)
        self.action_space = spaces.Discrete(len(ACTION_MOVES))

    def _obs(self) -> np.ndarray:
        return render_maze(self.maze, self.drawing)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        maze_seed = seed if seed is not None else int(self.np_random.integers(0, 2**31))
        self.maze.reset(maze_seed)
        info = {"budget": self.maze.budget, "shortest": self.maze.shortest, "seed": maze_seed}
        return self._obs(), info

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        a = int(action)
        if not 0 <= a < len(ACTION_MOVES):
            raise ValueError(f"action must lie in Discrete(4) (0 up, 1 down, 2 left, 3 right): {a}")
        _, reward, done, info = self.maze.step(ACTION_MOVES[a])
        terminated = bool(info["success"])
        return self._obs(), float(reward), terminated, bool(done and not terminated), info

    def render(self) -> np.ndarray | None:
        return self._obs() if self.render_mode == "rgb_array" else None


if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point=VisualMazeGymEnv)
