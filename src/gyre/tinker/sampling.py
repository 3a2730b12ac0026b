"""Sampling sessions of the Tinker service, and the sampling requests they serve.

A sampling session names what it samples from: the base model, or weights saved for a sampler
(``save_weights_for_sampler``: a LoRA adapter, or a full copy of the model). A request is
checked at once (a bad one fails the HTTP request) and queued on the future queue as a
batchable job: requests on the same weights with the same sampling parameters run as one batch.

:class:`SampleWork` runs a batch where a base model lives: the server's own
(``runner: local``), or a sampler Ray actor's copy, which reads the saved weights from the
shared ``state_dir`` (``runner: ray``, :mod:`gyre.tinker.ray_backend`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import threading
import uuid
from pathlib import Path
from typing import Any

import torch

from gyre.tinker import compute
from gyre.tinker.config import TinkerServeConfig
from gyre.tinker.errors import NotFound, UserError, required
from gyre.tinker.futures import FutureQueue
from gyre.tinker.store import StateStore
from gyre.tinker.tenants import BaseModelHost, ModelCard
from gyre.tinker.wire import encode_sample_response


class SampleWork:
    """Sampling batches on one copy of the base model (plus the saved weights they name)."""

    def __init__(self, cfg: TinkerServeConfig, host: BaseModelHost) -> None:
        self.cfg, self.host = cfg, host
        self._full: dict[str, torch.nn.Module] = {}  # the newest full-weights sampler

    def sample(self, folder: Path | None, jobs: list[compute.SampleJob]) -> list[bytes]:
        """One batch of jobs that share their sampling parameters, on the weights of
        ``folder`` (None: the base model); one encoded ``SampleResponse`` per job."""
        module, context = self._module(folder)
        done = compute.sample_batch(
            module, context, self.host.tokenizer, jobs, self.cfg.sample_max_rows
        )
        return [
            encode_sample_response(seqs, ps.logprobs, ps.topk, ps.targets, ps.alt)
            for seqs, ps in done
        ]

    def _module(self, folder: Path | None) -> tuple[torch.nn.Module, Any]:
        if folder is None:
            return self.host.base_module()
        meta, weights, _ = StateStore.read(folder)
        version = hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()[:16]
        if meta["lora"] is not None:
            return self.host.sampler_adapter(folder, version), contextlib.nullcontext()
        if version not in self._full:
            model, _ = self.host.full_copy()
            model.load_state_dict(weights)
            self._full = {version: model.requires_grad_(False)}  # keep the newest only
        return self._full[version], contextlib.nullcontext()


class Samplers:
    """The sampling sessions (id -> the saved weights they sample, None: the base model) and
    the ``asample`` requests, queued on ``lane`` and run by ``work`` (a :class:`SampleWork`,
    or the Ray backend's pool of sampler actors)."""

    def __init__(
        self,
        cfg: TinkerServeConfig,
        card: ModelCard,
        store: StateStore,
        futures: FutureQueue,
        work: Any,
        lane: str = "main",
    ) -> None:
        self.cfg, self.host, self.store, self.futures = cfg, card, store, futures
        self.work, self.lane = work, lane
        self.sessions: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._seeds = itertools.count()

    def new(self, sid: str, seq: Any, model_path: str | None) -> str:
        """A sampling session of session ``sid`` on ``model_path`` (None: the base model)."""
        sampler_id = f"{sid}:sample:{seq if seq is not None else uuid.uuid4().hex[:8]}"
        with self._lock:
            self.sessions[sampler_id] = {"model_path": model_path}
        return sampler_id

    def create(self, sid: str, body: dict[str, Any]) -> dict[str, Any]:
        """``create_sampling_session`` of a live session ``sid``."""
        path = body.get("model_path")
        if path:
            self.store.resolve(path, "model_path")
        else:
            self.host.check_served(required(body, "base_model", str))
        sampler = self.new(sid, body.get("sampling_session_seq_id"), path)
        return {"type": "create_sampling_session", "sampling_session_id": sampler}

    def get(self, sampler_id: str) -> dict[str, Any]:
        if sampler_id not in self.sessions:
            raise NotFound(f"sampler_id: {sampler_id!r} is unknown")
        return {
            "sampler_id": sampler_id,
            "base_model": self.host.name,
            "model_path": self.sessions[sampler_id]["model_path"],
        }

    def asample(self, body: dict[str, Any]) -> tuple[str, list[str]]:
        """Queue one sampling request; returns its future's id and one id per sample."""
        n = body.get("num_samples", 1)
        if not isinstance(n, int) or not 1 <= n <= 256:
            raise UserError(f"num_samples: must be an integer in [1, 256], got {n!r}")
        prompt = _prompt_ids(body.get("prompt"))
        if body.get("sampling_session_id"):
            path = self.get(body["sampling_session_id"])["model_path"]
        else:
            path = body.get("model_path")
            if not path:
                self.host.check_served(required(body, "base_model", str))
        folder = self.store.resolve(path, "model_path")[2] if path else None
        request = {**body, "prompt_ids": prompt, "n": n}
        request["sampling_params"] = body.get("sampling_params") or {}
        seed = self.cfg.seed * 1_000_003 + next(self._seeds) * 1009
        tok, vocab = self.host.tokenizer, self.host.vocab
        job = compute.check_sample(request, tok, vocab, seed, self.cfg.max_context)
        key = ("sample", str(folder), job.params, job.stop_texts)
        rid = self.futures.submit_batchable(
            key, job, lambda jobs: self.work.sample(folder, jobs), "sample", self.lane
        )
        return rid, [f"{rid}:{i}" for i in range(n)]


def _prompt_ids(prompt: Any) -> list[int]:
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise UserError("prompt: expected a ModelInput ({'chunks': [...]})")
    ids: list[int] = []
    for i, chunk in enumerate(prompt["chunks"]):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else type(chunk).__name__
            raise UserError(f"prompt.chunks[{i}]: {kind} chunks are not supported (text only)")
        tokens = chunk.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
            raise UserError(f"prompt.chunks[{i}].tokens: expected a list of token ids")
        ids += tokens
    if not ids:
        raise UserError("prompt: empty")
    return ids
