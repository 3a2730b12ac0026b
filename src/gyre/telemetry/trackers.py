"""Optional experiment trackers: Weights & Biases and MLflow.

Neither package is a dependency of gyre; turning a tracker on without it installed stops the run
before training with a message naming the extra to install. Both receive every logged key at its
step, the resolved config as parameters, and the run directory's name as the run name.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class WandbSink:
    """``wandb.init(project, name=<run dir name>, dir=<run.dir>)``; ``WANDB_MODE=offline`` works."""

    def __init__(self, run_dir: str | Path, project: str, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(
                "telemetry.wandb=true needs the wandb package: pip install 'gyre[wandb]'"
            ) from exc
        run_dir = Path(run_dir)
        self._run = wandb.init(
            project=project, name=run_dir.name, dir=str(run_dir), config=config, resume="allow"
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(_finite(metrics), step=step)

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    """An MLflow run named after the run directory; params are the flattened config."""

    def __init__(self, run_dir: str | Path, tracking_uri: str, config: dict[str, Any]) -> None:
        try:
            import mlflow
        except ImportError as exc:
            raise ImportError(
                "telemetry.mlflow=true needs the mlflow package: pip install 'gyre[mlflow]'"
            ) from exc
        self._mlflow = mlflow
        if tracking_uri:
            mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_experiment("gyre")
        self._run = mlflow.start_run(run_name=Path(run_dir).name)
        mlflow.log_params({k: str(v)[:500] for k, v in _flatten(config).items()})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._mlflow.log_metrics(_finite(metrics), step=step)

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        self._mlflow.end_run()
