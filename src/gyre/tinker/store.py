"""Saved state on disk: ``tinker://<model id>/weights/<name>`` and ``.../sampler_weights/<name>``.

``<state_dir>/runs/<model id, %-quoted>/<kind>/<name>/`` holds:

- a LoRA tenant: ``adapter_model.safetensors`` + ``adapter_config.json`` (peft's format, so
  ``gyre serve``, vLLM and SGLang load a sampler checkpoint as an adapter);
- a full tenant: ``model.safetensors`` (every weight);
- ``optimizer.pt`` (``weights`` kind only, once the tenant has stepped): the AdamW state;
- ``meta.json``: base model, LoRA settings, step count;
- ``manifest.json`` last, with every file's sha256 (gyre's checkpoint manifest).

A save is written into a hidden sibling, fsynced, and renamed into place before its future
resolves, so a save the client saw acknowledged survives a ``kill -9`` of the server, and a
torn or edited checkpoint fails verification on load instead of loading garbage.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.parse
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from gyre.checkpoint.files import fsync_tree, replace_dir_atomically, verify_dir, write_manifest
from gyre.tinker.errors import NotFound, UserError
from gyre.tinker.tenants import Tenant

KINDS = {"weights": "training", "sampler_weights": "sampler"}
ADAPTER_WEIGHTS, FULL_WEIGHTS = "adapter_model.safetensors", "model.safetensors"


def _check_name(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\\" in name or name.startswith("."):
        raise UserError(f"path: {name!r} is not a valid checkpoint name (no '/', no leading '.')")
    return name


class StateStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        (self.root / "runs").mkdir(parents=True, exist_ok=True)

    def run_dir(self, model_id: str) -> Path:
        return self.root / "runs" / urllib.parse.quote(model_id, safe="")

    def uri(self, model_id: str, kind: str, name: str) -> str:
        return f"tinker://{model_id}/{kind}/{name}"

    def resolve(self, uri: str, field: str = "path") -> tuple[str, str, Path]:
        """(model id, kind, folder) of a ``tinker://`` path; the folder must verify."""
        if not uri.startswith("tinker://"):
            raise UserError(f"{field}: {uri!r} is not a tinker:// path")
        parts = uri[len("tinker://") :].split("/")
        if len(parts) != 3 or parts[1] not in KINDS:
            raise UserError(f"{field}: {uri!r} is not tinker://RUN/weights|sampler_weights/NAME")
        model_id, kind, name = parts[0], parts[1], _check_name(parts[2])
        folder = self.run_dir(model_id) / kind / name
        if not folder.is_dir():
            raise NotFound(f"{field}: no checkpoint at {uri}")
        problems = verify_dir(folder)
        if problems:
            raise UserError(f"{field}: checkpoint {uri} is damaged: {'; '.join(problems[:3])}")
        return model_id, kind, folder

    def save(self, tenant: Tenant, kind: str, name: str, overwrite: bool, alpha: float) -> str:
        final = self.run_dir(tenant.model_id) / kind / _check_name(name)
        if final.exists() and not overwrite and kind == "weights":
            raise UserError(f"path: checkpoint {name!r} exists (pass overwrite=True to replace)")
        stage = final.parent / f".tmp_{name}_{os.getpid()}"
        if stage.exists():
            shutil.rmtree(stage)
        stage.mkdir(parents=True)
        state = tenant.trainable_state()
        if tenant.lora is not None:
            save_file(state, stage / ADAPTER_WEIGHTS, metadata={"format": "pt"})
            tenant.module.peft_config[tenant.adapter].save_pretrained(stage)
        else:
            save_file({k: v.contiguous() for k, v in state.items()}, stage / FULL_WEIGHTS)
        if kind == "weights" and tenant.optimizer is not None:
            torch.save(tenant.optimizer.state_dict(), stage / "optimizer.pt")
        meta = {
            "model_id": tenant.model_id,
            "base_model": tenant.base_model,
            "lora": None if tenant.lora is None else vars(tenant.lora),
            "lora_alpha": alpha,
            "steps": tenant.steps,
            "time": time.time(),
        }
        (stage / "meta.json").write_text(json.dumps(meta, indent=2))
        write_manifest(stage, {"kind": kind, "name": name})
        fsync_tree(stage)
        replace_dir_atomically(stage, final)
        return self.uri(tenant.model_id, kind, name)

    def delete(self, uri: str) -> None:
        shutil.rmtree(self.resolve(uri, "checkpoint_id")[2])

    @staticmethod
    def read(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], Any]:
        """(meta, trainable tensors, optimizer state or None) of a verified folder."""
        if not (folder / "meta.json").is_file():  # deleted since it was named
            raise NotFound(f"path: the checkpoint in {folder.name!r} no longer exists")
        meta = json.loads((folder / "meta.json").read_text())
        weights = folder / (ADAPTER_WEIGHTS if meta["lora"] is not None else FULL_WEIGHTS)
        opt = folder / "optimizer.pt"
        opt_state = torch.load(opt, weights_only=True) if opt.is_file() else None
        return meta, load_file(str(weights)), opt_state

    def list(self, model_id: str) -> list[dict[str, Any]]:
        """The run's checkpoints, as the SDK's ``Checkpoint`` records (oldest first)."""
        out = []
        for kind, ctype in KINDS.items():
            base = self.run_dir(model_id) / kind
            for folder in sorted(base.iterdir()) if base.is_dir() else []:
                if folder.name.startswith(".") or not (folder / "manifest.json").is_file():
                    continue
                stamp = (folder / "manifest.json").stat().st_mtime
                size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
                out.append(
                    {
                        "checkpoint_id": f"{kind}/{folder.name}",
                        "checkpoint_type": ctype,
                        "time": datetime.fromtimestamp(stamp, UTC).isoformat(),
                        "tinker_path": self.uri(model_id, kind, folder.name),
                        "size_bytes": size,
                    }
                )
        return sorted(out, key=lambda c: c["time"])
