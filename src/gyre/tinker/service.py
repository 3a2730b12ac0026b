"""The Tinker service: sessions, training models and their futures (sampling sessions and
requests: :mod:`gyre.tinker.sampling`).

Plain Python over dicts (the parsed JSON bodies of the SDK's requests); :mod:`server` is the
HTTP glue. Validation that needs no model runs at once and fails the HTTP request; the work
itself runs on the future queue, and its errors come back from ``retrieve_future``.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from gyre.tinker import compute
from gyre.tinker.config import TinkerServeConfig
from gyre.tinker.custom_loss import CustomLoss, compile_custom_loss
from gyre.tinker.errors import NotFound, UserError, required
from gyre.tinker.futures import FutureQueue
from gyre.tinker.sampling import Samplers
from gyre.tinker.store import StateStore
from gyre.tinker.tenants import BaseModelHost, LoraSpec, Tenant
from gyre.tinker.wire import FwdBwdCall, encode_forward_backward_output

ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
ADAM_DEFAULTS = dict(zip(ADAM_KEYS, (1e-4, 0.9, 0.95, 1e-12, 0.0, 0.0), strict=True))


class TinkerService:
    def __init__(self, cfg: TinkerServeConfig, host: BaseModelHost, device: torch.device) -> None:
        self.cfg, self.host, self.device = cfg, host, device
        self.store = StateStore(cfg.state_dir)
        self.futures = FutureQueue(cfg.result_ttl_s)
        self.sessions: dict[str, dict[str, Any]] = {}
        self.tenants: dict[str, Tenant] = {}
        self.samplers = Samplers(cfg, host, self.store, self.futures)
        self.custom_losses: dict[str, tuple[str, CustomLoss]] = {}  # loss id -> (session, loss)
        self._lock = threading.Lock()
        pad = host.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (host.tokenizer.eos_token_id or 0)

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
        self.futures.submit(lambda: self._drop_session(session_id) or {}, "finish_session")

    def _drop_session(self, session_id: str) -> None:
        with self._lock:
            for lid in [k for k, (sid, _) in self.custom_losses.items() if sid == session_id]:
                del self.custom_losses[lid]
        for mid in [m for m, t in self.tenants.items() if t.session_id == session_id]:
            tenant = self.tenants.pop(mid)
            if tenant.lora is not None:
                self.host.remove_lora(mid)

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
            if model_id not in self.tenants:
                self._new_tenant(model_id, sid, spec, body.get("user_metadata") or {})
            return {"type": "create_model", "model_id": model_id}

        return self.futures.submit(run, "create_model")

    def _new_tenant(self, model_id: str, sid: str, spec: LoraSpec | None, meta: dict) -> Tenant:
        if spec is None:
            module, params = self.host.full_copy()
        else:
            module, params = self.host.add_lora(model_id, spec)
        tenant = Tenant(model_id, sid, self.host.name, spec, module, params, user_metadata=meta)
        self.tenants[model_id] = tenant
        return tenant

    def tenant(self, model_id: Any) -> Tenant:
        if not isinstance(model_id, str) or model_id not in self.tenants:
            raise NotFound(f"model_id: {model_id!r} is not a model on this server")
        return self.tenants[model_id]

    def get_info(self, body: dict[str, Any]) -> dict[str, Any]:
        t = self.tenant(body.get("model_id"))
        return {
            "type": "get_info",
            "model_id": t.model_id,
            "model_data": {
                "arch": type(self.host.base).__name__,
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
        return self.futures.submit(lambda: result, "create_custom_loss")

    def _custom_loss(self, call: FwdBwdCall, tenant: Tenant) -> CustomLoss | None:
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
        if found[0] != tenant.session_id:
            raise UserError(f"loss_fn_config.loss_id: {loss_id!r} belongs to another session")
        return found[1]

    def forward_backward(self, call: FwdBwdCall) -> str:
        tenant = self.tenant(call.model_id)
        custom = self._custom_loss(call, tenant)

        def run() -> bytes:
            outputs, metrics = compute.forward_backward(
                tenant, call, self.device, self.pad_id, self.cfg.train_micro_tokens, custom
            )
            return encode_forward_backward_output(outputs, metrics)

        kind = "forward" if call.forward_only else "forward_backward"
        tokens = sum(len(d.tokens) for d in call.data)
        return self.futures.submit(run, f"{kind} {len(call.data)} datums, {tokens} tokens")

    def optim_step(self, body: dict[str, Any]) -> str:
        tenant = self.tenant(body.get("model_id"))
        raw = body.get("adam_params") or body.get("optim_params")
        if raw is None and body.get("optimizer_params") is not None:
            raise UserError("optimizer_params: only AdamParams (adam_params) are supported")
        adam = {**ADAM_DEFAULTS, **(raw or {})}
        for k in ADAM_KEYS:
            if not isinstance(adam[k], int | float) or adam[k] < 0:
                raise UserError(f"adam_params.{k}: must be a number >= 0, got {adam[k]!r}")
        return self.futures.submit(
            lambda: {"metrics": compute.optim_step(tenant, adam)}, "optim_step"
        )

    # -- weights ------------------------------------------------------------------------------
    def save_weights(self, body: dict[str, Any], kind: str) -> str:
        tenant = self.tenant(body.get("model_id"))
        name = body.get("path")
        sampling_seq = body.get("sampling_session_seq_id")
        if name is None and kind == "weights":
            raise UserError("path: required (a checkpoint name)")
        auto = name is None
        name = name or f"auto-{tenant.steps:06d}-{uuid.uuid4().hex[:6]}"
        overwrite = bool(body.get("overwrite", False))

        def run() -> dict[str, Any]:
            uri = self.store.save(tenant, kind, name, overwrite, self.host.alpha)
            if kind == "weights":
                return {"type": "save_weights", "path": uri}
            out: dict[str, Any] = {"type": "save_weights_for_sampler", "path": uri}
            if auto:  # save_weights_and_get_sampling_client: a sampling session on it
                out["sampling_session_id"] = self.samplers.new(tenant.session_id, sampling_seq, uri)
            return out

        return self.futures.submit(run, f"save {kind}")

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
            model_id = self.tenant(body.get("model_id")).model_id

        def run() -> dict[str, Any]:
            meta, weights, opt_state = self.store.read(folder)
            self.host.check_served(meta["base_model"], "path (its base model)")
            tenant = self.tenants.get(model_id)
            spec = None if meta["lora"] is None else LoraSpec(**meta["lora"])
            if tenant is None:
                tenant = self._new_tenant(model_id, model_id.split(":")[0], spec, {})
            elif (tenant.lora is None) != (spec is None) or (
                spec and spec.rank != tenant.lora.rank
            ):
                raise UserError(f"path: {uri} does not fit model {model_id} (LoRA settings differ)")
            tenant.load_trainable_state(weights)
            tenant.optimizer, tenant.steps = None, int(meta["steps"])
            if with_opt and opt_state is not None:
                tenant.optimizer = torch.optim.AdamW(tenant.params)
                tenant.optimizer.load_state_dict(opt_state)
            for p in tenant.params:
                p.grad = None
            return {"type": "load_weights", "path": uri, "model_id": model_id}

        return self.futures.submit(run, "load_weights")

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
        t = self.tenant(model_id)
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
