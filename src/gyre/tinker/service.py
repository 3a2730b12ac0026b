"""The Tinker service: sessions, training models and their futures (sampling sessions and
requests: :mod:`gyre.tinker.sampling`).

Plain Python over dicts (the parsed JSON bodies of the SDK's requests); :mod:`server` is the
HTTP glue. Validation that needs no model runs at once and fails the HTTP request; the work
itself runs on the future queue, and its errors come back from ``retrieve_future``.

The work goes to a :class:`Backend`: its ``train`` side (a :class:`~gyre.tinker.training.
TrainWork`: tenants, optimizer steps, saves) and its ``sample`` side (a
:class:`~gyre.tinker.sampling.SampleWork`). ``runner: local`` holds both in this process, on
one base model; ``runner: ray`` puts the same objects inside Ray actors
(:mod:`gyre.tinker.ray_backend`) and hands the service proxies with the same methods.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.tinker.config import TinkerServeConfig
from gyre.tinker.custom_loss import CustomLoss, compile_custom_loss
from gyre.tinker.errors import NotFound, UserError, required
from gyre.tinker.futures import FutureQueue
from gyre.tinker.sampling import Samplers, SampleWork
from gyre.tinker.store import StateStore
from gyre.tinker.tenants import BaseModelHost, LoraSpec, ModelCard
from gyre.tinker.training import TrainWork
from gyre.tinker.wire import FwdBwdCall

ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
ADAM_DEFAULTS = dict(zip(ADAM_KEYS, (1e-4, 0.9, 0.95, 1e-12, 0.0, 0.0), strict=True))


@dataclass
class Backend:
    """Where the work runs: ``train`` has :class:`TrainWork`'s methods, ``sample`` has
    :class:`SampleWork`'s; each runs on its lane of the future queue (``lanes``: lane ->
    worker threads)."""

    card: ModelCard
    train: Any
    sample: Any
    lanes: dict[str, int] = field(default_factory=lambda: {"main": 1})
    train_lane: str = "main"
    sample_lane: str = "main"
    close: Callable[[], None] = lambda: None


def local_backend(cfg: TinkerServeConfig, host: BaseModelHost) -> Backend:
    """Training and sampling in this process, on one base model and one worker thread (peft
    switches adapters on the shared model, so they must not run at once)."""
    return Backend(host, TrainWork(cfg, host), SampleWork(cfg, host))


@dataclass
class ModelEntry:
    """What the service knows of a training model (its weights live with ``Backend.train``)."""

    session_id: str
    lora: LoraSpec | None
    user_metadata: dict[str, Any]


class TinkerService:
    def __init__(self, cfg: TinkerServeConfig, backend: Backend) -> None:
        self.cfg, self.backend, self.host = cfg, backend, backend.card
        self.train, self.lane = backend.train, backend.train_lane
        self.store = StateStore(cfg.state_dir)
        self.futures = FutureQueue(cfg.result_ttl_s, lanes=backend.lanes)
        self.sessions: dict[str, dict[str, Any]] = {}
        self.models: dict[str, ModelEntry] = {}
        self.samplers = Samplers(
            cfg, self.host, self.store, self.futures, backend.sample, backend.sample_lane
        )
        self.custom_losses: dict[str, tuple[str, CustomLoss]] = {}  # loss id -> (session, loss)
        self._lock = threading.Lock()

    def close(self) -> None:
        self.futures.close()
        self.backend.close()

    def _submit(self, fn: Callable[[], dict[str, Any] | bytes], name: str) -> str:
        return self.futures.submit(fn, name, self.lane)

    # -- sessions -----------------------------------------------------------------------------
    def create_session(self, body: dict[str, Any]) -> dict[str, Any]:
        sid = f"gyre-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self.sessions[sid] = {"seen": time.monotonic(), "meta": body.get("user_metadata")}
        return {"type": "create_session", "session_id": sid}

    def heartbeat(self, session_id: str) -> None:
        self._check_session(session_id)

    def finish_session(self, session_id: str) -> None:
        with self._lock:
            self.sessions.pop(session_id, None)
        self._submit(lambda: self._drop_session(session_id) or {}, "finish_session")

    def _drop_session(self, session_id: str) -> None:
        with self._lock:
            for lid in [k for k, (sid, _) in self.custom_losses.items() if sid == session_id]:
                del self.custom_losses[lid]
        mine = [m for m, e in self.models.items() if e.session_id == session_id]
        if mine:
            self.train.drop_models(mine)
        for mid in mine:
            self.models.pop(mid, None)

    def _reap(self) -> None:
        """Free the models of sessions whose heartbeats stopped (runs on the worker)."""
        cutoff = time.monotonic() - self.cfg.session_timeout_s
        with self._lock:
            dead = [s for s, v in self.sessions.items() if v["seen"] < cutoff]
            for s in dead:
                del self.sessions[s]
        for s in dead:
            self._drop_session(s)

    def _check_session(self, session_id: str) -> None:
        """A live session: marked seen now (a request counts as a heartbeat)."""
        with self._lock:
            if session_id not in self.sessions:
                raise NotFound(f"session_id: {session_id!r} is unknown (server restarted?)")
            self.sessions[session_id]["seen"] = time.monotonic()

    # -- models -------------------------------------------------------------------------------
    def capabilities(self) -> dict[str, Any]:
        model = {
            "model_name": self.host.name,
            "max_context_length": self.cfg.max_context,
            "trainable": True,
            "sampleable": True,
        }
        return {"supported_models": [model]}

    def create_model(self, body: dict[str, Any]) -> str:
        sid = required(body, "session_id", str)
        seq = required(body, "model_seq_id", int)
        self._check_session(sid)
        self.host.check_served(required(body, "base_model", str))
        opt = (body.get("optimizer_config") or {}).get("type", "adamw")
        if opt != "adamw":
            raise UserError(f"optimizer_config.type: only 'adamw' is supported, got {opt!r}")
        lora = body.get("lora_config")
        spec = (
            None
            if lora is None
            else LoraSpec(**{k: v for k, v in lora.items() if k in LoraSpec.__dataclass_fields__})
        )
        model_id = f"{sid}:train:{seq}"

        def run() -> dict[str, Any]:
            # The SDK retries a create it saw fail in transit: the same (session, seq) is the
            # same model, created once.
            self._reap()
            self.train.create_model(model_id, sid, spec)
            if model_id not in self.models:
                self.models[model_id] = ModelEntry(sid, spec, body.get("user_metadata") or {})
            return {"type": "create_model", "model_id": model_id}

        return self._submit(run, "create_model")

    def model(self, model_id: Any) -> ModelEntry:
        if not isinstance(model_id, str) or model_id not in self.models:
            raise NotFound(f"model_id: {model_id!r} is not a model on this server")
        return self.models[model_id]

    def get_info(self, body: dict[str, Any]) -> dict[str, Any]:
        model_id = body.get("model_id")
        t = self.model(model_id)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": self.host.arch,
                "model_name": self.host.name,
                "tokenizer_id": self.host.hub_id or str(Path(self.host.path).resolve()),
            },
            "is_lora": t.lora is not None,
            "lora_rank": None if t.lora is None else t.lora.rank,
            "model_name": self.host.name,
        }

    # -- training -----------------------------------------------------------------------------
    def create_custom_loss(self, body: dict[str, Any]) -> str:
        """Check an uploaded loss graph now (a bad one fails this request, naming the node) and
        keep it for the session; its id goes in ``loss_fn_config.loss_id``."""
        sid = required(body, "session_id", str)
        seq = required(body, "custom_loss_seq_id", int)
        self._check_session(sid)
        loss = compile_custom_loss(body)
        loss_id = f"{sid}:loss:{seq}"
        with self._lock:
            self.custom_losses[loss_id] = (sid, loss)
        result = {"type": "create_custom_loss", "loss_id": loss_id}
        return self._submit(lambda: result, "create_custom_loss")

    def _custom_loss(self, call: FwdBwdCall, model: ModelEntry) -> CustomLoss | None:
        if call.loss_fn != "custom":
            return None
        loss_id = call.loss_fn_config.get("loss_id")
        with self._lock:
            found = self.custom_losses.get(loss_id) if isinstance(loss_id, str) else None
        if found is None:
            raise UserError(
                f"loss_fn_config.loss_id: {loss_id!r} is not a loss created with "
                "create_custom_loss in a live session"
            )
        if found[0] != model.session_id:
            raise UserError(f"loss_fn_config.loss_id: {loss_id!r} belongs to another session")
        return found[1]

    def forward_backward(self, call: FwdBwdCall) -> str:
        custom = self._custom_loss(call, self.model(call.model_id))
        kind = "forward" if call.forward_only else "forward_backward"
        tokens = sum(len(d.tokens) for d in call.data)
        return self._submit(
            lambda: self.train.forward_backward(call, custom),
            f"{kind} {len(call.data)} datums, {tokens} tokens",
        )

    def optim_step(self, body: dict[str, Any]) -> str:
        model_id = body.get("model_id")
        self.model(model_id)
        raw = body.get("adam_params") or body.get("optim_params")
        if raw is None and body.get("optimizer_params") is not None:
            raise UserError("optimizer_params: only AdamParams (adam_params) are supported")
        adam = {**ADAM_DEFAULTS, **(raw or {})}
        for k in ADAM_KEYS:
            if not isinstance(adam[k], int | float) or adam[k] < 0:
                raise UserError(f"adam_params.{k}: must be a number >= 0, got {adam[k]!r}")
        return self._submit(lambda: self.train.optim_step(model_id, adam), "optim_step")

    # -- weights ------------------------------------------------------------------------------
    def save_weights(self, body: dict[str, Any], kind: str) -> str:
        model_id = body.get("model_id")
        model = self.model(model_id)
        name = body.get("path")
        sampling_seq = body.get("sampling_session_seq_id")
        if name is None and kind == "weights":
            raise UserError("path: required (a checkpoint name)")
        overwrite = bool(body.get("overwrite", False))

        def run() -> dict[str, Any]:
            uri = self.train.save(model_id, kind, name, overwrite)
            if kind == "weights":
                return {"type": "save_weights", "path": uri}
            out: dict[str, Any] = {"type": "save_weights_for_sampler", "path": uri}
            if name is None:  # save_weights_and_get_sampling_client: a sampling session on it
                out["sampling_session_id"] = self.samplers.new(model.session_id, sampling_seq, uri)
            return out

        return self._submit(run, f"save {kind}")

    def load_weights(self, body: dict[str, Any]) -> str:
        uri = required(body, "path", str)
        _, _, folder = self.store.resolve(uri)
        with_opt = bool(body.get("optimizer", False))
        if body.get("session_id") is not None:
            sid = required(body, "session_id", str)
            self._check_session(sid)
            model_id = f"{sid}:train:{required(body, 'model_seq_id', int)}"
            if body.get("base_model"):
                self.host.check_served(body["base_model"])
        else:
            model_id = body.get("model_id")
            self.model(model_id)

        def run() -> dict[str, Any]:
            spec = self.train.load(model_id, uri, folder, with_opt)
            if model_id not in self.models:
                self.models[model_id] = ModelEntry(model_id.split(":")[0], spec, {})
            return {"type": "load_weights", "path": uri, "model_id": model_id}

        return self._submit(run, "load_weights")

    # -- sampling -----------------------------------------------------------------------------
    def create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        sid = required(body, "session_id", str)
        self._check_session(sid)
        return self.samplers.create(sid, body)

    # -- REST ---------------------------------------------------------------------------------
    def weights_info(self, body: dict[str, Any]) -> dict[str, Any]:
        _, _, folder = self.store.resolve(required(body, "tinker_path", str), "tinker_path")
        meta = self.store.read(folder)[0]
        lora = meta["lora"] or {}
        return {
            "base_model": meta["base_model"],
            "is_lora": meta["lora"] is not None,
            "lora_rank": lora.get("rank"),
            "train_unembed": lora.get("train_unembed"),
            "train_mlp": lora.get("train_mlp"),
            "train_attn": lora.get("train_attn"),
        }

    def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> None:
        self.store.delete(self.store.uri(model_id, *checkpoint_id.split("/", 1)))

    def checkpoints(self, model_id: str) -> dict[str, Any]:
        return {"checkpoints": self.store.list(model_id)}

    def training_run(self, model_id: str) -> dict[str, Any]:
        t = self.model(model_id)
        cks = self.store.list(model_id)
        last = {k: [c for c in cks if c["checkpoint_type"] == k] for k in ("training", "sampler")}
        return {
            "training_run_id": model_id,
            "base_model": self.host.name,
            "model_owner": "local",
            "is_lora": t.lora is not None,
            "lora_rank": None if t.lora is None else t.lora.rank,
            "last_request_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "last_checkpoint": (last["training"] or [None])[-1],
            "last_sampler_checkpoint": (last["sampler"] or [None])[-1],
            "user_metadata": {str(k): str(v) for k, v in t.user_metadata.items()} or None,
        }
