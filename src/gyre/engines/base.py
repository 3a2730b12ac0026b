"""The engine protocol.

An engine is stateless as far as callers can tell: a request carries the *full* prompt token ids
every turn (this is what the OpenAI-compatible completions API of vLLM / SGLang takes, where
server-side prefix caching makes it cheap). An in-process engine may keep KV caches per
``session`` and reuse them when a new prompt extends the old one; results never depend on it.

Optional: ``generate_continuous(requests, params, on_complete)`` (``TorchEngine`` has it) lets
a finished completion's follow-up request join the running batch at once (continuous
batching); ``gyre.rollout.episodes.run_episodes`` uses it when present and falls back to
lockstep turns.
A request's ``seed`` keys its own random stream, so batching never changes its tokens.
An engine whose class sets ``per_request_temperature = True`` samples a request with its own
``temperature`` where set (``train.sampling.retry_temperature`` needs one).

Engines that take weights from files also have ``load_adapter(path, version)`` (a peft adapter
folder) and/or ``load_weights_from_disk(path, version)`` (a Hugging Face folder); both return
once the new version serves (see :mod:`gyre.engines.sync`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Protocol, runtime_checkable

import torch

from gyre.types import Completion, GenerationRequest, SamplingParams


@runtime_checkable
class Engine(Protocol):
    version: int
    """Policy version of the weights currently loaded (0 = initial)."""

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
