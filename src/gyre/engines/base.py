"""The engine protocol.

An engine is stateless as far as callers can tell: a request carries the *full* prompt token ids
every turn (this is what the OpenAI-compatible completions API of vLLM / SGLang takes, where
server-side prefix caching makes it cheap). An in-process engine may keep KV caches per
``session`` and reuse them when a new prompt extends the old one; results never depend on it.

An engine's class declares what it offers beyond the three methods below as
``features = EngineFeatures(...)`` (:class:`EngineFeatures`); callers read that record and never
probe attributes:

- ``continuous``: ``generate_continuous(requests, params, on_complete)`` lets a finished
  completion's follow-up request join the running batch at once (continuous batching);
  ``gyre.rollout.episodes.run_episodes`` uses it when present and falls back to lockstep turns.
- ``per_request_temperature``: a request is sampled with its own ``temperature`` where set
  (``train.sampling.retry_temperature`` needs it).
- ``in_process``: ``model`` is the policy module the engine runs (its config gives the context
  and vocab) and ``generator`` the sampler's random stream (checkpointed for exact resume).
- ``remote``: a client of servers: ``close()`` frees its connections, and ``adopt(path,
  version, lora)`` points it at weights a trainer gave the servers.

A request's ``seed`` keys its own random stream, so batching never changes its tokens.
Engines that take weights from files also have ``load_adapter(path, version)`` (a peft adapter
folder) and/or ``load_weights_from_disk(path, version)`` (a Hugging Face folder); both return
once the new version serves (see :mod:`gyre.engines.sync`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from gyre.types import Completion, GenerationRequest, SamplingParams


@dataclass(frozen=True)
class EngineFeatures:
    """What an engine offers beyond :class:`Engine`'s methods (see the module docstring)."""

    continuous: bool = False
    per_request_temperature: bool = False
    in_process: bool = False
    remote: bool = False


@runtime_checkable
class Engine(Protocol):
    version: int
    """Policy version of the weights currently loaded (0 = initial)."""

    features: EngineFeatures
    """What this engine offers beyond these methods; a class attribute."""

    def generate(
        self, requests: list[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        """Sample a completion for every request, in order."""
        ...

    def release(self, sessions: Iterable[Hashable]) -> None:
        """Forget any cached state of finished sessions."""
        ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the weights (weight sync from the trainer) and stamp ``version``."""
        ...
