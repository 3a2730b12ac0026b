"""Episodes: env x engine -> trajectories, token-in/token-out.

Every episode's token list starts with BOS and the first observation's ids. Each turn the engine
samples an action; its exact token ids (and logprobs) are appended with loss mask 1, the text is
decoded only to be handed to the env, and the next observation's ids are appended with mask 0.
The policy's own tokens are never re-tokenised, so the trainer scores exactly what was sampled.

One :class:`Episode` per episode holds its row and what the env said; its
:class:`~gyre.rollout.transcript.Transcript` (text, windowed text or chat) says how turns become
ids. :func:`run_episodes` schedules their turns through the engine.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict, Unpack

from transformers import PreTrainedTokenizerBase

from gyre.checkpoint.store import fault_point
from gyre.engines.base import Engine
from gyre.envs.base import Env
from gyre.rollout.chat import ChatMode
from gyre.rollout.stops import cut_at_stop, derive_stops
from gyre.rollout.transcript import (
    ChatTranscript,
    Codec,
    TextTranscript,
    Transcript,
    WindowedTranscript,
)
from gyre.rollout.window import Window
from gyre.types import Completion, GenerationRequest, SamplingParams, Trajectory

_SESSION_COUNTER = iter(range(1 << 62))
_log = logging.getLogger("gyre.rollout.episodes")


@dataclass
class RolloutStats:
    seconds: float = 0.0
    generated_tokens: int = 0
    turns: int = 0
    failed_episodes: int = 0  # episodes whose env raised (see run_episodes)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


def stop_ids(
    tokenizer: PreTrainedTokenizerBase, stop_tokens: Sequence[str] = ()
) -> tuple[int, ...]:
    """The ids that end an action: ``stop_tokens`` (``rollout.stop_tokens``) or, by default, the
    end-of-turn token, EOS and the newline where it is one token (:mod:`gyre.rollout.stops`)."""
    return derive_stops(tokenizer, stop_tokens).token_ids


def turn_seed(base: int | None, episode: int, turn: int) -> int | None:
    """The request seed of (episode, turn) in a rollout seeded with ``base`` (None: unseeded)."""
    if base is None:
        return None
    # A keyed hash, not numpy's SeedSequence: the same independence for this use (distinct
    # inputs, unrelated 62-bit outputs) at ~1 us instead of ~10 us, 64+ times per rollout.
    raw = struct.pack("<QQQ", base % 2**63, episode, turn)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 2


class EpisodeOptions(TypedDict, total=False):
    """:func:`run_episodes`' keyword options."""

    continuous: bool  # perf.continuous: the engine's generate_continuous where it has one
    chat: ChatMode | None  # message-mode envs, rendered by a chat template
    retry_temperature: float  # train.sampling.retry_temperature (0: off)
    window: Window | None  # rollout.history_turns (raw-text envs)
    group_ids: Sequence[int] | None  # each task's group id (default: its index)


def run_episodes(
    make_env: Callable[[], Env],
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    task_seeds: Sequence[int],
    group_size: int,
    params: SamplingParams,
    stats: RolloutStats | None = None,
    **options: Unpack[EpisodeOptions],
) -> list[Trajectory]:
    """Play ``group_size`` episodes of every task seed, all turns batched through ``engine``.

    Trajectory ``k * group_size + j`` is sample j of task k and has ``group_id ==
    group_ids[k]`` (default ``k``). With ``params.seed`` set, every turn of every episode gets
    its own request seed (:func:`turn_seed`), so the sampled tokens do not depend on how turns
    are batched. Options (:class:`EpisodeOptions`):
    ``continuous`` (``perf.continuous``, default on) uses the engine's ``generate_continuous``
    where it has one (``engine.features.continuous``); otherwise turns are batched in lockstep.
    ``chat``: the envs are message-mode ones, rendered by a chat template
    (:mod:`gyre.rollout.chat`, through :class:`~gyre.rollout.transcript.ChatTranscript`).
    ``retry_temperature`` (``train.sampling.retry_temperature``, 0: off): a turn after one whose
    env info has ``invalid`` true is sampled at that temperature (the engine must have
    ``per_request_temperature``); ``info["retried_turns"]`` counts an episode's.
    ``window`` (``rollout.history_turns``, raw-text envs; message mode takes the chat mode's):
    each turn's prompt is the episode's window (:mod:`gyre.rollout.window`) and each turn a
    step-wise sample (``Trajectory.steps``).
    """
    t0 = time.perf_counter()
    retry = options.get("retry_temperature", 0.0)
    if retry and not engine.features.per_request_temperature:
        raise ValueError(
            f"train.sampling.retry_temperature: engine {type(engine).__name__} cannot sample a "
            "request at its own temperature (no per_request_temperature)"
        )
    play = _Play(Codec(tokenizer), params, retry, options.get("chat"), options.get("window"))
    groups = options.get("group_ids") or range(len(task_seeds))
    episodes = play.start(make_env, task_seeds, group_size, groups)
    live = [e for e in episodes if not e.failed]  # episodes whose reset succeeded
    if options.get("continuous", True) and engine.features.continuous:
        _continuous(engine, play, live)
    else:
        _lockstep(engine, play, live)
    trajs = [e.trajectory(engine.version, bool(retry)) for e in episodes]
    if stats is not None:
        stats.seconds += time.perf_counter() - t0
        stats.generated_tokens += sum(e.generated for e in episodes)
        stats.turns += sum(e.turns for e in episodes)
        stats.failed_episodes += sum(e.failed for e in episodes)
    return trajs


def _continuous(engine: Engine, play: _Play, live: list[Episode]) -> None:
    """Continuous batching: an episode's next turn joins the running batch the moment its
    action is done, instead of waiting for every other episode's turn to finish."""
    episode_of = list(live)

    def on_complete(index: int, out: Completion) -> GenerationRequest | None:
        e = episode_of[index]
        if not e.finish_turn(play, out):
            engine.release([e.session])
            return None
        episode_of.append(e)
        return e.request(play)

    if live:
        engine.generate_continuous([e.request(play) for e in live], play.params, on_complete)


def _lockstep(engine: Engine, play: _Play, active: list[Episode]) -> None:
    """Every live episode's turn in one batch, until none goes on."""
    while active:
        outs = engine.generate([e.request(play) for e in active], play.params)
        still = [e for e, out in zip(active, outs, strict=True) if e.finish_turn(play, out)]
        kept = set(map(id, still))
        engine.release(e.session for e in active if id(e) not in kept)
        active = still


class _Play:
    """What the episodes of one :func:`run_episodes` call share."""

    def __init__(
        self,
        codec: Codec,
        params: SamplingParams,
        retry_temperature: float,
        chat: ChatMode | None,
        window: Window | None,
    ) -> None:
        self.codec, self.retry_temperature, self.chat = codec, retry_temperature, chat
        self.window = window if chat is None else None  # raw mode; message mode: chat.window
        self.base_seed = params.seed
        # Seed once per rollout: re-seeding every turn would replay the same random draws.
        self.params = replace(params, seed=None)

    def transcript(self) -> Transcript:
        if self.chat is not None:
            return ChatTranscript(self.chat)
        if self.window is not None:
            return WindowedTranscript(self.codec, self.window)
        return TextTranscript(self.codec)

    def start(
        self,
        make_env: Callable[[], Env],
        task_seeds: Sequence[int],
        group_size: int,
        group_ids: Sequence[int],
    ) -> list[Episode]:
        """Every episode, reset (an env that raises in ``reset`` fails its episode)."""
        n = len(task_seeds) * group_size
        envs = [make_env() for _ in range(n)]
        sessions = [next(_SESSION_COUNTER) for _ in range(n)]
        out = []
        for i, env in enumerate(envs):
            k = i // group_size
            seed, info, transcript, failed = int(task_seeds[k]), {}, self.transcript(), False
            try:
                first_obs = env.reset(seed)
            except Exception:
                info, first_obs, failed = _env_failure(i, seed, "reset"), "", True
                transcript = TextTranscript(self.codec)  # a placeholder row
            first = transcript.start(first_obs)
            e = Episode(i, seed, group_ids[k], env, transcript, sessions[i], first, info)
            e.failed = failed
            e.turn_states.append(initial_state(env))
            out.append(e)
        return out


@dataclass
class Episode:
    """One episode: its row (ids, loss mask, the sampler's log-probs), its turns and what the
    env said. :meth:`request` asks for its next action; :meth:`finish_turn` records it and
    the env's answer; :meth:`trajectory` is the result."""

    index: int  # in the rollout: its request seeds key on it
    task_seed: int
    group_id: int
    env: Env
    transcript: Transcript
    session: int
    ids: list[int]
    info: dict[str, Any]
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    turn_states: list[Any] = field(default_factory=list)  # the state each action starts from
    turn_rewards: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    generated: int = 0
    truncated: bool = False
    failed: bool = False
    retry: bool = False  # the last action was invalid: the next at retry_temperature
    retried: int = 0

    def __post_init__(self) -> None:
        self.mask = [0] * len(self.ids)
        self.logprobs = [0.0] * len(self.ids)

    def request(self, play: _Play) -> GenerationRequest:
        prompt = self.transcript.prompt(self.ids)
        seed = turn_seed(play.base_seed, self.index, self.turns)
        temp = play.retry_temperature if self.retry else None
        images = self.transcript.prompt_images()  # a VLM's (step-wise: the turn prompt's)
        return GenerationRequest(prompt, self.session, seed, images, temperature=temp)

    def finish_turn(self, play: _Play, out: Completion) -> bool:
        """Append the action and the env's answer; True if the episode goes on.

        An env that raises in ``step`` ends the episode as failed (see :func:`_env_failure`).
        """
        toks, reason = out.token_ids, out.finish_reason
        cut = cut_at_stop(toks, play.params.stop_strings, play.codec.decode)
        if cut is not None:  # a stop string: keep the sampled ids up to the token completing it
            toks, reason = toks[:cut], "stop"
        lps = out.logprobs[: len(toks)]
        self.turn_spans.append((len(self.ids), len(self.ids) + len(toks)))
        self.append(toks, 1, lps)
        self.generated += len(toks)
        self.truncated = reason == "length"
        text = self.transcript.act(toks, lps, reason)
        self.turns += 1
        try:
            fault_point("env.step")  # GYRE_FAULT=env.step:raise (tests): as if the env raised
            obs, r, done, info = self.env.step(text)
        except Exception:
            self.info, self.failed = _env_failure(self.index, self.task_seed, "step"), True
            return False
        self.reward += r
        self.turn_rewards.append(float(r))
        self.info = info
        self.retried += self.retry
        self.retry = bool(play.retry_temperature and info.get("invalid"))
        obs_ids, end = self.transcript.answer(obs, done, self.turns, len(self.ids))
        if end is not None:
            self.append(obs_ids, 0)  # a chat template's closing glue (mask 0)
            self.info = {**info, **end} if end else info
            return False
        self.turn_states.append(info.get("state"))  # the state the next action starts from
        self.append(obs_ids, 0)
        return True

    def append(self, toks: Sequence[int], m: int, lps: Sequence[float] = ()) -> None:
        """Extend the row by ``toks`` with loss mask ``m`` and log-probs ``lps`` (0 if none)."""
        self.ids.extend(toks)
        self.mask.extend([m] * len(toks))
        self.logprobs.extend(lps if m else [0.0] * len(toks))

    def trajectory(self, version: int, count_retries: bool) -> Trajectory:
        """The episode as a trajectory (a failed one kept for the record, never trained on)."""
        info = {**self.info, "retried_turns": self.retried} if count_retries else self.info
        spans = self.turn_spans
        return Trajectory(
            token_ids=self.ids,
            loss_mask=[0] * len(self.mask) if self.failed else self.mask,
            rollout_logprobs=self.logprobs,
            reward=0.0 if self.failed else self.reward,
            group_id=self.group_id,
            policy_version=version,
            num_turns=self.turns,
            success=bool(info.get("success", False)),
            task_seed=self.task_seed,
            info=info,
            truncated=self.truncated or bool(info.get("truncated_limit")),
            turn_spans=spans,
            turn_states=self.turn_states[: len(spans)],
            turn_rewards=self.turn_rewards + [0.0] * (len(spans) - len(self.turn_rewards)),
            steps=None if self.failed else self.transcript.steps(),
            images=self.transcript.images(),
        )


def initial_state(env: Env) -> Any:
    """The state key before the first action: the env's ``state_key()`` where it has one, else
    a constant (every episode of a group starts from the same ``reset(seed)``)."""
    key = getattr(env, "state_key", None)
    return key() if callable(key) else ("start",)


def _env_failure(episode: int, seed: int, where: str) -> dict:
    """Log an env exception with its traceback and return the failed episode's info.

    The episode ends there with reward 0 and an all-zero loss mask (nothing is learned from
    it); ``info["failed"]`` marks it so the loop can count failures against
    ``faults.max_failed_fraction``.
    """
    tb = traceback.format_exc()
    _log.warning(
        "env %s raised in episode %d (task seed %d); episode marked failed:\n%s",
        where,
        episode,
        seed,
        tb,
    )
    return {"success": False, "failed": True, "error": tb.strip().splitlines()[-1]}


_MOVED = {
    "demonstrate": "gyre.rollout.demonstrate",
    "encode_obs": "gyre.rollout.transcript",
    "prompt_ids": "gyre.rollout.transcript",
}


def __getattr__(name: str) -> Any:
    """Names that moved out of this module: kept one version, with a DeprecationWarning."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    warnings.warn(
        f"gyre.rollout.episodes.{name} moved to {_MOVED[name]}.{name}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(_MOVED[name]), name)
