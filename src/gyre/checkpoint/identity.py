"""Config identity of a checkpoint: which resolved-config keys a resume must match, their hash
(in the manifest), and the field-by-field explanation of a config or model mismatch."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gyre.checkpoint.snapshot import CONFIG_FILE

log = logging.getLogger(__name__)


class CheckpointMismatchError(ValueError):
    """The checkpoint belongs to a different config or model; the message lists the fields."""


# Keys that may change between a checkpoint and its resume without changing the trajectory (or
# that only extend it, like train.steps). Every other key is part of the run's identity.
RESUME_MAY_CHANGE = (
    "run.dir",
    "run.resume",
    "run.overwrite",
    "run.threads",
    "run.device",
    "model.path",
    "engine.api_key",  # a secret (written as '***'): rotating it changes nothing
    "engine.api_key_file",
    "engine.verify_every",  # the sync check only reads the engines
    "engine.verify_tolerance",
    "engine.verify_tokens",
    "ray.address",  # where the cluster is and where Ray keeps its session: not the run
    "ray.temp_dir",
    # Placement: where the roles run and on how many trainer ranks, not what they compute. A
    # checkpoint holds the whole model and optimizer state whatever the ranks (FSDP2 gathers
    # them), so another rank count, strategy, or cluster shape resumes it. Rank counts change
    # only the float order of the gradient sum, and with several optimizer steps per batch
    # which rows share a step (each rank cuts its own shard into mini-batches).
    "ray.trainer_ranks",
    "ray.strategy",
    "ray.num_cpus",
    "ray.namespace",
    "ray.placement",
    "ray.placement_strategy",
    "ray.rollout.",
    "ray.trainer.",
    "ray.handover.",
    "ray.max_rollout_restarts",  # recovery budgets and node-health deadlines
    "ray.max_trainer_restarts",
    "ray.health_check_period_s",
    "ray.health_check_failures",
    "ray.replacement_wait_s",
    "train.steps",
    "eval.",
    "checkpoint.",
    "log.",
    "faults.",
)


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def identity(config: Mapping[str, Any]) -> dict[str, Any]:
    """The flattened config keys a resume must match."""
    return {
        k: v
        for k, v in _flatten(config).items()
        if not any(k == p or (p.endswith(".") and k.startswith(p)) for p in RESUME_MAY_CHANGE)
    }


def config_hash(config: Mapping[str, Any]) -> str:
    blob = json.dumps(identity(config), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def diff_fields(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``key: checkpoint=X, now=Y`` for every differing key of two flat mappings."""
    missing = object()
    lines = []
    for k in sorted(set(saved) | set(now)):
        a, b = saved.get(k, missing), now.get(k, missing)
        if a != b:
            fa = "<absent>" if a is missing else repr(a)
            fb = "<absent>" if b is missing else repr(b)
            lines.append(f"{k}: checkpoint={fa}, now={fb}")
    return lines


def check_config(ckpt: Path, config: Mapping[str, Any]) -> None:
    """Raise :class:`CheckpointMismatchError` listing the identity keys that differ."""
    path = Path(ckpt) / CONFIG_FILE
    if not path.is_file():
        return
    saved = json.loads(path.read_text())
    diffs = diff_fields(identity(saved), identity(config))
    if diffs:
        raise CheckpointMismatchError(
            f"checkpoint {ckpt} was written by a run with a different config:\n  "
            + "\n  ".join(diffs)
            + "\nrestore these values to resume it, or start a new run (another run.dir, "
            "or run.resume=never run.overwrite=true)"
        )
    warn_schedule_retimed(saved, config)


def warn_schedule_retimed(saved: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """A decaying GRPO LR schedule spans ``train.steps``: resuming with another ``train.steps``
    re-times the decay from the checkpoint on, so the run no longer equals one run of the new
    length (the steps already taken decayed towards the old end)."""
    a, b = _flatten(saved), _flatten(now)
    old, new = a.get("train.steps"), b.get("train.steps")
    schedule = b.get("train.lr_schedule")
    if old != new and schedule in ("linear", "cosine"):
        log.warning(
            "train.steps: checkpoint=%s, now=%s with train.lr_schedule=%s: the LR decay is "
            "re-timed to end at step %s, so this run differs from one %s-step run",
            old,
            new,
            schedule,
            new,
            new,
        )


# Model config keys that say nothing about the weights' shape or meaning.
_MODEL_KEYS_IGNORED = {
    "transformers_version",
    "_name_or_path",
    "dtype",
    "torch_dtype",
    "architectures",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
}


def check_model(ckpt_model: Path, base_model: Path) -> None:
    """The checkpoint's model must have the architecture of ``model.path``; list differences."""
    a, b = Path(ckpt_model) / "config.json", Path(base_model) / "config.json"
    if not (a.is_file() and b.is_file()):
        return
    ca, cb = json.loads(a.read_text()), json.loads(b.read_text())
    diffs = diff_fields(
        {k: v for k, v in ca.items() if k not in _MODEL_KEYS_IGNORED},
        {k: v for k, v in cb.items() if k not in _MODEL_KEYS_IGNORED},
    )
    if diffs:
        raise CheckpointMismatchError(
            f"checkpoint model {ckpt_model} does not match model.path {base_model}:\n  "
            + "\n  ".join(diffs)
        )
