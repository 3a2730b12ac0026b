"""The image-producing envs' sections: ``env.visual_maze`` (rendering) and ``env.minigrid``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gyre.config.base import Section


class VisualMazeConfig(Section):
    """How ``env.name=visual_maze`` draws the maze; the maze itself is ``env.maze.*``."""

    cell_px: int = Field(
        14,
        ge=2,
        le=64,
        description="Side of one maze cell in pixels (14: one ViT patch of Qwen2.5-VL; 16: "
        "Qwen3-VL).",
    )
    pad_to: int = Field(
        28,
        ge=0,
        le=256,
        description="Pad the image (wall colour, bottom and right) to a multiple of this many "
        "pixels, so a VLM processor need not resize it (28: Qwen2.5-VL's 2x2 merge of 14-px "
        "patches; 32: Qwen3-VL's); 0: no padding.",
    )
    draw_visited: bool = Field(
        True, description="Draw the cells visited in this episode in their own colour."
    )
    grid_lines: bool = Field(
        False, description="Draw a one-pixel grey line along the top and left of every cell."
    )
    view: Literal["grid", "agent"] = Field(
        "grid",
        description="grid: the whole grid, row 0 at the top; agent: a square of cells centred "
        "on the agent (egocentric, as MiniGrid's partial view), cells outside the grid drawn "
        "as walls.",
    )
    radius: int = Field(
        0,
        ge=0,
        le=32,
        description="view=agent: cells shown on each side of the agent; 0: size - 1, so the "
        "whole maze is in view wherever the agent stands (a 5x5 maze: 9x9 cells).",
    )
    feedback: bool = Field(
        True,
        description="Each later turn's text says what the last move did (moved, hit a wall, "
        "not a move) and the moves left; false: only the moves left.",
    )
    text_observation: bool = Field(
        False,
        description="Also give the text maze's own observation (env.maze.observation) in the "
        "text, for ablations: pixels plus text against pixels alone.",
    )
    describe: bool = Field(
        False,
        description="The reply first says what the picture shows, in the text maze's words (its "
        "env.maze.observation line after the first turn, e.g. 'd3l2 d.R l.L r.UD>'), then the "
        "move: only the reply's last word is the action. The demonstrator writes the true "
        "line, so SFT supervises reading the picture token by token, not only the move; "
        "rollouts need max_new_tokens for the line (about 25 with exits).",
    )
    image_last: bool = Field(
        False,
        description="Put the image after the text in each user message, right before the "
        "reply: its tokens then sit a fixed distance from the answer whatever the text's "
        "length (false: the image first, then the text).",
    )


class MiniGridConfig(Section):
    """``env.name=minigrid``: a MiniGrid env (the ``minigrid`` extra) seen as RGB images."""

    env_id: str = Field(
        "MiniGrid-Empty-5x5-v0",
        min_length=1,
        description="A registered MiniGrid env id, e.g. MiniGrid-Empty-5x5-v0, "
        "MiniGrid-DoorKey-5x5-v0.",
    )
    max_steps: int = Field(
        0,
        ge=0,
        le=10_000,
        description="Steps before the episode is truncated (a failure); 0: the env's own "
        "default (4 x size^2 for Empty).",
    )
    image: Literal["partial", "full"] = Field(
        "partial",
        description="partial: the agent's 7x7 egocentric view (RGBImgPartialObsWrapper); "
        "full: the whole grid with the agent drawn (RGBImgObsWrapper).",
    )
    tile_size: int = Field(
        8, ge=2, le=64, description="Pixels per grid tile in the rendered image."
    )
    reward: Literal["env", "success"] = Field(
        "env",
        description="env: MiniGrid's own reward (1 - 0.9 x steps / max_steps on success, else "
        "0); success: 1.0 on success, else 0.",
    )
