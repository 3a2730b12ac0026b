"""Build the rollout engine and its weight sync from ``cfg.engine`` (called by the loop)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from gyre.config import Config, PerfConfig
from gyre.engines.credentials import resolve_api_key
from gyre.engines.engine_options import EngineOptions
from gyre.engines.sync import WeightSync
from gyre.engines.torch_engine import TorchEngine
from gyre.models.vision import vision_of


def torch_engine_options(perf: PerfConfig) -> EngineOptions:
    """:class:`TorchEngine` options of a run's ``perf:`` section (every in-process engine of a
    run is built with them: the loop's, the Ray rollout workers', ``gyre eval``)."""
    return EngineOptions(
        prefix_sharing=perf.prefix_sharing,
        compaction=perf.compaction,
        compact_min=perf.compact_min,
        compile_decode=perf.compile_decode,
        lean_forward=perf.engine_lean_forward,
        shared_prefix_attention=perf.shared_prefix_attention,
    )


def run_torch_engine(cfg: Config, model: torch.nn.Module, tokenizer: Any) -> TorchEngine:
    """The in-process engine of a run on ``model`` as given: the run's seed, its ``perf:``
    options and the tokenizer's image side (None for text models). Every in-process engine of a
    run is built here: the loop's, the Ray rollout workers', ``gyre eval``'s."""
    return TorchEngine(
        model,
        tokenizer.pad_token_id,
        seed=cfg.run.seed,
        vision=vision_of(tokenizer),
        options=torch_engine_options(cfg.perf),
    )


def engine_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The in-process engine's copy of the policy. Frozen parameters (a LoRA run's base) are
    shared with ``model``, not copied: neither side ever writes them (the optimizer steps
    the trainable ones, and a weight sync copies only those), so a LoRA run holds one base
    instead of two. Full fine-tuning copies every parameter."""
    frozen = {id(p): p for p in model.parameters() if not p.requires_grad}
    return copy.deepcopy(model, frozen)


def build_engine(
    cfg: Config, model: torch.nn.Module, tokenizer: Any, run_dir: Path
) -> tuple[Any, WeightSync]:
    """The engine the run samples from, and the :class:`WeightSync` that keeps it current.

    ``torch``: an in-process copy of the policy (``engine.weight_sync=shared``: the policy
    itself, no copy). ``http``: the servers in ``engine.urls``; they must already serve the
    run's base model (``model.path``, or the SFT output, which :func:`initial_sync` pushes).
    """
    e = cfg.engine
    if e.kind == "torch":
        policy = model if e.weight_sync == "shared" else engine_copy(model)
        engine: Any = run_torch_engine(cfg, policy, tokenizer)
    else:
        from gyre.engines.http_engine import HttpEngine, HttpSettings

        settings = HttpSettings(
            api_key=resolve_api_key(e),
            timeout_s=e.timeout_s,
            max_retries=e.max_retries,
            health_interval_s=e.health_interval_s,
            max_concurrency=e.max_concurrency,
        )
        engine = HttpEngine(e.urls, model=e.model, api=e.api, settings=settings)
    sync_dir = Path(e.sync_dir) if e.sync_dir else run_dir / "sync"
    lora = cfg.model.lora is not None
    return engine, WeightSync(e, engine, tokenizer, sync_dir, lora, seed=cfg.run.seed)


def initial_sync(
    syncer: WeightSync, model: torch.nn.Module, version: int, base_dir: Path | None
) -> dict[str, float]:
    """Before the first rollout of a disk-synced run, give every engine the current policy.

    With LoRA on an SFT warm start the servers first need the SFT weights under the adapter
    (``base_dir``); then the adapter (or the full policy) of ``version`` is pushed.
    """
    syncer.remember(model, version)  # the sync check's reference (engine.verify_every)
    if syncer.mode != "disk":
        return {}
    if syncer.lora and base_dir is not None and syncer.cfg.kind == "http":
        # (an in-process engine is a copy of the policy: it has these weights already)
        syncer.engine.load_weights_from_disk(base_dir, version)
    return syncer.sync(model, version)
