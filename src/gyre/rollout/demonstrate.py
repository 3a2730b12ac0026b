"""Demonstrations for SFT: an env's noisy expert plays an episode, tokenised exactly as a
rollout would tokenise it (the same observation encoding, stops and chat rendering)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

import numpy as np
from transformers import PreTrainedTokenizerBase

from gyre.envs.base import Demonstrator, Env
from gyre.rollout.chat import ChatEpisode, ChatMode
from gyre.rollout.stops import derive_stops
from gyre.rollout.transcript import encode_obs
from gyre.rollout.window import Window, turn_sample
from gyre.types import Completion, Trajectory


class DemoOptions(TypedDict, total=False):
    """:func:`demonstrate`'s keyword options (see its docstring)."""

    train_on_noise: bool
    terminator: Sequence[int] | None
    chat: ChatMode | None
    window: Window | None


def demonstrate(
    make_env: Callable[[], Env],
    tokenizer: PreTrainedTokenizerBase,
    seed: int,
    noise: float,
    rng: np.random.Generator,
    **options: Unpack[DemoOptions],
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
    train_on_noise, terminator = options.get("train_on_noise", False), options.get("terminator")
    chat, window = options.get("chat"), options.get("window")
    env = make_env()
    if not isinstance(env, Demonstrator):
        raise TypeError(f"{type(env).__name__} cannot demonstrate (no expert_action/random_action)")
    if chat is not None:
        return _demonstrate_chat(env, chat, seed, noise, rng, train_on_noise, terminator)
    newline = list(derive_stops(tokenizer).terminator if terminator is None else terminator)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    first = encode_obs(tokenizer, env.reset(seed))
    demo = _Demo(bos + first)
    segs, steps = [first], []
    while True:
        noisy = rng.random() < noise
        text = env.random_action(rng) if noisy else env.expert_action(rng)
        act = encode_obs(tokenizer, text) + newline
        m = 0 if noisy and not train_on_noise else 1
        if window is not None:
            prompt = bos + [t for seg in window.select(segs) for t in seg]
            steps.append(turn_sample(prompt, act, [0.0] * len(act), "stop"))
            steps[-1].loss_mask[len(prompt) :] = [m] * len(act)
        demo.add(act, m)
        obs, done = demo.step(env, text)
        if done:
            break
        obs_ids = encode_obs(tokenizer, obs)
        demo.add(obs_ids, 0)
        segs += [act, obs_ids]
    return demo.trajectory(seed, steps)


@dataclass
class _Demo:
    """A demonstration's row so far (ids, loss mask), its return, turns and last info."""

    ids: list[int]
    mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.mask = [0] * len(self.ids)

    def add(self, toks: Sequence[int], m: int) -> None:
        self.ids += toks
        self.mask += [m] * len(toks)

    def step(self, env: Any, action: str) -> tuple[Any, bool]:
        """The env's answer to ``action``: (observation, done)."""
        obs, r, done, self.info = env.step(action)
        self.reward += r
        self.turns += 1
        return obs, done

    def trajectory(
        self, seed: int, steps: list[Trajectory], images: Sequence[Any] = ()
    ) -> Trajectory:
        return Trajectory(
            token_ids=self.ids,
            loss_mask=self.mask,
            rollout_logprobs=[0.0] * len(self.ids),
            reward=self.reward,
            group_id=0,
            policy_version=-1,
            num_turns=self.turns,
            success=bool(self.info.get("success", False)),
            task_seed=seed,
            info=self.info,
            images=list(images),
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
    demo = _Demo(ep.start(env.reset(seed)))
    while True:
        noisy = rng.random() < noise
        text = env.random_action(rng) if noisy else env.expert_action(rng)
        act = tpl.encode(text) + end
        m = 0 if noisy and not train_on_noise else 1
        demo.add(act, m)
        ep.reply(Completion(act, [0.0] * len(act), "stop"))
        if ep.stepwise:
            step = ep.steps[-1]
            step.loss_mask[len(step.loss_mask) - len(act) :] = [m] * len(act)
        msgs, done = demo.step(env, text)
        obs_ids, stop = chat.advance(ep, msgs, done, demo.turns, len(demo.ids))
        demo.add(obs_ids, 0)
        if stop is not None:
            demo.info = {**demo.info, **stop}
            break
    return demo.trajectory(seed, ep.steps, ep.images)
