"""Evaluation, checkpoints, fault policies, logging and telemetry sections."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from gyre.config.base import (
    Section,
)


class EvalConfig(Section):
    episodes: int = Field(
        500, ge=0, le=2**31, description="Held-out episodes per evaluation (seeds 2^31 + i)."
    )
    validation_episodes: int = Field(
        0,
        ge=0,
        le=2**31,
        description="Validation episodes per evaluation on their own seeds (2^32 + i), never "
        "training or held-out ones; 0 = none. Logged as val/*.",
    )
    every: int = Field(20, ge=0, description="Evaluate every N GRPO steps; 0 only before/after.")
    sampled: bool = Field(True, description="Also report sampled (temperature) success.")
    select: Literal["last", "val"] = Field(
        "last",
        description="final/: the last weights, or (val) those of the evaluation (before GRPO, "
        "every eval.every steps, last) with the best validation greedy success; needs "
        "eval.validation_episodes > 0. Held-out results are never used to choose.",
    )

    @model_validator(mode="after")
    def _check_select(self) -> EvalConfig:
        if self.select == "val" and self.validation_episodes == 0:
            raise ValueError(
                "eval.select=val chooses final/ by validation success: set "
                "eval.validation_episodes > 0"
            )
        return self


class CheckpointConfig(Section):
    every: int = Field(20, ge=0, description="Checkpoint every N GRPO steps; 0 only at the end.")
    keep: int = Field(3, ge=1, description="How many recent checkpoints to keep.")
    keep_every: int = Field(
        0, ge=0, description="Also keep every checkpoint whose step is a multiple of this; 0: none."
    )
    sft_every: int = Field(
        100, ge=0, description="Checkpoint every N SFT steps (resumable SFT); 0: never."
    )
    dir: str = Field(
        "",
        description="Checkpoint root: a path or fsspec URL (s3://... needs s3fs); "
        "empty: <run.dir>/checkpoints.",
    )
    on_error: Literal["stop", "continue"] = Field(
        "stop", description="A failed checkpoint write (e.g. disk full): stop the run or go on."
    )
    upload_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Object stores (checkpoint.dir=s3://...): longest a checkpoint upload may "
        "take before the run stops with a storage fault (exit 69).",
    )


class FaultsConfig(Section):
    max_nonfinite_streak: int = Field(
        3, ge=1, description="Abort after this many steps in a row with a NaN/inf loss or grad."
    )
    max_failed_fraction: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Abort when more than this share of all episodes so far raised in the env.",
    )
    call_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="runner=ray: longest wait for one actor call (a rollout share, an update, "
        "a checkpoint save) before the run stops with a worker/trainer fault (exit 69).",
    )
    startup_timeout_s: float = Field(
        600.0,
        gt=0,
        description="runner=ray: longest wait for start-up (placement group, actors, the "
        "trainer group's rendezvous and collective init; also each collective's timeout).",
    )
    heartbeat_s: float = Field(
        60.0,
        ge=0,
        description="During a long wait on a peer, log 'waiting for <stage> on <peer>' this "
        "often (seconds); 0 = never.",
    )
    max_rollout_logprob_gap: float = Field(
        0.15,
        ge=0.0,
        description="Abort (exit 3) when an on-policy step's train/rollout_logprob_gap (mean "
        "|trainer - engine| log-prob per sampled token, nats) is over this: the engines do not "
        "sample the trainer's policy. fp32 engines: ~1e-7; bf16 servers: ~0.01-0.05. 0 = off.",
    )


class LogConfig(Section):
    console: Literal["auto", "rich", "plain", "off"] = Field(
        "auto", description="Console output: rich live view, plain lines, or nothing."
    )
    no_signal_steps: int = Field(
        3,
        ge=0,
        description="Warn when this many steps in a row have no group with reward spread "
        "(rollout/frac_reward_zero_std = 1.0: nothing to learn); 0 = never.",
    )

    @field_validator("console", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` in a config file as False.
        return "off" if v is False else v


class TelemetryConfig(Section):
    tensorboard: bool = Field(False, description="Write TensorBoard event files to <run.dir>/tb.")
    prometheus_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve Prometheus metrics on this port (0: any free port); None: no exporter.",
    )
    prometheus_host: str = Field(
        "127.0.0.1", description="Address the Prometheus exporter binds (loopback by default)."
    )
    wandb: bool = Field(False, description="Log to Weights & Biases (needs gyre[wandb]).")
    wandb_project: str = Field("gyre", description="wandb project name.")
    mlflow: bool = Field(False, description="Log to MLflow (needs gyre[mlflow]).")
    mlflow_tracking_uri: str = Field(
        "", description="MLflow tracking URI; empty uses MLflow's default (MLFLOW_TRACKING_URI)."
    )
    samples: float = Field(
        0.0625,
        ge=0.0,
        le=1.0,
        description="Fraction of each step's trajectories written to <run.dir>/samples.jsonl.",
    )
    sample_frames: int = Field(
        2,
        ge=0,
        description="Image envs: of each step's written samples, this many get their frames "
        "drawn as a PNG strip in <run.dir>/frames/ (docs/vision.md); 0 draws none.",
    )

    @field_validator("prometheus_port", mode="before")
    @classmethod
    def _port_off(cls, v: Any) -> Any:
        # 'off', 'none' or 'null' on the command line (or `off` in YAML, read as False) disable it.
        if v is False or (isinstance(v, str) and v.strip().lower() in ("off", "none", "null", "")):
            return None
        return v
