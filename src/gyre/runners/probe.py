"""The sync check of a Ray run's in-process engines (``engine.kind=torch`` in rollout workers).

The check is the one :mod:`gyre.engines.verify` runs on a local run's engine and on HTTP servers:
a fixed probe sequence scored by the engine (prompt log-probs) against the trainer's log-probs
at the version it was sent. Here the two sides live in different processes, so the trainer's
side rides with the weights: rank 0 adds the probe's ids and its log-probs at the new version
to the state dict it puts in the object store (two small tensors under reserved keys); each
rollout worker takes them out before loading, loads, scores the probe with its own model and
stops the run (exit 3, :class:`~gyre.engines.verify.SyncNotApplied`) naming itself, the version
and the gap when its engine does not serve what it was sent. The cost is one forward of
``engine.verify_tokens`` tokens on each side per checked sync; ``engine.verify_every`` bounds it
(by version). Under FSDP2 every trainer rank scores the probe (the sharded forward is a
collective that gathers each layer's weights), and rank 0's copy rides with the weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gyre.config import Config
from gyre.engines.verify import (
    SyncVerifier,
    mean_gap,
    model_prompt_logprobs,
    placeholder_ids,
    probe_ids,
)

IDS_KEY = "__gyre_probe_ids__"  # (n,) int64: the probe sequence
LOGPROBS_KEY = "__gyre_probe_logprobs__"  # (n-1,) float64: the trainer's prompt log-probs


def with_probe(
    cfg: Config,
    state: dict[str, torch.Tensor],
    model: torch.nn.Module,
    tokenizer: Any,
    version: int,
) -> dict[str, torch.Tensor]:
    """``state`` plus the trainer's probe at ``version`` when this version is checked."""
    every = cfg.engine.verify_every
    if not every or version % every or cfg.engine.kind != "torch":
        return state
    vocab = model.get_input_embeddings().num_embeddings
    ids = probe_ids(
        tokenizer, vocab, cfg.engine.verify_tokens, cfg.run.seed, placeholder_ids(model)
    )
    want = model_prompt_logprobs(model, ids)
    return {
        **state,
        IDS_KEY: torch.tensor(ids, dtype=torch.long),
        LOGPROBS_KEY: torch.tensor(want, dtype=torch.float64),
    }


class WorkerProbe:
    """A rollout worker's side: split the probe off the weights, then check its engine."""

    def __init__(self, tolerance: float) -> None:
        self.verifier = SyncVerifier(None, [], 1, tolerance)  # judge only: no engine of its own
        self.last_gap: float | None = None

    @staticmethod
    def split(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any]:
        """(the weights to load, the probe or None)."""
        weights = {k: v for k, v in state.items() if k not in (IDS_KEY, LOGPROBS_KEY)}
        if IDS_KEY not in state:
            return weights, None
        return weights, (state[IDS_KEY].tolist(), state[LOGPROBS_KEY].tolist())

    def check(self, model: torch.nn.Module, name: str, version: int, probe: Any) -> None:
        """Raise :class:`~gyre.engines.verify.SyncNotApplied` unless ``model`` (the engine's,
        just loaded) serves the trainer's policy ``version``."""
        ids, want = probe
        got = model_prompt_logprobs(model, ids)
        gap = mean_gap(got, want)
        self.verifier.judge(name, version, gap, got)
        self.verifier.reference = (version, want)
        self.last_gap = gap
