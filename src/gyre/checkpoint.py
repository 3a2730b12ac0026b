"""Checkpoints: ``<run.dir>/checkpoints/step_000010/`` holding everything a resume needs.

Contents: ``model/`` (a Hugging Face folder: safetensors weights + config + tokenizer),
``optimizer.pt``, ``rng.pt`` (python, numpy and torch generator states) and ``state.json`` (step,
policy version, data cursor, earlier eval results). A checkpoint is written into a temporary
directory and renamed into place, so a crash mid-write never leaves a half checkpoint under a
``step_*`` name.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "state.json"


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (ordered by step number, not by name or mtime)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("step_") and (p / STATE_FILE).is_file():
            try:
                found.append((int(p.name.split("_", 1)[1]), p))
            except ValueError:
                continue
    return [p for _, p in sorted(found)]


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int,
) -> Path:
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(
        {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        },
        tmp / "rng.pt",
    )
    (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=2))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint_state(ckpt: Path, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore optimizer and RNG states; return ``state.json`` (the model loads separately)."""
    state = json.loads((ckpt / STATE_FILE).read_text())
    optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
    rng = torch.load(ckpt / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    return state


def find_resume(run_dir: Path, resume: str) -> Path | None:
    """Which checkpoint to resume from: None for a fresh start."""
    if resume == "never":
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    p = Path(resume)
    if not (p / STATE_FILE).is_file():
        raise FileNotFoundError(f"run.resume='{resume}' is not a checkpoint (no {STATE_FILE})")
    return p
