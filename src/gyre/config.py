"""Typed configuration: a pydantic tree, YAML files and dotted ``key=value`` overrides.

Every field carries a one-line description (shown by ``gyre train --help-config``). Unknown keys
and bad values stop the run with an error that names the dotted key and the offending value.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the value."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Section):
    dir: str = Field("", description="Run directory; empty means runs/<env>-<timestamp>.")
    seed: int = Field(0, description="Master seed for model init, data order and sampling.")
    resume: str = Field(
        "never",
        description="'auto' resumes from the newest checkpoint in run.dir, 'never' starts fresh, "
        "or a checkpoint path.",
    )
    device: str = Field("cpu", description="Torch device: 'cpu', 'cuda', 'cuda:1' or 'auto'.")
    threads: int = Field(0, ge=0, description="Torch intra-op threads; 0 uses every core.")


class ModelConfig(_Section):
    path: str = Field(
        "", description="Local Hugging Face causal-LM folder; empty builds the tiny default."
    )
    hidden_size: int = Field(128, gt=0, description="Tiny default: hidden width.")
    num_layers: int = Field(4, gt=0, description="Tiny default: transformer layers.")
    num_heads: int = Field(4, gt=0, description="Tiny default: attention heads.")
    intermediate_size: int = Field(384, gt=0, description="Tiny default: MLP width.")
    max_positions: int = Field(1024, gt=0, description="Tiny default: longest context in tokens.")


class MazeConfig(_Section):
    size: int = Field(5, ge=5, description="Maze side length in cells (at least 5).")
    wall_density: float = Field(
        0.3, ge=0.0, lt=0.7, description="Fraction of cells that are walls."
    )
    min_distance: int = Field(
        4, ge=4, description="Shortest start-to-goal path, in moves, is at least this."
    )
    budget_factor: float = Field(
        2.0, ge=1.0, le=2.0, description="Move budget = floor(factor * shortest path), at most 2x."
    )
    observation: Literal["compass", "exits", "window", "grid"] = Field(
        "compass",
        description="compass: grid once, then neighbours + goal offset; exits: grid once, then "
        "the open moves + goal offset; window: a local square; grid: the whole grid every turn.",
    )
    view: int = Field(
        1, ge=1, description="View radius: compass cells within this many moves; window half-width."
    )


class ArithmeticConfig(_Section):
    max_operand: int = Field(99, gt=0, description="Operands are drawn from [0, max_operand].")
    ops: str = Field("+-", min_length=1, description="Operators to draw from, e.g. '+-*'.")


class EnvConfig(_Section):
    name: Literal["maze", "arithmetic"] = Field("maze", description="Which built-in environment.")
    maze: MazeConfig = Field(default_factory=MazeConfig, description="Maze settings.")
    arithmetic: ArithmeticConfig = Field(
        default_factory=ArithmeticConfig, description="Arithmetic settings."
    )


class SamplingConfig(_Section):
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(4, gt=0, description="Most tokens the policy may write per turn.")


class SFTConfig(_Section):
    steps: int = Field(600, ge=0, description="SFT optimizer steps; 0 skips SFT.")
    batch_size: int = Field(32, gt=0, description="Demonstration episodes per SFT step.")
    lr: float = Field(3e-3, gt=0, description="SFT AdamW learning rate.")
    warmup_steps: int = Field(10, ge=0, description="Linear LR warmup steps.")
    demos: int = Field(4000, gt=0, description="Number of demonstration episodes generated.")
    noise: float = Field(
        0.25, ge=0.0, le=1.0, description="Probability that the demonstrator makes a random move."
    )


class TrainConfig(_Section):
    steps: int = Field(60, ge=0, description="GRPO steps (rollout + update each).")
    tasks_per_step: int = Field(16, gt=0, description="Distinct tasks (prompts) per GRPO step.")
    group_size: int = Field(
        8, ge=2, description="Samples per task (G) for group-relative advantages."
    )
    lr: float = Field(3e-4, gt=0, description="GRPO AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    clip_eps: float = Field(0.2, gt=0, description="PPO clip range epsilon.")
    kl_coef: float = Field(0.0, ge=0, description="k3 KL-to-reference coefficient; 0 loads no ref.")
    adv_eps: float = Field(1e-6, gt=0, description="Epsilon in the group std normalisation.")
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = Field(
        "seq-mean-token-mean",
        description="How token losses combine: per token, or per sequence then averaged.",
    )
    mini_batches: int = Field(
        4, gt=0, description="Optimizer steps per rollout batch (PPO mini-batches)."
    )
    micro_batch_size: int = Field(
        64, gt=0, description="Trajectories per forward/backward (gradient accumulation)."
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig, description="Rollout sampling parameters."
    )


class EvalConfig(_Section):
    episodes: int = Field(500, ge=0, description="Held-out episodes per evaluation.")
    every: int = Field(20, ge=0, description="Evaluate every N GRPO steps; 0 only before/after.")
    sampled: bool = Field(True, description="Also report sampled (temperature) success.")


class CheckpointConfig(_Section):
    every: int = Field(20, ge=0, description="Checkpoint every N GRPO steps; 0 only at the end.")
    keep: int = Field(3, ge=1, description="How many recent checkpoints to keep.")


class LogConfig(_Section):
    console: Literal["auto", "rich", "plain", "off"] = Field(
        "auto", description="Console output: rich live view, plain lines, or nothing."
    )

    @field_validator("console", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` in a config file as False.
        return "off" if v is False else v


class TelemetryConfig(_Section):
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

    @field_validator("prometheus_port", mode="before")
    @classmethod
    def _port_off(cls, v: Any) -> Any:
        # 'off', 'none' or 'null' on the command line (or `off` in YAML, read as False) disable it.
        if v is False or (isinstance(v, str) and v.strip().lower() in ("off", "none", "null", "")):
            return None
        return v


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig, description="Run identity and placement.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model.")
    env: EnvConfig = Field(default_factory=EnvConfig, description="Environment.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Supervised warm start.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="GRPO training.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpointing."
    )
    log: LogConfig = Field(default_factory=LogConfig, description="Console logging.")
    telemetry: TelemetryConfig = Field(
        default_factory=TelemetryConfig, description="Metric sinks, exporter and samples."
    )

    @field_validator("run")
    @classmethod
    def _check_run(cls, v: RunConfig) -> RunConfig:
        if v.resume not in ("auto", "never") and not v.resume:
            raise ValueError("run.resume must be 'auto', 'never' or a path")
        return v


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{'.'.join(parts[: i + 1])}' is not a section")
        node = child
    node[parts[-1]] = value


_YAML11_BOOL_WORDS = {"on", "off", "yes", "no", "y", "n"}


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{item}' has an empty key")
    if raw.strip().lower() in _YAML11_BOOL_WORDS:
        # YAML 1.1 reads on/off/yes/no as booleans; keep the word so 'log.console=off' works
        # (pydantic still accepts these words for bool fields).
        return key, raw.strip()
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if value is None:
        value = raw
    return key, value


def _describe(errors: ValidationError, tree: dict[str, Any]) -> str:
    lines = []
    for err in errors.errors():
        loc = [str(p) for p in err["loc"]]
        key = ".".join(loc)
        node: Any = tree
        for p in loc:
            node = node.get(p, "<missing>") if isinstance(node, dict) else "<missing>"
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown config key '{key}' (value {node!r})")
        else:
            lines.append(f"bad value for '{key}': {node!r} ({err['msg']})")
    return "; ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build a :class:`Config` from an optional YAML file plus dotted overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file '{p}' is not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file '{p}' must hold a mapping at the top level")
        tree = loaded
    for item in overrides or []:
        key, value = _parse_override(item)
        _set_dotted(tree, key, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, tree)) from None


def resolve_run_dir(cfg: Config) -> Path:
    """Fill in ``run.dir`` when empty (runs/<env>-<timestamp>) and return it as a Path."""
    if not cfg.run.dir:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg.run.dir = str(Path("runs") / f"{cfg.env.name}-{stamp}")
    return Path(cfg.run.dir)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def describe_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """One line per leaf field: dotted key, default and description (for ``--help-config``)."""
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(describe_fields(ann, key + "."))
        else:
            default = field.get_default(call_default_factory=True)
            out.append(f"{key} = {default!r}  # {field.description}")
    return out
