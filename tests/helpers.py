"""Test helpers shared by several files (tests/ is put on sys.path by conftest.py)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from gyre.types import Completion, GenerationRequest, SamplingParams


@dataclass
class Call:
    sessions: list[Hashable | None]
    prompts: list[list[int]]
    completions: list[Completion]


@dataclass
class RecordingEngine:
    """Engine proxy that records every request and completion.

    ``strip_sessions=True`` forwards requests without a session, so the inner engine can never
    reuse a KV cache (every call is a fresh prefill of the full prompt).
    """

    inner: object
    strip_sessions: bool = False
    calls: list[Call] = field(default_factory=list)
    released: list[Hashable] = field(default_factory=list)

    @property
    def version(self) -> int:
        return self.inner.version

    @version.setter
    def version(self, value: int) -> None:
        self.inner.version = value

    def generate(
        self, requests: list[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        fwd = [
            GenerationRequest(
                list(r.prompt_ids), None if self.strip_sessions else r.session, seed=r.seed
            )
            for r in requests
        ]
        outs = self.inner.generate(fwd, params)
        self.calls.append(
            Call([r.session for r in requests], [list(r.prompt_ids) for r in requests], outs)
        )
        return outs

    def release(self, sessions: Iterable[Hashable]) -> None:
        sessions = list(sessions)
        self.released.extend(sessions)
        self.inner.release(sessions)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.inner.load_weights(state_dict, version)

    def per_session(self) -> dict[Hashable, list[tuple[list[int], Completion]]]:
        """session -> [(prompt_ids, completion)] in call order."""
        out: dict[Hashable, list[tuple[list[int], Completion]]] = {}
        for call in self.calls:
            for s, p, c in zip(call.sessions, call.prompts, call.completions, strict=True):
                out.setdefault(s, []).append((p, c))
        return out
