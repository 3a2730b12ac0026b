"""Transcripts: how one episode's turns become token ids, in each of the three rollout modes.

An :class:`~gyre.rollout.episodes.Episode` holds the row (ids, loss mask, log-probs); its
:class:`Transcript` says what the env's words are in ids and what the model is asked each turn:

- :class:`TextTranscript` -- a raw-text env: the observations' ids, the prompt is the whole row;
- :class:`WindowedTranscript` -- a raw-text env with ``rollout.history_turns``: the prompt is
  the episode's last turns (:mod:`gyre.rollout.window`), and each turn is a sample of its own;
- :class:`ChatTranscript` -- a message-mode env, rendered by the tokenizer's chat template
  (:mod:`gyre.rollout.chat`).

Only the policy's sampled ids enter the row as sampled; observations are encoded here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from gyre.rollout.chat import ChatEpisode, ChatMode
from gyre.rollout.window import Window, turn_sample
from gyre.types import Completion, Trajectory

End = dict[str, Any]  # what an ended episode's info gets ({} for none)


def encode_obs(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, first_obs: str) -> list[int]:
    ids = encode_obs(tokenizer, first_obs)
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + ids


def _memo(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn`` with its results kept per argument (callers copy lists before changing them)."""
    cache: dict[Any, Any] = {}

    def get(key: Any) -> Any:
        if key not in cache:
            cache[key] = fn(key)
        return cache[key]

    return get


class Codec:
    """One rollout's tokenizer calls. Texts repeat across a group (the same first observation G
    times, the same answers): each distinct one is encoded / decoded once per rollout (a
    tokenizer call costs ~50 us)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        bos = tokenizer.bos_token_id
        self.bos = [bos] if bos is not None else []
        self.pad = tokenizer.pad_token_id
        self.first_ids = _memo(lambda text: prompt_ids(tokenizer, text))
        self.encode = _memo(lambda text: encode_obs(tokenizer, text))
        self.decode = _memo(lambda key: tokenizer.decode(list(key), skip_special_tokens=True))


class Transcript(Protocol):
    """One episode's rendering; see the module docstring."""

    def start(self, first_obs: Any) -> list[int]:
        """The env's first observation -> the episode's first ids (mask 0)."""
        ...

    def prompt(self, ids: list[int]) -> list[int]:
        """The next turn's prompt, given the episode's row ``ids``."""
        ...

    def prompt_images(self) -> list[Any]:
        """The images of the next turn's prompt (a VLM's)."""
        ...

    def act(self, toks: Sequence[int], lps: Sequence[float], reason: str) -> str:
        """Record the sampled action (ids, log-probs, finish reason); return its text."""
        ...

    def answer(self, obs: Any, done: bool, turns: int, length: int) -> tuple[list[int], End | None]:
        """The env's answer after ``turns`` actions (the row holds ``length`` ids): the ids to
        append (mask 0) and None while the episode goes on, or what ends it."""
        ...

    def steps(self) -> list[Trajectory] | None:
        """The per-turn samples of a step-wise episode (None: the episode is one sample)."""
        ...

    def images(self) -> list[Any]:
        """Every image of the episode, in order."""
        ...


class TextTranscript:
    """A raw-text env: observations are encoded, the prompt is the whole row."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec

    def start(self, first_obs: Any) -> list[int]:
        return list(self.codec.first_ids(first_obs)) or [self.codec.pad]

    def prompt(self, ids: list[int]) -> list[int]:
        return ids

    def prompt_images(self) -> list[Any]:
        return []

    def act(self, toks: Sequence[int], lps: Sequence[float], reason: str) -> str:
        return self.codec.decode(tuple(toks))

    def answer(self, obs: Any, done: bool, turns: int, length: int) -> tuple[list[int], End | None]:
        if done:
            return [], {}
        return self.codec.encode(obs), None  # only read (extended into the row), never changed

    def steps(self) -> list[Trajectory] | None:
        return None

    def images(self) -> list[Any]:
        return []


class WindowedTranscript(TextTranscript):
    """A raw-text env seen through a window: each turn's prompt is the opening and the last
    turns (``segs``: [opening, action, answer, ...] ids), and each turn a sample of its own."""

    def __init__(self, codec: Codec, window: Window) -> None:
        super().__init__(codec)
        self.window = window
        self.segs: list[list[int]] = []
        self.samples: list[Trajectory] = []

    def start(self, first_obs: Any) -> list[int]:
        first = super().start(first_obs)
        bos = self.codec.bos
        self.segs.append(first[len(bos) :] if first[: len(bos)] == bos else first)
        return first

    def prompt(self, ids: list[int]) -> list[int]:
        return self.codec.bos + [t for seg in self.window.select(self.segs) for t in seg]

    def act(self, toks: Sequence[int], lps: Sequence[float], reason: str) -> str:
        self.samples.append(turn_sample(self.prompt([]), toks, lps, reason))
        self.segs.append(list(toks))
        return super().act(toks, lps, reason)

    def answer(self, obs: Any, done: bool, turns: int, length: int) -> tuple[list[int], End | None]:
        ids, end = super().answer(obs, done, turns, length)
        if end is None:
            self.segs.append(list(ids))
        return ids, end

    def steps(self) -> list[Trajectory] | None:
        return self.samples or None


class ChatTranscript:
    """A message-mode env: the conversation rendered by the chat template (:mod:`.chat`)."""

    def __init__(self, mode: ChatMode) -> None:
        self.mode = mode
        self.ep: ChatEpisode = mode.episode()

    def start(self, first_obs: Any) -> list[int]:
        return self.ep.start(first_obs)

    def prompt(self, ids: list[int]) -> list[int]:
        return self.ep.prompt(ids)  # step-wise: the turn's rendering (or its window)

    def prompt_images(self) -> list[Any]:
        return list(self.ep.prompt_images if self.ep.stepwise else self.ep.images)

    def act(self, toks: Sequence[int], lps: Sequence[float], reason: str) -> str:
        return self.ep.reply(Completion(list(toks), lps, reason))

    def answer(self, obs: Any, done: bool, turns: int, length: int) -> tuple[list[int], End | None]:
        return self.mode.advance(self.ep, obs, done, turns, length)

    def steps(self) -> list[Trajectory] | None:
        return self.ep.steps if self.ep.stepwise else None

    def images(self) -> list[Any]:
        return self.ep.images
