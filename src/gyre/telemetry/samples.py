"""Sample trajectories: a fraction of each step's episodes to ``<run.dir>/samples.jsonl``.

Curves say that the reward moved; samples say why. Each line is one episode:

``step``, ``index`` (position in the step's batch), ``group_id``, ``task_seed``,
``policy_version``, ``reward``, ``success``, ``turns``, ``response_tokens``, ``text`` (the whole
episode decoded: observations and the policy's actions, as the model saw them) and ``actions``
(the policy's text of each turn), both without special tokens; ``text_special`` (the same
episode decoded with its special tokens, e.g. a chat template's ``<|im_start|>`` /
``<|im_end|>``), ``token_ids`` and ``loss_mask`` (1 on the policy's tokens), so what the
template and the policy produced can be checked token by token. A non-finite number (a NaN
reward) is written as ``null``, so every line is strict JSON. Maze episodes also carry
``maze``: ``size``, ``walls`` (rows of ``#``/``.``), ``start``, ``goal``, ``budget``,
``shortest`` and ``positions`` (the agent's cell after each action), which is what
``gyre report`` draws step by step. The maze is rebuilt from ``task_seed`` and the actions
replayed through the env (its optional ``render_episode`` hook, :class:`EpisodeRenderer`; any
env may offer one), so the drawing is what the env did.

Image episodes (``Trajectory.images``, docs/vision.md): the first ``frames`` written episodes
of a step (``telemetry.sample_frames``) also get ``frames``: ``file`` (a PNG strip, relative to
the run directory: ``frames/step_000010_0003.png`` for step 10, batch index 3), ``count`` and
``captions`` (``start``, ``1 u``, ...). The strip (:func:`gyre.telemetry.frames.frame_strip`)
shows every image the policy saw, then the frame after its last move, each under the action
that led to it; the images are kept out of ``samples.jsonl`` itself, so it stays small.

The episodes are chosen by a generator seeded from (run seed, step): the same run writes the
same samples, and choosing them never touches the training RNG streams.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from gyre.types import Trajectory

STREAM_SAMPLES = 7


def action_spans(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of policy tokens: one per turn (observations sit between)."""
    spans, start = [], None
    for i, m in enumerate(loss_mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(loss_mask)))
    return spans


def finite_json(obj: Any) -> Any:
    """``obj`` with every NaN / inf float replaced by None: strict JSON (no bare ``NaN``)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_json(v) for v in obj]
    return obj


@runtime_checkable
class EpisodeRenderer(Protocol):
    """An env's optional hook for ``samples.jsonl``: ``render_episode(seed, actions)`` replays
    the episode and returns the JSON fields to add to its record, plus ``success`` (the
    replay's outcome; the fields are kept only where it matches the episode's). The maze
    returns ``{"maze": ..., "success": ...}``, which the report draws."""

    def render_episode(self, seed: int, actions: Sequence[str]) -> dict[str, Any]: ...


class SampleWriter:
    """Appends the chosen episodes of each step to ``samples.jsonl`` (flushed per step)."""

    def __init__(
        self,
        path: str | Path,
        fraction: float,
        tokenizer: Any,
        make_env: Callable[[], Any] | None = None,
        seed: int = 0,
        frames: int = 0,
    ) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"telemetry.samples must lie in [0, 1], got {fraction}")
        self.path = Path(path)
        self.fraction = fraction
        self.tokenizer = tokenizer
        self.make_env = make_env
        self.seed = seed
        self.frames = frames
        self._f = None

    def choose(self, step: int, n: int) -> list[int]:
        """Indices of the episodes written for ``step``: ceil(fraction * n), at least one
        when the fraction is positive."""
        k = min(n, math.ceil(self.fraction * n)) if self.fraction > 0 else 0
        if k == 0:
            return []
        rng = np.random.default_rng([self.seed, STREAM_SAMPLES, step])
        return sorted(int(i) for i in rng.choice(n, size=k, replace=False))

    def record(self, step: int, index: int, t: Trajectory) -> dict[str, Any]:
        spans = action_spans(t.loss_mask)
        actions = [
            self.tokenizer.decode(t.token_ids[a:b], skip_special_tokens=True) for a, b in spans
        ]
        rec: dict[str, Any] = {
            "step": step,
            "index": index,
            "group_id": t.group_id,
            "task_seed": t.task_seed,
            "policy_version": t.policy_version,
            "reward": t.reward,
            "success": bool(t.success),
            "turns": t.num_turns,
            "response_tokens": t.num_generated,
            "text": self.tokenizer.decode(t.token_ids, skip_special_tokens=True),
            "actions": actions,
            "text_special": self.tokenizer.decode(t.token_ids, skip_special_tokens=False),
            "token_ids": list(t.token_ids),
            "loss_mask": list(t.loss_mask),
        }
        env = self.make_env() if self.make_env is not None else None
        # One mask run per turn holds for the built-in envs; if a turn's tokens were merged or
        # the replay disagrees with the episode's outcome, draw nothing rather than a wrong one.
        if isinstance(env, EpisodeRenderer) and len(actions) == t.num_turns:
            fields = env.render_episode(t.task_seed, [a.strip() for a in actions])
            if fields.pop("success", None) == bool(t.success):
                rec.update(fields)
        return rec

    def draw(self, step: int, index: int, t: Trajectory, actions: list[str]) -> dict[str, Any]:
        """Episode ``t``'s frame strip, written next to ``samples.jsonl``; its record entry.

        The frames are the trajectory's own images (what the policy saw), plus the frame after
        the last move where a replay of the env from the task seed shows the same images first
        (:func:`gyre.telemetry.frames.replay_frames`); otherwise the trajectory's images alone.
        """
        from gyre.telemetry.frames import frame_strip, replay_frames, strip_captions

        frames = list(t.images)
        if self.make_env is not None:
            try:
                replay = replay_frames(self.make_env(), t.task_seed, [a.strip() for a in actions])
            except Exception:  # an env the actions cannot replay (e.g. tool calls): no extra
                replay = []
            same = len(replay) == len(frames) + 1 and all(
                np.array_equal(np.asarray(a), b) for a, b in zip(replay, frames, strict=False)
            )
            if same:
                frames.append(np.asarray(replay[-1]))
        captions = strip_captions(actions)[: len(frames)]
        captions += [""] * (len(frames) - len(captions))
        scale = max(1, round(96 / max(1, frames[0].shape[0])))  # at least ~96 px a frame
        rel = Path("frames") / f"step_{step:06d}_{index:04d}.png"
        out = self.path.parent / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(frame_strip(frames, captions, scale=scale))
        return {"file": rel.as_posix(), "count": len(frames), "captions": captions}

    def write(self, step: int, trajs: Sequence[Trajectory]) -> int:
        """Write this step's chosen episodes; returns how many."""
        idx = self.choose(step, len(trajs))
        if not idx:
            return 0
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = self.path.open("a", encoding="utf-8")
        drawn = 0
        for i in idx:
            rec = self.record(step, i, trajs[i])
            if trajs[i].images and drawn < self.frames:
                rec["frames"] = self.draw(step, i, trajs[i], rec["actions"])
                drawn += 1
            rec = finite_json(rec)
            self._f.write(json.dumps(rec, allow_nan=False) + "\n")
        self._f.flush()
        return len(idx)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
