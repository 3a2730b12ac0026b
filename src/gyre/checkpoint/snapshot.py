"""What goes into a checkpoint besides its model: optimizer, scheduler, RNG states and
``state.json`` (:class:`Snapshot`), written through a
:class:`~gyre.checkpoint.store.CheckpointStore` (:func:`save`) and read back
(:func:`load_into`); and the run seed of the global RNGs (:func:`seed_everything`)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gyre.checkpoint.store import (
    GRPO_PREFIX,
    CheckpointError,
    CheckpointStore,
    check_finite,
    checkpoint_dir,
)
from gyre.models.vision import save_tokenizer

STATE_FILE = "state.json"
CONFIG_FILE = "config.json"


def seed_everything(seed: int) -> None:
    """Python, numpy and torch global RNGs from the run seed (what a checkpoint's RNG state
    restores, see :func:`capture_rng`)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng(generators: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Global generators plus named ones (torch.Generator or numpy Generator)."""
    out: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    named = {}
    for key, g in (generators or {}).items():
        if isinstance(g, torch.Generator):
            named[key] = {"kind": "torch", "state": g.get_state()}
        elif isinstance(g, np.random.Generator):
            named[key] = {"kind": "numpy", "state": g.bit_generator.state}
        else:
            raise TypeError(f"generator {key!r} has unsupported type {type(g).__name__}")
    out["named"] = named
    return out


def restore_rng(saved: Mapping[str, Any], generators: Mapping[str, Any] | None = None) -> None:
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    torch.set_rng_state(saved["torch"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
    named = saved.get("named", {})
    for key, g in (generators or {}).items():
        if key not in named:
            raise CheckpointError(f"checkpoint has no state for generator {key!r}")
        if isinstance(g, torch.Generator):
            g.set_state(named[key]["state"])
        else:
            g.bit_generator.state = named[key]["state"]


@dataclass
class Snapshot:
    """What one checkpoint holds besides the model (kept together so call sites stay short)."""

    step: int
    state: dict[str, Any]
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    generators: Mapping[str, Any] | None = None
    config: Mapping[str, Any] | None = None
    config_hash: str = ""
    phase: str = "grpo"
    # Writes more files into the staged checkpoint folder (e.g. a PPO value model), so they are
    # covered by the manifest and the atomic rename like everything else.
    extra: Callable[[Path], None] | None = None


def save(
    store: CheckpointStore,
    name: str,
    model: torch.nn.Module,
    tokenizer: Any,
    snap: Snapshot,
) -> str:
    """Write one checkpoint atomically (see :mod:`gyre.checkpoint.store`); return its path.

    A model with a nan/inf tensor is refused (:class:`NonFiniteError`) before anything is
    written: a poisoned checkpoint would verify and be resumed from."""
    check_finite(model, store.url_of(name))

    def fill(d: Path) -> None:
        model.save_pretrained(d / "model")
        save_tokenizer(tokenizer, d / "model")  # a VLM's: with its image processor
        torch.save(snap.optimizer.state_dict(), d / "optimizer.pt")
        if snap.scheduler is not None:
            torch.save(snap.scheduler.state_dict(), d / "scheduler.pt")
        torch.save(capture_rng(snap.generators), d / "rng.pt")
        state = {**snap.state, "step": snap.step, "phase": snap.phase}
        (d / STATE_FILE).write_text(json.dumps(state, indent=1))
        if snap.config is not None:
            (d / CONFIG_FILE).write_text(json.dumps(snap.config, indent=1, sort_keys=True))
        if snap.extra is not None:
            snap.extra(d)

    extra = {"phase": snap.phase, "step": snap.step, "config_hash": snap.config_hash}
    return store.write(name, fill, extra)


def load_into(
    ckpt: Path,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    generators: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Restore optimizer, scheduler and RNG states; return ``state.json`` (model loads apart)."""
    ckpt = Path(ckpt)
    state = json.loads((ckpt / STATE_FILE).read_text())
    optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
    if scheduler is not None:
        if not (ckpt / "scheduler.pt").is_file():
            raise CheckpointError(f"{ckpt} has no scheduler.pt but this phase uses a scheduler")
        scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=False))
    restore_rng(torch.load(ckpt / "rng.pt", weights_only=False), generators)
    return state


# -- compatibility helpers (run-dir based, the pre-manifest API) -------------------------------
def save_checkpoint(
    run_dir: Path,
    model: torch.nn.Module,
    tokenizer: Any,
    snap: Snapshot,
    keep: int,
    keep_every: int = 0,
) -> Path:
    """Save a GRPO checkpoint under ``<run_dir>/checkpoints`` and apply retention."""
    store = CheckpointStore(checkpoint_dir(run_dir))
    path = save(store, f"{GRPO_PREFIX}{snap.step:06d}", model, tokenizer, snap)
    store.prune(GRPO_PREFIX, keep, keep_every)
    return Path(path)


def load_checkpoint_state(
    ckpt: Path,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    generators: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    return load_into(ckpt, optimizer, scheduler, generators)
