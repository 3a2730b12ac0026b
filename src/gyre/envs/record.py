"""What a model folder was trained on: ``gyre_env.json`` in ``sft/`` and ``final/``.

``write_model_dir`` writes the run's ``env`` and ``rollout`` config sections there. ``gyre eval``
and ``gyre train`` with ``model.path`` set to such a folder take them over unless the config
file or the command line sets ``env.*`` (or ``rollout.*``), and say so in one line; so an
arithmetic policy is not evaluated on mazes by accident.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gyre.config import Config, EnvConfig, RolloutConfig
from gyre.config.loading import ENV_RECORD


def trained_on(cfg: Config) -> dict[str, Any]:
    """The config sections a model folder records (see the module docstring)."""
    return {"env": cfg.env.model_dump(mode="json"), "rollout": cfg.rollout.model_dump(mode="json")}


def read_record(model_dir: str | Path) -> dict[str, Any] | None:
    path = Path(model_dir) / ENV_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"model.path: cannot read {path} ({exc})") from exc
    return record if isinstance(record, dict) else None


def adopt_recorded_env(cfg: Config) -> str | None:
    """Give ``cfg`` the env (and stop config) ``model.path`` was trained on, where the config
    leaves them unset; returns the one-line message to show (None: nothing to say)."""
    if not cfg.model.path:
        return None
    record = read_record(cfg.model.path)
    if record is None or "env" not in record:
        return None
    path = Path(cfg.model.path) / ENV_RECORD
    recorded = EnvConfig.model_validate(record["env"])
    if "env" in cfg.model_fields_set:
        if recorded.model_dump() != cfg.env.model_dump():
            return (
                f"note: {cfg.model.path} was trained on env.name={recorded.name} ({path}); "
                f"using env.name={cfg.env.name} as the config asks"
            )
        return None
    cfg.env = recorded
    if "rollout" in record and "rollout" not in cfg.model_fields_set:
        cfg.rollout = RolloutConfig.model_validate(record["rollout"])
    return (
        f"env.name={recorded.name} and its settings from {path} (what {cfg.model.path} was "
        "trained on); set env.* to use another env"
    )
