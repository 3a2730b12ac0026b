"""A bounded history (``rollout.history_turns``): what each turn's prompt holds of the episode.

By default a multi-turn episode is one growing context: turn t's prompt is the opening
observation and every earlier action and observation. With ``rollout.history_turns = k`` each
turn's prompt is instead built afresh from

- the opening observation (``rollout.keep_opening``, on by default: an env's first message often
  states the task; a chat conversation's system messages are kept either way),
- the last ``k`` exchanges (an action and the env's answer to it) before the current observation,
- the current observation,

as agent frameworks that bound the memory do (verl-agent's ``history_length``, the GiGPO paper's
ALFWorld / WebShop runs). ``k = 0`` is a memoryless policy: it acts on the current observation
alone. Every turn is then its own training sample (:attr:`gyre.types.Trajectory.steps`, as with
``rollout.stepwise``), whose prompt is exactly what the engine was given at that turn; the
episode's full transcript is still recorded (samples, reports) but never trained on as one row.

Segments: an episode is ``[opening, action_1, answer_1, ..., action_t, answer_t]``; a turn's
prompt is the concatenation of :meth:`Window.select` of them (ids in raw-text mode, message
lists in message mode).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from gyre.types import Trajectory

T = TypeVar("T")


@dataclass(frozen=True)
class Window:
    """``turns`` earlier exchanges kept in a turn's prompt, and the opening (``keep_opening``)."""

    turns: int
    keep_opening: bool = True

    def __post_init__(self) -> None:
        if self.turns < 0:
            raise ValueError(f"rollout.history_turns must be >= 0, got {self.turns}")

    def select(self, segments: Sequence[T]) -> list[T]:
        """The segments a turn's prompt holds, in order (see the module docstring).

        ``segments`` = ``[opening, action_1, answer_1, ..., action_t, answer_t]`` (odd length).
        """
        if len(segments) % 2 != 1:
            raise ValueError(f"a window needs [opening, (action, answer)*], got {len(segments)}")
        tail = 2 * self.turns + 1
        if len(segments) <= tail:
            return list(segments)
        kept = list(segments[-tail:])
        return [segments[0], *kept] if self.keep_opening else kept


def window_of(rollout: Any) -> Window | None:
    """``rollout.history_turns`` / ``keep_opening`` (a :class:`RolloutConfig`) as a Window."""
    k = rollout.history_turns
    return None if k is None else Window(int(k), bool(rollout.keep_opening))


def message_segments(conv: Sequence[dict[str, Any]]) -> tuple[list[Any], list[list[Any]]]:
    """A conversation as (system messages, segments): the opening is every message before the
    first assistant one (system messages apart); then each assistant message is one segment and
    each run of other messages (the env's answer, tool results) another."""
    system = [m for m in conv if m.get("role") == "system"]
    rest = [m for m in conv if m.get("role") != "system"]
    segments: list[list[Any]] = [[]]
    for m in rest:
        if m.get("role") == "assistant":
            segments.extend([[m], []])
        else:
            segments[-1].append(m)
    return system, segments


def window_messages(window: Window, conv: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages of a turn's prompt: the system messages, then the selected segments."""
    system, segments = message_segments(conv)
    return system + [m for seg in window.select(segments) for m in seg]


def turn_sample(
    prompt: Sequence[int],
    toks: Sequence[int],
    lps: Sequence[float],
    reason: str,
    images: Sequence[Any] = (),
) -> Trajectory:
    """One turn as a sample of its own: the prompt it was sampled from (mask 0, with its
    ``images``), then its ids (mask 1)."""
    p = list(prompt)
    return Trajectory(
        token_ids=p + list(toks),
        loss_mask=[0] * len(p) + [1] * len(toks),
        rollout_logprobs=[0.0] * len(p) + list(lps[: len(toks)]),
        reward=0.0,
        group_id=0,
        policy_version=-1,
        num_turns=1,
        success=False,
        task_seed=0,
        truncated=reason == "length",
        images=list(images),
    )
