"""The maze seen as a picture: ``env.name=visual_maze``, a message-mode env with images.

Rules, budget, sparse reward, seeds, demonstrator and GiGPO state key are those of the text maze
(:mod:`gyre.envs.maze`): this env holds a :class:`~gyre.envs.maze.MazeEnv` (built from
``env.maze.*``) and passes every move to it, so the two agree move for move on the same seed.
Only the observation differs: each user message is an RGB image of the grid, then a short text.

The image (``env.visual_maze.*``): the ``size x size`` grid, each cell a ``cell_px`` square,
row 0 at the top, in the colours of :data:`COLOURS`: walls dark grey, free cells white, visited
cells light blue (``draw_visited``), the goal green, the agent a red square inset by a quarter of
a cell (over the goal colour on the final frame). The image is padded with the wall colour at the
bottom and right to a multiple of ``pad_to`` pixels (outside the grid reads as a wall, as ``#``
does in the text maze), so that a VLM processor that needs multiples of its merge unit (28 px for
Qwen2.5-VL: 2x2 patches of 14 px; 32 for Qwen3-VL) takes it without resizing. With the defaults
(``cell_px=14``, ``pad_to=28``) a 5x5 maze is an 84x84 image: one 14-px patch per cell, 9
merged tokens.

Messages (HF processor chat-template form)::

    reset: [{"role": "user", "content": [
               {"type": "image", "image": <PIL.Image.Image>},
               {"type": "text", "text": "A maze: ... Reach the goal in at most 8 moves. ..."}]}]
    step:  [{"role": "user", "content": [
               {"type": "image", "image": <PIL.Image.Image>},
               {"type": "text", "text": "You moved up. 7 moves left."}]}]

The action format is the text maze's: ``u``/``d``/``l``/``r`` (or the words), one per reply.
With ``describe`` the reply first says what the picture shows in the text maze's words (its
observation line, e.g. ``d3l2 d.R l.L r.UD>``), then the move: ``d3l2 d.R l.L r.UD> d``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gyre.envs.base import Message
from gyre.envs.maze import MazeEnv, parse_action

COLOURS: dict[str, tuple[int, int, int]] = {
    "wall": (64, 64, 64),
    "free": (255, 255, 255),
    "visited": (170, 200, 255),
    "goal": (0, 170, 0),
    "agent": (220, 0, 0),
    "line": (160, 160, 160),
}
_NAMES = {"u": "up", "d": "down", "l": "left", "r": "right"}


def pil_image(pixels: np.ndarray) -> Any:
    """An ``(H, W, 3)`` uint8 array as a ``PIL.Image.Image`` (Pillow: the ``vision`` extra)."""
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - Pillow ships with the test extras
        raise ImportError(
            "image envs need Pillow: pip install 'gyre[vision]' (or pip install pillow)"
        ) from exc
    return Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8), mode="RGB")


@dataclass(frozen=True)
class Drawing:
    """How a maze is drawn (the ``env.visual_maze`` keys of the same names; see the module
    docstring).

    ``view="agent"`` draws the ``(2 * radius + 1)``-cell square centred on the agent instead of
    the grid (cells outside the grid in the wall colour; ``radius=0``: ``size - 1``, so the
    whole maze is in view wherever the agent stands)."""

    cell_px: int = 14
    pad_to: int = 28
    draw_visited: bool = True
    grid_lines: bool = False
    view: str = "grid"
    radius: int = 0

    def __post_init__(self) -> None:
        if not 2 <= self.cell_px <= 64:
            raise ValueError(f"env.visual_maze.cell_px must lie in [2, 64], got {self.cell_px}")
        if self.pad_to < 0:
            raise ValueError(f"env.visual_maze.pad_to must be >= 0, got {self.pad_to}")
        if self.view not in ("grid", "agent"):
            raise ValueError(f"env.visual_maze.view must be 'grid' or 'agent', got {self.view!r}")
        if self.radius < 0:
            raise ValueError(f"env.visual_maze.radius must be >= 0, got {self.radius}")

    def image_side(self, size: int) -> int:
        """The image's height and width in pixels for a ``size x size`` maze."""
        cells = 2 * (self.radius or size - 1) + 1 if self.view == "agent" else None
        side = (cells or size) * self.cell_px
        return -(-side // self.pad_to) * self.pad_to if self.pad_to else side


def render_maze(maze: MazeEnv, drawing: Drawing | None = None) -> np.ndarray:
    """The maze's current state as an ``(H, W, 3)`` uint8 image, drawn as ``drawing`` says
    (default: :class:`Drawing`'s defaults); see the module docstring."""
    d = drawing if drawing is not None else Drawing()
    cell_px, pad_to, view, radius = d.cell_px, d.pad_to, d.view, d.radius
    grid = np.empty((maze.size, maze.size, 3), dtype=np.uint8)
    grid[:] = COLOURS["free"]
    if d.draw_visited:
        for r, c in maze.visited:
            grid[r, c] = COLOURS["visited"]
    grid[maze.walls] = COLOURS["wall"]
    grid[maze.goal] = COLOURS["goal"]
    if view == "agent":
        k = radius or maze.size - 1
        n = 2 * k + 1
        cells = np.empty((n, n, 3), dtype=np.uint8)
        cells[:] = COLOURS["wall"]
        pr, pc = maze.pos
        # window cell (i, j) is grid cell (pr - k + i, pc - k + j)
        r0, r1 = max(0, pr - k), min(maze.size, pr + k + 1)
        c0, c1 = max(0, pc - k), min(maze.size, pc + k + 1)
        cells[r0 - pr + k : r1 - pr + k, c0 - pc + k : c1 - pc + k] = grid[r0:r1, c0:c1]
        agent = (k, k)
    else:
        n, cells, agent = maze.size, grid, maze.pos
    # (n, n, 3) -> (n * cell_px, n * cell_px, 3): every cell a solid square
    img = np.repeat(np.repeat(cells, cell_px, axis=0), cell_px, axis=1)
    if d.grid_lines:
        img[::cell_px, :] = COLOURS["line"]
        img[:, ::cell_px] = COLOURS["line"]
    inset = max(1, cell_px // 4) if cell_px >= 4 else 0
    r0, c0 = agent[0] * cell_px + inset, agent[1] * cell_px + inset
    img[r0 : r0 + cell_px - 2 * inset, c0 : c0 + cell_px - 2 * inset] = COLOURS["agent"]
    side = n * cell_px
    if pad_to > 0 and side % pad_to:
        full = -(-side // pad_to) * pad_to
        padded = np.empty((full, full, 3), dtype=np.uint8)
        padded[:] = COLOURS["wall"]
        padded[:side, :side] = img
        img = padded
    return img


class VisualMazeEnv:
    """The text maze's episode, observed as images (see the module docstring)."""

    message_mode = True

    def __init__(
        self,
        maze: MazeEnv | None = None,
        drawing: Drawing | None = None,
        feedback: bool = True,
        text_observation: bool = False,
        image_last: bool = False,
        describe: bool = False,
    ) -> None:
        self.maze = maze if maze is not None else MazeEnv()
        self.drawing = drawing if drawing is not None else Drawing()
        self.feedback, self.text_observation = feedback, text_observation
        self.image_last = image_last
        self.describe = describe

    @property
    def image_side(self) -> int:
        """The image's height and width in pixels (fixed for a configuration)."""
        return self.drawing.image_side(self.maze.size)

    def pixels(self) -> np.ndarray:
        """The current state as an ``(H, W, 3)`` uint8 array."""
        return render_maze(self.maze, self.drawing)

    def _message(self, text: str, maze_text: str) -> list[Message]:
        if self.text_observation:
            text = f"{text}\n{maze_text}"
        content = [
            {"type": "image", "image": pil_image(self.pixels())},
            {"type": "text", "text": text},
        ]
        if self.image_last:  # the image right before the reply, at a fixed distance from it
            content.reverse()
        return [{"role": "user", "content": content}]

    def intro(self) -> str:
        """The opening text: what the colours mean, the budget and the action format."""
        visited = ", visited cells light blue" if self.drawing.draw_visited else ""
        centred = " (the picture is centred on you)" if self.drawing.view == "agent" else ""
        reply = (
            "Say what you see (the goal's offset, then the open moves), then one move"
            if self.describe
            else "Reply with one move"
        )
        return (
            f"A maze: walls dark grey, free cells white{visited}, you the red square{centred}, "
            "the goal "
            f"green. Reach the goal in at most {self.maze.budget} moves. {reply}: "
            "u (up), d (down), l (left) or r (right)."
        )

    def reset(self, seed: int) -> list[Message]:
        maze_text = self.maze.reset(seed)
        return self._message(self.intro(), maze_text)

    def step(self, action: str) -> tuple[list[Message], float, bool, dict[str, Any]]:
        if self.describe:  # "<what the picture shows> <move>": the move is the last word
            words = action.split()
            action = words[-1] if words else ""
        before = self.maze.pos
        maze_text, reward, done, info = self.maze.step(action)
        left = self.maze.budget - self.maze.moves
        if info["success"]:
            text = "You reached the goal."
        elif done:
            text = "Out of moves."
        else:
            text = f"{left} moves left." if left != 1 else "1 move left."
            if self.feedback:
                text = f"{self._said(action, before)} {text}"
        return self._message(text, maze_text), reward, done, info

    def _said(self, action: str, before: tuple[int, int]) -> str:
        move = parse_action(action)
        if move is None:
            return "Not a move: reply u, d, l or r."
        if self.maze.pos == before:
            return f"A wall {_NAMES[move]}: you did not move."
        return f"You moved {_NAMES[move]}."

    def state_key(self) -> tuple[int, int]:
        """The agent's cell (the text maze's key: turn-level credit, GiGPO)."""
        return self.maze.state_key()

    # -- demonstrations: the text maze's own demonstrator -------------------------------------
    def expert_action(self, rng: np.random.Generator) -> str:
        return self._reply(self.maze.expert_action(rng))

    def random_action(self, rng: np.random.Generator) -> str:
        return self._reply(self.maze.random_action(rng))

    def description(self) -> str:
        """What the picture shows, in the text maze's words (``describe``): its observation
        line as a later turn renders it."""
        return self.maze.render().strip()

    def _reply(self, move: str) -> str:
        return f"{self.description()} {move}" if self.describe else move


__all__ = ["COLOURS", "VisualMazeEnv", "pil_image", "render_maze"]
