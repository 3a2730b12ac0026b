"""Vision test kit: a coloured-square image env (message mode) and cached tiny VLM folders.

:class:`ColourEnv` shows a square of one of four colours on a random background position and
asks for its colour; with ``turns > 1`` each wrong answer gets a new image ("try again") until
the turn budget is spent. Reward 1 when a reply names the colour.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220),
           "yellow": (230, 220, 30)}  # fmt: skip


def square(colour: str, seed: int, size: int = 32) -> np.ndarray:
    """A ``size`` x ``size`` grey image with a ``size/2`` square of ``colour`` at a seeded spot."""
    rng = np.random.default_rng(seed)
    img = np.full((size, size, 3), 90, np.uint8)
    x, y = rng.integers(0, size // 2 + 1, size=2)
    img[y : y + size // 2, x : x + size // 2] = COLOURS[colour]
    return img


class ColourEnv:
    """Message mode: an image of a coloured square, 'Which colour is the square?'."""

    message_mode = True

    def __init__(self, turns: int = 2, size: int = 32, pil: bool = False) -> None:
        self.turns, self.size, self.pil = turns, size, pil

    def _image(self) -> Any:
        img = square(self.colour, self.seed * 10 + self.turn, self.size)
        if self.pil:
            from PIL import Image

            return Image.fromarray(img)
        return img

    def reset(self, seed: int) -> list[dict[str, Any]]:
        self.seed, self.turn = seed, 0
        self.colour = sorted(COLOURS)[seed % len(COLOURS)]
        return [{"role": "user", "content": [
            {"type": "image", "image": self._image()},
            {"type": "text", "text": "Which colour is the square?"},
        ]}]  # fmt: skip

    def step(self, action: str) -> tuple[list[dict[str, Any]], float, bool, dict[str, Any]]:
        self.turn += 1
        ok = self.colour in action.lower()
        if ok or self.turn >= self.turns:
            return [], float(ok) + 0.01 * min(len(action), 20), True, {"success": ok}
        msg = [{"role": "user", "content": [
            {"type": "text", "text": "No. Look again:"},
            {"type": "image", "image": self._image()},
        ]}]  # fmt: skip
        return msg, 0.0, False, {}


_FOLDERS: dict[str, Path] = {}


def tiny_vlm(kind: str, root: Path) -> Path:
    """The tiny ``kind`` VLM folder, built once per test session under ``root``."""
    from gyre.models.vision_build import create_tiny_vlm

    if kind not in _FOLDERS:
        _FOLDERS[kind] = create_tiny_vlm(kind, root / kind, seed=0)  # type: ignore[arg-type]
    return _FOLDERS[kind]


class ColourDemoEnv(ColourEnv):
    """:class:`ColourEnv` with a demonstrator (it names the colour), for SFT on images."""

    def expert_action(self, rng: np.random.Generator) -> str:
        return self.colour

    def random_action(self, rng: np.random.Generator) -> str:
        return sorted(COLOURS)[int(rng.integers(len(COLOURS)))]
