"""Episodes: env x engine -> trajectories, token-in/token-out.

Every episode's token list starts with BOS and the first observation's ids. Each turn the engine
samples an action; its exact token ids (and logprobs) are appended with loss mask 1, the text is
decoded only to be handed to the env, and the next observation's ids are appended with mask 0.
The policy's own tokens are never re-tokenised, so the trainer scores exactly what was sampled.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from gyre.checkpoint.store import fault_point
from gyre.engines.base import Engine
from gyre.envs.base import Demonstrator, Env
from gyre.rollout.chat import ChatEpisode, ChatMode
from gyre.rollout.stops import cut_at_stop, derive_stops
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


def run_episodes(
    make_env: Callable[[], Env],
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    task_seeds: Sequence[int],
    group_size: int,
    params: SamplingParams,
    stats: RolloutStats | None = None,
    continuous: bool = True,
    chat: ChatMode | None = None,
    retry_temperature: float = 0.0,
    window: Window | None = None,
) -> list[Trajectory]:
    """Play ``group_size`` episodes of every task seed, all turns batched through ``engine``.

    Trajectory ``k * group_size + j`` is sample j of task k and has ``group_id == k``.
    With ``params.seed`` set, every turn of every episode gets its own request seed
    (:func:`turn_seed`), so the sampled tokens do not depend on how turns are batched.
    ``continuous`` (``perf.continuous``) uses the engine's ``generate_continuous`` where it
    has one; otherwise (or off) turns are batched in lockstep.
    ``chat``: the envs are message-mode ones, rendered by a chat template
    (:mod:`gyre.rollout.chat`; the marked ``message mode`` lines of :class:`_Episodes` are its
    whole hook).
    ``retry_temperature`` (``train.sampling.retry_temperature``, 0: off): a turn after one whose
    env info has ``invalid`` true is sampled at that temperature (the engine must have
    ``per_request_temperature``); ``info["retried_turns"]`` counts an episode's.
    ``window`` (``rollout.history_turns``, raw-text envs; message mode takes the chat mode's):
    each turn's prompt is the episode's window (:mod:`gyre.rollout.window`) and each turn a
    step-wise sample (``Trajectory.steps``).
    """
    t0 = time.perf_counter()
    if retry_temperature and not engine.features.per_request_temperature:
        raise ValueError(
            f"train.sampling.retry_temperature: engine {type(engine).__name__} cannot sample a "
            "request at its own temperature (no per_request_temperature)"
        )
    eps = _Episodes(
        make_env, tokenizer, task_seeds, group_size, params, chat, retry_temperature, window
    )
    start = [i for i in range(eps.n) if i not in eps.failed]  # episodes whose reset succeeded
    if continuous and engine.features.continuous:
        # Continuous batching: an episode's next turn joins the running batch the moment its
        # action is done, instead of waiting for every other episode's turn to finish.
        episode_of = list(start)

        def on_complete(index: int, out: Completion) -> GenerationRequest | None:
            i = episode_of[index]
            if not eps.finish_turn(i, out):
                engine.release([eps.sessions[i]])
                return None
            episode_of.append(i)
            return eps.request(i)

        if start:
            engine.generate_continuous([eps.request(i) for i in start], eps.params, on_complete)
    else:
        active = start
        while active:
            outs = engine.generate([eps.request(i) for i in active], eps.params)
            still = [i for i, out in zip(active, outs, strict=True) if eps.finish_turn(i, out)]
            kept = set(still)
            engine.release(eps.sessions[i] for i in active if i not in kept)
            active = still
    trajs = eps.trajectories(engine.version)
    if stats is not None:
        stats.seconds += time.perf_counter() - t0
        stats.generated_tokens += eps.gen_tokens
        stats.turns += sum(eps.turns)
        stats.failed_episodes += len(eps.failed)
    return trajs


class _Episodes:
    """The per-episode state of one :func:`run_episodes` call: token ids, loss masks, rollout
    log-probs, turn spans / states / rewards, infos, the envs and (message mode) the
    conversations. :meth:`request` builds an episode's next generation request,
    :meth:`finish_turn` appends a completion and the env's answer, :meth:`trajectories`
    assembles the result; both batching modes of :func:`run_episodes` drive the same two."""

    def __init__(
        self,
        make_env: Callable[[], Env],
        tokenizer: PreTrainedTokenizerBase,
        task_seeds: Sequence[int],
        group_size: int,
        params: SamplingParams,
        chat: ChatMode | None,
        retry_temperature: float,
        window: Window | None = None,
    ) -> None:
        self.task_seeds, self.group_size, self.chat = task_seeds, group_size, chat
        self.retry_temperature = retry_temperature
        self.window = window if chat is None else None  # raw mode; message mode: chat.window
        bos = tokenizer.bos_token_id
        self.bos = [bos] if bos is not None else []
        n = self.n = len(task_seeds) * group_size
        self.envs = [make_env() for _ in range(n)]
        self.sessions = [next(_SESSION_COUNTER) for _ in range(n)]
        self.ids: list[list[int]] = []
        self.mask: list[list[int]] = []
        self.lps: list[list[float]] = []
        self.infos: list[dict] = [{} for _ in range(n)]
        self.spans: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        self.states: list[list[Any]] = [[] for _ in range(n)]
        self.turn_r: list[list[float]] = [[] for _ in range(n)]
        self.failed: set[int] = set()
        self.retry = [False] * n  # the last action was invalid: the next at retry_temperature
        self.retried = [0] * n
        self.chats: list[ChatEpisode | None] = [None] * n  # message mode: the conversations
        # raw mode with a window: [opening, action, answer, ...] ids and the per-turn samples
        self.segs: list[list[list[int]]] = [[] for _ in range(n)]
        self.steps: list[list[Trajectory]] = [[] for _ in range(n)]
        # Texts repeat across a group (the same first observation G times, the same answers):
        # encode / decode each distinct one once per rollout (a tokenizer call costs ~50 us).
        first_ids = _memo(lambda text: prompt_ids(tokenizer, text))
        self.encode = _memo(lambda text: encode_obs(tokenizer, text))
        self.decode = _memo(lambda key: tokenizer.decode(list(key), skip_special_tokens=True))
        for k, seed in enumerate(task_seeds):
            for j in range(group_size):
                i = k * group_size + j
                try:
                    first_obs = self.envs[i].reset(int(seed))
                except Exception:
                    self.infos[i] = _env_failure(i, int(seed), "reset")
                    self.failed.add(i)
                    first_obs = ""
                self.states[i].append(initial_state(self.envs[i]))
                if chat is not None and i not in self.failed:  # message mode
                    self.chats[i] = chat.episode()
                    first = self.chats[i].start(first_obs)
                else:
                    first = list(first_ids(first_obs)) or [tokenizer.pad_token_id]
                    nb = len(self.bos) if first[: len(self.bos)] == self.bos else 0
                    self.segs[i].append(first[nb:])
                self.ids.append(first)
                self.mask.append([0] * len(first))
                self.lps.append([0.0] * len(first))
        self.reward = [0.0] * n
        self.turns = [0] * n
        self.truncated = [False] * n
        self.gen_tokens = 0
        self.base_seed = params.seed
        # Seed once per rollout: re-seeding every turn would replay the same random draws.
        self.params = replace(params, seed=None)

    def _prompt(self, i: int) -> list[int]:
        """Episode i's next prompt: its ids, a window of them, or (message mode) the chat's."""
        c = self.chats[i]
        if c is not None:
            return c.prompt(self.ids[i])  # message mode: step-wise or a window
        if self.window is None:
            return self.ids[i]
        return self.bos + [t for seg in self.window.select(self.segs[i]) for t in seg]

    def request(self, i: int) -> GenerationRequest:
        c = self.chats[i]
        prompt = self._prompt(i)
        seed = turn_seed(self.base_seed, i, self.turns[i])
        # a VLM's images of the prompt (step-wise: the turn prompt's)
        images = [] if c is None else list(c.prompt_images if c.stepwise else c.images)
        temp = self.retry_temperature if self.retry[i] else None
        return GenerationRequest(prompt, self.sessions[i], seed, images, temperature=temp)

    def finish_turn(self, i: int, out: Completion) -> bool:
        """Append the action and the env's answer to episode i; True if it goes on.

        An env that raises in ``step`` ends the episode as failed (see :func:`_env_failure`).
        """
        toks, reason = out.token_ids, out.finish_reason
        cut = cut_at_stop(toks, self.params.stop_strings, self.decode)
        if cut is not None:  # a stop string: keep the sampled ids up to the token completing it
            toks, reason = toks[:cut], "stop"
        if self.window is not None:  # raw mode, a window: this turn is its own sample
            self.steps[i].append(_turn_sample(self._prompt(i), toks, out.logprobs, reason))
            self.segs[i].append(list(toks))
        ids = self.ids[i]
        self.spans[i].append((len(ids), len(ids) + len(toks)))
        self._append(i, toks, 1, out.logprobs[: len(toks)])
        self.gen_tokens += len(toks)
        self.truncated[i] = reason == "length"
        c = self.chats[i]
        if c is None:
            text = self.decode(tuple(toks))
        else:  # message mode
            text = c.reply(Completion(list(toks), out.logprobs[: len(toks)], reason))
        self.turns[i] += 1
        try:
            fault_point("env.step")  # GYRE_FAULT=env.step:raise (tests): as if the env raised
            obs, r, done, info = self.envs[i].step(text)
        except Exception:
            self.infos[i] = _env_failure(i, int(self.task_seeds[i // self.group_size]), "step")
            self.failed.add(i)
            return False
        self.reward[i] += r
        self.turn_r[i].append(float(r))
        self.infos[i] = info
        self.retried[i] += self.retry[i]
        self.retry[i] = bool(self.retry_temperature and info.get("invalid"))
        if c is not None and self.chat is not None:  # message mode: the next suffix, or the end
            obs_ids, end = self.chat.advance(c, obs, done, self.turns[i], len(ids))
            if end is not None:
                self._append(i, obs_ids, 0)  # the template's closing glue (mask 0)
                self.infos[i] = {**info, **end}
                return False
        elif done:
            return False
        else:
            obs_ids = self.encode(obs)  # only read (extended into the row), never changed
        self.states[i].append(info.get("state"))  # the state the next turn's action starts from
        self._append(i, obs_ids, 0)
        if self.window is not None:
            self.segs[i].append(list(obs_ids))
        return True

    def _append(self, i: int, toks: Sequence[int], m: int, lps: Sequence[float] = ()) -> None:
        """Extend episode i by ``toks`` with loss mask ``m`` and log-probs ``lps`` (0 if none)."""
        self.ids[i].extend(toks)
        self.mask[i].extend([m] * len(toks))
        self.lps[i].extend(lps if m else [0.0] * len(toks))

    def trajectories(self, version: int) -> list[Trajectory]:
        """The episodes as trajectories (a failed one kept for the record, never trained on)."""
        infos = self.infos
        for i in self.failed:
            self.mask[i] = [0] * len(self.mask[i])
            self.reward[i] = 0.0
        if self.retry_temperature:
            infos = [{**info, "retried_turns": self.retried[i]} for i, info in enumerate(infos)]
        G, spans, chats = self.group_size, self.spans, self.chats
        return [
            Trajectory(
                token_ids=self.ids[i],
                loss_mask=self.mask[i],
                rollout_logprobs=self.lps[i],
                reward=self.reward[i],
                group_id=i // G,
                policy_version=version,
                num_turns=self.turns[i],
                success=bool(infos[i].get("success", False)),
                task_seed=int(self.task_seeds[i // G]),
                info=infos[i],
                truncated=self.truncated[i] or bool(infos[i].get("truncated_limit")),
                turn_spans=spans[i],
                turn_states=self.states[i][: len(spans[i])],
                turn_rewards=self.turn_r[i] + [0.0] * (len(spans[i]) - len(self.turn_r[i])),
                steps=None if i in self.failed else self.steps[i] or _steps(chats[i]),
                images=chats[i].images if chats[i] is not None else [],
            )
            for i in range(self.n)
        ]


def _turn_sample(
    prompt: Sequence[int], toks: Sequence[int], lps: Sequence[float], reason: str
) -> Trajectory:
    """One turn as a sample: the prompt it was sampled from (mask 0), then its ids (mask 1)."""
    p = list(prompt)
    return Trajectory(
        token_ids=p + list(toks), loss_mask=[0] * len(p) + [1] * len(toks),
        rollout_logprobs=[0.0] * len(p) + list(lps[: len(toks)]), reward=0.0, group_id=0,
        policy_version=-1, num_turns=1, success=False, task_seed=0,
        truncated=reason == "length",
    )  # fmt: skip


def initial_state(env: Env) -> Any:
    """The state key before the first action: the env's ``state_key()`` where it has one, else
    a constant (every episode of a group starts from the same ``reset(seed)``)."""
    key = getattr(env, "state_key", None)
    return key() if callable(key) else ("start",)


def _steps(ep: ChatEpisode | None) -> list[Trajectory] | None:
    """A step-wise message-mode episode's turn samples (None otherwise)."""
    return ep.steps if ep is not None and ep.stepwise else None


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


def demonstrate(
    make_env: Callable[[], Env],
    tokenizer: PreTrainedTokenizerBase,
    seed: int,
    noise: float,
    rng: np.random.Generator,
    train_on_noise: bool = False,
    terminator: Sequence[int] | None = None,
    chat: ChatMode | None = None,
    window: Window | None = None,
) -> Trajectory:
    """One noisy-expert episode, tokenised exactly as a rollout would be.

    With probability ``noise`` a turn's action is random instead of the expert's. The loss mask
    is 1 on expert actions; random ones are masked out unless ``train_on_noise`` (they still
    shape the states the demonstration visits, so SFT sees recoveries from mistakes). Every
    action ends with ``terminator``: the ids the rollout stops at (default: the derived
    :attr:`gyre.rollout.stops.Stops.terminator`, the newline where it is one token; in message
    mode the chat template's end-of-turn token).

    ``chat``: a message-mode env, rendered through the rollout's own :class:`ChatEpisode` and
    :meth:`ChatMode.advance` (see :func:`_demonstrate_chat`).
    ``window`` (raw mode; message mode: the chat mode's): each turn is also a sample of its own
    (``steps``), its prompt the window a rollout would have given the model, its mask the
    turn's (0 on a random move unless ``train_on_noise``).
    """
    env = make_env()
    if not isinstance(env, Demonstrator):
        raise TypeError(f"{type(env).__name__} cannot demonstrate (no expert_action/random_action)")
    if chat is not None:
        return _demonstrate_chat(env, chat, seed, noise, rng, train_on_noise, terminator)
    newline = list(derive_stops(tokenizer).terminator if terminator is None else terminator)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    first = encode_obs(tokenizer, env.reset(seed))
    ids = bos + first
    mask = [0] * len(ids)
    segs, steps = [first], []
    total, turns, info = 0.0, 0, {}
    while True:
        noisy = rng.random() < noise
        text = env.random_action(rng) if noisy else env.expert_action(rng)
        act = encode_obs(tokenizer, text) + newline
        m = 0 if noisy and not train_on_noise else 1
        if window is not None:
            prompt = bos + [t for seg in window.select(segs) for t in seg]
            steps.append(_turn_sample(prompt, act, [0.0] * len(act), "stop"))
            steps[-1].loss_mask[len(prompt) :] = [m] * len(act)
        ids += act
        mask += [m] * len(act)
        obs, r, done, info = env.step(text)
        total += r
        turns += 1
        if done:
            break
        obs_ids = encode_obs(tokenizer, obs)
        ids += obs_ids
        mask += [0] * len(obs_ids)
        segs += [act, obs_ids]
    return Trajectory(
        token_ids=ids,
        loss_mask=mask,
        rollout_logprobs=[0.0] * len(ids),
        reward=total,
        group_id=0,
        policy_version=-1,
        num_turns=turns,
        success=bool(info.get("success", False)),
        task_seed=seed,
        info=info,
        steps=steps or None,
    )


def _demonstrate_chat(
    env: Any,
    chat: ChatMode,
    seed: int,
    noise: float,
    rng: np.random.Generator,
    train_on_noise: bool,
    terminator: Sequence[int] | None,
) -> Trajectory:
    """A message-mode demonstration: the demonstrator's replies go through the very code a
    rollout's sampled replies go through (:meth:`ChatEpisode.reply`, then
    :meth:`ChatMode.advance` for the env's answer, its images expanded once), so the ids, the
    loss mask and the images are what :func:`run_episodes` would record had the policy sampled
    those replies (each the tokenizer's encoding of the text, then the end-of-turn token). The
    loss mask is 1 on the replies and their terminator only; the template's glue and every
    observation (image tokens included) are 0. The whole conversation is one sample, as
    without ``rollout.stepwise``; with a window (``chat.window``) each turn is a sample too
    (``steps``), its prompt the turn's window."""
    tpl = chat.template
    end = list(terminator) if terminator is not None else [tpl.end_id]
    ep = ChatEpisode(tpl, stepwise=chat.window is not None, window=chat.window)
    ids = ep.start(env.reset(seed))
    mask = [0] * len(ids)
    total, turns, info = 0.0, 0, {}
    while True:
        noisy = rng.random() < noise
        text = env.random_action(rng) if noisy else env.expert_action(rng)
        act = tpl.encode(text) + end
        m = 0 if noisy and not train_on_noise else 1
        ids += act
        mask += [m] * len(act)
        ep.reply(Completion(act, [0.0] * len(act), "stop"))
        if ep.stepwise:
            step = ep.steps[-1]
            step.loss_mask[len(step.loss_mask) - len(act) :] = [m] * len(act)
        msgs, r, done, info = env.step(text)
        total += r
        turns += 1
        obs_ids, stop = chat.advance(ep, msgs, done, turns, len(ids))
        ids += obs_ids
        mask += [0] * len(obs_ids)
        if stop is not None:
            info = {**info, **stop}
            break
    return Trajectory(
        token_ids=ids, loss_mask=mask, rollout_logprobs=[0.0] * len(ids), reward=total,
        group_id=0, policy_version=-1, num_turns=turns,
        success=bool(info.get("success", False)), task_seed=seed, info=info,
        images=list(ep.images), steps=ep.steps or None,
    )  # fmt: skip
