"""An episode's images drawn as one frame strip: what ``samples.jsonl`` / ``gyre report`` show.

For image envs (message mode, docs/vision.md) the frames are the images in the env's user
messages: the opening observation, then one after each action. :func:`replay_frames` rebuilds
them from the task seed and the actions the policy took (the episode is a pure function of the
seed, so the replay is what the policy saw); :func:`frame_strip` lays them left to right, each
with a caption under it (``start``, then ``1 u``, ``2 r``, ...: the turn and the action taken),
as PNG bytes; :func:`png_data_uri` makes those an ``<img src=...>`` / JSON-friendly string::

    frames = replay_frames(make_env(), task_seed, actions)
    uri = png_data_uri(frame_strip(frames, strip_captions(actions)))

Needs Pillow (the ``vision`` extra). Nothing here imports an env or a model.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

_BG = (255, 255, 255)
_INK = (0, 0, 0)
_CAPTION_PX = 12  # caption band under each frame (the default bitmap font is ~11 px tall)


def _pil() -> Any:
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError as exc:  # pragma: no cover - Pillow ships with the test extras
        raise ImportError("frame strips need Pillow: pip install 'gyre[vision]'") from exc
    return Image, ImageDraw, ImageFont


def message_images(messages: Sequence[dict[str, Any]]) -> list[Any]:
    """The images of ``messages``, in order: every ``{"type": "image", "image": ...}`` part of a
    list ``content`` (string contents have none)."""
    out = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            out += [p["image"] for p in content if isinstance(p, dict) and p.get("type") == "image"]
    return out


def replay_frames(env: Any, seed: int, actions: Sequence[str]) -> list[Any]:
    """Reset ``env`` (a message-mode env) to ``seed``, replay ``actions``, and return the images
    it showed: the opening ones, then those after each action, until the episode ends."""
    frames = message_images(env.reset(seed))
    for a in actions:
        new, _, done, _ = env.step(a)
        frames += message_images(new)
        if done:
            break
    return frames


def strip_captions(actions: Sequence[str], max_chars: int = 8) -> list[str]:
    """``["start", "1 u", "2 r", ...]``: one caption per frame of a replayed episode (long or
    multi-line actions are cut to ``max_chars``)."""
    cut = [" ".join(a.split())[:max_chars] for a in actions]
    return ["start", *[f"{i} {a}" for i, a in enumerate(cut, 1)]]


def frame_strip(
    frames: Sequence[Any],
    captions: Sequence[str] | None = None,
    scale: int = 1,
    gap: int = 2,
    max_frames: int = 0,
) -> bytes:
    """``frames`` (PIL images or ``(H, W, 3)`` uint8 arrays) side by side as PNG bytes.

    Each frame is enlarged ``scale`` times (nearest neighbour, so cells stay sharp), separated
    by ``gap`` white pixels; with ``captions`` (one per frame) a 12-pixel caption band sits
    under each. ``max_frames`` > 0 keeps the first ``max_frames - 1`` frames and the last one.
    The strip is as tall as the tallest frame; smaller frames sit at the top left of their slot.
    """
    Image, ImageDraw, ImageFont = _pil()
    if not frames:
        raise ValueError("frame_strip needs at least one frame")
    if captions is not None and len(captions) != len(frames):
        raise ValueError(f"frame_strip got {len(frames)} frames but {len(captions)} captions")
    if scale < 1 or gap < 0:
        raise ValueError(f"frame_strip needs scale >= 1 and gap >= 0, got {scale} and {gap}")
    idx = list(range(len(frames)))
    if 0 < max_frames < len(frames):
        idx = [*idx[: max_frames - 1], idx[-1]]
    imgs = []
    for i in idx:
        f = frames[i]
        img = (
            f.convert("RGB") if hasattr(f, "convert") else Image.fromarray(np.asarray(f, np.uint8))
        )
        imgs.append(img.resize((img.width * scale, img.height * scale), Image.NEAREST))
    band = _CAPTION_PX if captions is not None else 0
    width = sum(im.width for im in imgs) + gap * (len(imgs) - 1)
    height = max(im.height for im in imgs) + band
    strip = Image.new("RGB", (width, height), _BG)
    draw = ImageDraw.Draw(strip)
    font = ImageFont.load_default()
    x = 0
    for i, im in zip(idx, imgs, strict=True):
        strip.paste(im, (x, 0))
        if captions is not None:
            draw.text((x + 1, height - band), str(captions[i]), fill=_INK, font=font)
        x += im.width + gap
    buf = io.BytesIO()
    strip.save(buf, format="PNG")
    return buf.getvalue()


def png_data_uri(png: bytes) -> str:
    """``data:image/png;base64,...``: PNG bytes as a string for HTML or JSON."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
