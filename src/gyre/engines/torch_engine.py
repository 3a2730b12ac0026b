"""An in-process engine: continuous batching over a Hugging Face model and its KV cache.

:class:`TorchEngine` is a facade over three parts, each readable on its own:

- the **scheduler** (:mod:`gyre.engines.scheduler`): admission, prefix sharing, compaction and
  session parking -- which rows decode together, step by step;
- the **model runner** (:mod:`gyre.engines.model_runner`): prefill and decode forwards (lean,
  HF, compiled, vision) over the decode batch and its KV cache (:mod:`gyre.engines.kv_batch`);
- the **sampler** (:mod:`gyre.engines.sampler`): each step's counter-based draw, so a request's
  tokens do not depend on the batch it shares, on the order of requests, or on any of the
  scheduling or forward switches (tested).

The switches are one :class:`~gyre.engines.engine_options.EngineOptions`; a run sets them from
its ``perf:`` config section (:func:`gyre.engines.factory.run_torch_engine`). What each saves is
measurable on its own (``bench/rollout.py --engine-flags``). The facade itself holds the
weights side: in-memory, on-disk and adapter syncs.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from gyre.engines.base import EngineFeatures
from gyre.engines.engine_options import EngineOptions
from gyre.engines.model_runner import ModelRunner
from gyre.engines.sampler import KeyedSampler
from gyre.engines.scheduler import OnComplete, Scheduler
from gyre.models.vision import VisionIO
from gyre.types import Completion, GenerationRequest, SamplingParams

__all__ = ["EngineOptions", "OnComplete", "TorchEngine"]


class TorchEngine:
    """Engine over a local ``transformers`` causal LM (any architecture with a DynamicCache).

    ``options`` sets how it batches and runs the model (:class:`EngineOptions`); any of its
    fields may also be given by name (``TorchEngine(model, pad, compaction=False)``).
    Results never depend on them. ``vision`` is a VLM's image side. A request's own
    ``temperature`` replaces the batch's for its tokens.
    """

    features = EngineFeatures(continuous=True, per_request_temperature=True, in_process=True)

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        seed: int = 0,
        vision: VisionIO | None = None,
        options: EngineOptions | None = None,
        **knobs: Any,
    ) -> None:
        self.options = replace(options or EngineOptions(), **knobs)
        self.version = 0
        self.runner = ModelRunner(model, pad_token_id, self.options, vision)
        self.sampler = KeyedSampler(seed)
        self.scheduler = Scheduler(self.options, self.runner, self.sampler)

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @model.setter
    def model(self, model: torch.nn.Module) -> None:
        """Replace the model sampled from (``gyre serve`` loads and unloads LoRA adapters)."""
        self.runner.model = model

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def vision(self) -> VisionIO | None:
        return self.runner.vision

    @property
    def stats(self) -> dict[str, int]:
        """Work counts: prefill/decode tokens, padding positions, forward calls."""
        return self.runner.stats

    @property
    def generator(self) -> torch.Generator:
        """The sampler's random stream (a run checkpoints it for exact resume)."""
        return self.sampler.generator

    # -- weight sync ----------------------------------------------------------------------
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            own = self.model.state_dict()
            for name, tensor in state_dict.items():
                own[name].copy_(tensor)
        self.weights_changed(version)

    def weights_changed(self, version: int) -> None:
        """The model's parameters changed (copied in by a sync, or updated in place by a
        colocated trainer sharing them: ``engine.weight_sync=shared``): move to ``version``
        and drop the parked caches, whose keys/values came from the old weights."""
        self.version = version
        self.reset_cache()

    def load_weights_from_disk(self, path: str | Path, version: int) -> int:
        """Full-weight sync from a Hugging Face folder's safetensors; returns ``version``."""
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in '{path}'")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(safetensors.torch.load_file(f, device=str(self.device)))
        own = self.model.state_dict()
        if hasattr(self.model, "peft_config"):
            raise ValueError("this engine holds a LoRA adapter: sync it with load_adapter")
        if self.vision is not None and any(k not in own for k in state):
            from gyre.models.vision import checkpoint_state

            state = {k: v.to(self.device) for k, v in checkpoint_state(path).items()}
        missing = [k for k in state if k not in own]
        if missing:
            raise ValueError(f"weights in '{path}' do not fit the engine's model: {missing[:3]}")
        self.load_weights(state, version)
        return version

    def load_adapter(self, path: str | Path, version: int) -> int:
        """Adapter sync: load a peft adapter folder as the active adapter; returns ``version``."""
        from gyre.models.lora import load_adapter_into

        self.model = load_adapter_into(self.model, Path(path), f"v{version}").eval()
        active = f"v{version}"
        self.model.set_adapter(active)
        for name in list(self.model.peft_config):
            if name != active:
                self.model.delete_adapter(name)
        self.weights_changed(version)  # cached keys/values belong to the old adapter
        return version

    def reset_cache(self) -> None:
        """Drop every parked session cache (after the weights or adapters changed)."""
        self.scheduler.parked.clear()

    def release(self, sessions: Iterable[Hashable]) -> None:
        self.scheduler.release(sessions)

    # -- generation -----------------------------------------------------------------------
    def generate(
        self, requests: list[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        """Sample a completion for every request, in order.

        Parked sessions that none of ``requests`` continues are dropped (as a batch of a new
        rollout does not need the old one's caches).
        """
        self.scheduler.keep_sessions({r.session for r in requests if r.session is not None})
        return self.generate_continuous(requests, params, None)

    @torch.no_grad()
    def generate_continuous(
        self,
        requests: list[GenerationRequest],
        params: SamplingParams,
        on_complete: OnComplete | None,
    ) -> list[Completion]:
        """Generate ``requests`` with continuous batching.

        Each time a row finishes, ``on_complete(index, completion)`` may return a follow-up
        request; it gets the next index and is admitted into the running batch as soon as a
        slot is free. Returns every completion (initial requests, then follow-ups) by index.
        """
        lean = self.runner.lean()
        if lean is None:
            return self.scheduler.run(requests, params, on_complete)
        with lean.reuse_fused():  # the weights do not change during one generate call
            return self.scheduler.run(requests, params, on_complete)
