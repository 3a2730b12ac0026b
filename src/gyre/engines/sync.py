"""Weight sync (phase 5 of the loop): bring every engine to the trainer's policy version.

Three paths, chosen from the engine and ``engine.weight_sync``:

- **memory** (in-process torch engine): copy the changed tensors (all weights, or under LoRA
  only the adapter's) into the engine's model.
- **shared** (in-process torch engine built on the trainer's own model, no LoRA): nothing to
  copy; a sync only moves the engine to the new version and drops its parked KV caches
  (computed with the old weights).
- **adapter files** (LoRA, any engine that has ``load_adapter``): write the adapter atomically to
  ``<sync_dir>/v<version>/`` in peft format (``adapter_model.safetensors`` +
  ``adapter_config.json``), tell each engine to load it and wait for its acknowledgement, then
  delete versions older than the newest ``sync_keep``.
- **full-weight files** (no LoRA, engines with ``load_weights_from_disk``): the same with a plain
  Hugging Face folder, loaded through ``/update_weights_from_disk`` (SGLang's endpoint).

Every sync reports ``sync/bytes`` and its write / load times; the loop times the whole phase.
After every ``engine.verify_every``-th sync (memory or files) each engine is checked to serve the
new policy (:mod:`gyre.engines.verify`: probe prompt log-probs against the trainer's; exit 3 if
not). A shared engine samples from the trainer's own parameters: nothing to check.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from gyre.config import EngineConfig
from gyre.engines.verify import SyncVerifier, placeholder_ids, probe_ids
from gyre.models.lora import save_adapter_atomic, save_full_atomic, trainable_state

_VERSION_DIR = re.compile(r"^v(\d+)$")


class WeightSync:
    """Syncs ``engine`` from ``model`` every ``cfg.sync_every`` updates (and on the last)."""

    def __init__(
        self,
        cfg: EngineConfig,
        engine: Any,
        tokenizer: Any,
        sync_dir: Path,
        lora: bool,
        seed: int = 0,
    ) -> None:
        self.cfg, self.engine, self.tokenizer, self.lora = cfg, engine, tokenizer, lora
        self.seed = seed
        self.verifier: SyncVerifier | None = None
        self.sync_dir = Path(sync_dir)
        local = cfg.kind == "torch" and cfg.weight_sync in ("memory", "shared")
        self.mode = cfg.weight_sync if local else "disk"
        if self.mode == "disk":
            need = "load_adapter" if lora else "load_weights_from_disk"
            if not hasattr(engine, need):
                raise TypeError(f"{type(engine).__name__} cannot sync from files (no {need})")

    def remember(self, model: torch.nn.Module, version: int) -> None:
        """Before the first sync: the trainer's probe log-probs at the engines' version."""
        if self.mode != "shared" and self.cfg.verify_every and not _sharded(model):
            self._verifier(model).remember(model, version)

    def _verifier(self, model: torch.nn.Module) -> SyncVerifier:
        if self.verifier is None:
            vocab = model.get_input_embeddings().num_embeddings
            never = placeholder_ids(model)
            ids = probe_ids(self.tokenizer, vocab, self.cfg.verify_tokens, self.seed, never)
            cfg = self.cfg
            self.verifier = SyncVerifier(self.engine, ids, cfg.verify_every, cfg.verify_tolerance)
        return self.verifier

    def due(self, step: int, last_step: int) -> bool:
        return step % self.cfg.sync_every == 0 or step == last_step

    def sync(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        """Push ``model`` to the engine as ``version``; returns sync metrics."""
        if self.mode == "shared":
            if self.engine.model is not model:
                raise RuntimeError("weight_sync=shared: the engine does not hold this model")
            self.engine.weights_changed(version)
            return {"sync/bytes": 0.0, "sync/load_s": 0.0}
        if self.mode == "memory":
            state = trainable_state(model) if self.lora else model.state_dict()
            t0 = time.perf_counter()
            self.engine.load_weights(state, version)
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            m = {"sync/bytes": float(nbytes), "sync/load_s": time.perf_counter() - t0}
            return {**m, **self._verify(model, version)}
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        out = self.sync_dir / f"v{version}"
        t0 = time.perf_counter()
        if self.lora:
            nbytes = save_adapter_atomic(model, out)
        else:
            nbytes = save_full_atomic(model, self.tokenizer, out)
        t1 = time.perf_counter()
        if self.lora:
            acks = self.engine.load_adapter(out, version)
        else:
            acks = self.engine.load_weights_from_disk(out, version)
        t2 = time.perf_counter()
        self._clean(version)
        m = {"sync/bytes": float(nbytes), "sync/write_s": t1 - t0, "sync/load_s": t2 - t1}
        if isinstance(acks, int) and hasattr(self.engine, "alive_count"):
            m["sync/acks"] = float(acks)
            m["engine/servers_alive"] = float(self.engine.alive_count())
        return {**m, **self._verify(model, version)}

    def _verify(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        if not self.cfg.verify_every or _sharded(model):
            return {}  # an FSDP2 shard cannot run a forward on one rank alone (a collective)
        return self._verifier(model).after_sync(model, version)

    def _clean(self, current: int) -> None:
        """Keep the newest ``sync_keep`` versions (always the current one)."""
        found = []
        for p in self.sync_dir.iterdir():
            m = _VERSION_DIR.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        found.sort()
        keep = {v for v, _ in found[-self.cfg.sync_keep :]} | {current}
        for v, p in found:
            if v not in keep:
                shutil.rmtree(p, ignore_errors=True)


def _sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are FSDP2 shards (DTensors)."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())
