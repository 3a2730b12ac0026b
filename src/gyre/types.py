"""Boundary types shared by rollout, engines and the trainer.

Token alignment convention (used everywhere): for a sequence ``token_ids`` of length T, position t
holds token t; ``loss_mask[t]`` says whether token t was written by the policy, and
``rollout_logprobs[t]`` is the sampler's log-probability of token t given tokens ``< t`` (0.0 where
the mask is 0). Position 0 is always a prompt token, so its mask is always 0.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """How an engine samples. ``temperature == 0`` means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0  # also return the k most likely tokens' logprobs at every step
    # Texts that end a turn; the rollout cuts the sampled ids after the token completing one
    # (gyre.rollout.stops.cut_at_stop), so engines need not support them.
    stop_strings: tuple[str, ...] = ()
    top_k: int = 0  # sample from the k most likely tokens only (ties with the k-th kept); 0: off


@dataclass
class GenerationRequest:
    """One prompt for an engine. ``session`` names a multi-turn episode so an engine may reuse
    the KV cache of a previous call whose tokens this prompt extends (a pure optimisation: the
    result never depends on it)."""

    prompt_ids: list[int]
    session: Hashable | None = None
    seed: int | None = None
    """Per-request sampling seed. An engine that honours it draws this request's tokens from a
    stream keyed only by (seed, token index), so the result does not depend on which other
    requests share the batch, on their order, or on batch scheduling. ``None``: the engine draws
    a seed from its own generator (reseeded by ``SamplingParams.seed``)."""
    images: list[Any] = field(default_factory=list)
    """A VLM's images (HxWx3 uint8 arrays), one per image placeholder run in ``prompt_ids``,
    in order (docs/vision.md). Empty for text prompts."""
    temperature: float | None = None
    """This request's sampling temperature in place of ``SamplingParams.temperature`` (an
    engine with ``per_request_temperature``; ``train.sampling.retry_temperature``). ``None``:
    the batch's."""


@dataclass
class Completion:
    """What an engine returns for one request."""

    token_ids: list[int]  # (N,) generated tokens, including a stop token if one was hit
    logprobs: list[float]  # (N,) log-prob of each token under the distribution sampled from
    finish_reason: str  # "stop" or "length"
    top_logprobs: list[dict[int, float]] | None = None  # (N,) k best {token id: logprob}, if asked


@dataclass
class Trajectory:
    """One episode, token-in/token-out: the exact ids the engine produced plus the observation
    ids the rollout appended, never re-tokenised."""

    token_ids: list[int]  # (T,)
    loss_mask: list[int]  # (T,) 1 exactly on policy-generated tokens
    rollout_logprobs: list[float]  # (T,) sampler log-probs on generated tokens, 0.0 elsewhere
    reward: float
    group_id: int  # trajectories of the same task share a group id
    policy_version: int  # version of the weights that generated every token
    num_turns: int
    success: bool
    task_seed: int
    info: dict[str, Any] = field(default_factory=dict)
    truncated: bool = False  # the episode's last completion hit max_new_tokens (no stop token)
    traj_id: str = ""  # unique in a run ("<task index>:<sample>") where a runner assigns it
    # Per turn k (empty where the producer does not record turns, e.g. demonstrations):
    # turn_spans[k] = [start, end) of turn k's sampled tokens in token_ids; turn_states[k] = the
    # env's hashable state key *before* turn k's action (None where the env exposes none);
    # turn_rewards[k] = the env reward of turn k's step. Used by the turn-level estimators.
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    turn_states: list[Hashable] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    steps: list[Trajectory] | None = None
    """Step-wise samples (``rollout.stepwise``): one per assistant turn, its prompt as the chat
    template rendered that turn, mask 1 on that turn's sampled ids. When set, the trainer trains
    on these instead of ``token_ids`` (each gets this episode's reward, group and advantage;
    ``gyre.trainer.stepwise``); ``token_ids`` stays the whole episode, for rewards and logs."""
    images: list[Any] = field(default_factory=list)
    """A VLM episode's images (HxWx3 uint8 arrays), one per run of image tokens in
    ``token_ids``, in order: with the ids they re-create the exact model inputs (pixel values,
    grids, positions; :class:`gyre.models.vision.VisionIO`). Empty for text episodes."""

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)
