"""The training side of the Tinker service: the tenants on one base model and the work on them.

:class:`TrainWork` owns the :class:`~gyre.tinker.tenants.BaseModelHost`, every tenant (adapter
or full copy, with its AdamW state) and the saves. Its methods take and return plain, picklable
values (model ids, :class:`~gyre.tinker.wire.FwdBwdCall`, dicts, bytes), so the service calls the
same object in its own process (``runner: local``) or inside the trainer Ray actor
(``runner: ray``, :mod:`gyre.tinker.ray_backend`). It runs one call at a time: the service's
future queue calls it from a single worker thread.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import torch

from gyre.tinker import compute
from gyre.tinker.config import TinkerServeConfig
from gyre.tinker.custom_loss import CustomLoss
from gyre.tinker.errors import NotFound, UserError
from gyre.tinker.store import StateStore
from gyre.tinker.tenants import BaseModelHost, LoraSpec, Tenant
from gyre.tinker.wire import FwdBwdCall, encode_forward_backward_output


def load_host(cfg: TinkerServeConfig, folder: str, name: str, hub_id: str | None) -> BaseModelHost:
    """The base model of ``folder`` (resolved by the driver), frozen, on ``cfg.device``."""
    from gyre.models.build import load_pretrained, resolve_device

    model, tokenizer = load_pretrained(folder, resolve_device(cfg.device, "device"))
    model.requires_grad_(False)
    return BaseModelHost(model, tokenizer, name, folder, cfg.lora_alpha, hub_id)


class TrainWork:
    """Tenants, their optimizer steps and their saves, where the base model lives."""

    def __init__(self, cfg: TinkerServeConfig, host: BaseModelHost) -> None:
        from gyre.models.build import resolve_device

        self.cfg, self.host = cfg, host
        self.device = resolve_device(cfg.device, "device")
        self.store = StateStore(cfg.state_dir)
        self.tenants: dict[str, Tenant] = {}
        pad = host.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (host.tokenizer.eos_token_id or 0)
        # said with a model id this process does not hold (the trainer actor was replaced)
        self.lost_note = ""

    def tenant(self, model_id: str) -> Tenant:
        if model_id not in self.tenants:
            raise NotFound(f"model_id: {model_id!r} is not a model on this server{self.lost_note}")
        return self.tenants[model_id]

    def create_model(self, model_id: str, session_id: str, spec: LoraSpec | None) -> None:
        """A new tenant; the same id again is the same model, created once (the SDK retries a
        create it saw fail in transit)."""
        if model_id in self.tenants:
            return
        if spec is None:
            module, params = self.host.full_copy()
        else:
            module, params = self.host.add_lora(model_id, spec)
        self.tenants[model_id] = Tenant(model_id, session_id, self.host.name, spec, module, params)

    def drop_models(self, model_ids: list[str]) -> None:
        for mid in model_ids:
            tenant = self.tenants.pop(mid, None)
            if tenant is not None and tenant.lora is not None:
                self.host.remove_lora(mid)

    def forward_backward(self, call: FwdBwdCall, custom: CustomLoss | None) -> bytes:
        outputs, metrics = compute.forward_backward(
            self.tenant(call.model_id),
            call,
            self.device,
            self.pad_id,
            self.cfg.train_micro_tokens,
            custom,
        )
        return encode_forward_backward_output(outputs, metrics)

    def optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, Any]:
        return {"metrics": compute.optim_step(self.tenant(model_id), adam)}

    def save(self, model_id: str, kind: str, name: str | None, overwrite: bool) -> str:
        """Save ``kind`` (``weights`` or ``sampler_weights``) atomically; returns its uri. No
        ``name``: an automatic one with the step count."""
        tenant = self.tenant(model_id)
        name = name or f"auto-{tenant.steps:06d}-{uuid.uuid4().hex[:6]}"
        return self.store.save(tenant, kind, name, overwrite, self.host.alpha)

    def load(self, model_id: str, uri: str, folder: Path, with_opt: bool) -> LoraSpec | None:
        """Load a saved state into ``model_id`` (created when absent); returns its LoRA spec."""
        meta, weights, opt_state = self.store.read(folder)
        self.host.check_served(meta["base_model"], "path (its base model)")
        tenant = self.tenants.get(model_id)
        spec = None if meta["lora"] is None else LoraSpec(**meta["lora"])
        if tenant is None:
            self.create_model(model_id, model_id.split(":")[0], spec)
            tenant = self.tenants[model_id]
        elif (tenant.lora is None) != (spec is None) or (spec and spec.rank != tenant.lora.rank):
            raise UserError(f"path: {uri} does not fit model {model_id} (LoRA settings differ)")
        tenant.load_trainable_state(weights)
        tenant.optimizer, tenant.steps = None, int(meta["steps"])
        if with_opt and opt_state is not None:
            tenant.optimizer = torch.optim.AdamW(tenant.params)
            tenant.optimizer.load_state_dict(opt_state)
        for p in tenant.params:
            p.grad = None
        return spec
