"""Typed configuration: a pydantic tree, YAML files and dotted ``key=value`` overrides.

Every field carries a one-line description (shown by ``gyre train --help-config``). Unknown keys
and bad values stop the run with an error that names the dotted key and the offending value.

The sections live by subject: ``base`` (the section base, bounds), ``run`` (run, model, env,
rollout), ``train`` (sampling, SFT, algorithm, DAPO, GRPO), ``engine`` (engine, ``perf:``),
``ops`` (eval, checkpoint, faults, log, telemetry), ``ray``, ``rewards``; ``root`` holds
:class:`Config` and ``loading`` the YAML / override parsing. Import them from here.
"""

from gyre.config.base import (
    MAX_LR,
    MIN_TEMPERATURE,
    REDACTED,
    SEED_LIMIT,
    THREADS_PER_CORE,
    ConfigError,
)
from gyre.config.engine import (
    EngineConfig,
    PerfConfig,
)
from gyre.config.loading import (
    describe_fields,
    dump_config,
    load_config,
    resolve_run_dir,
)
from gyre.config.ops import (
    CheckpointConfig,
    EvalConfig,
    FaultsConfig,
    LogConfig,
    TelemetryConfig,
)
from gyre.config.ray import (
    RayConfig,
    RoleResources,
)
from gyre.config.rewards import (
    RewardConfig,
    RewardFnConfig,
    SandboxConfig,
)
from gyre.config.root import (
    Config,
    check_ray_config,
    tasks_per_share,
)
from gyre.config.run import (
    BUILTIN_ENVS,
    ArithmeticConfig,
    DatasetConfig,
    EnvConfig,
    LoraConfig,
    MazeConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
)
from gyre.config.train import (
    AlgoConfig,
    DapoConfig,
    LevelReplayConfig,
    SamplingConfig,
    SFTConfig,
    TrainConfig,
)
from gyre.config.visual import MiniGridConfig, VisualMazeConfig

__all__ = [
    "BUILTIN_ENVS",
    "MAX_LR",
    "MIN_TEMPERATURE",
    "REDACTED",
    "SEED_LIMIT",
    "THREADS_PER_CORE",
    "AlgoConfig",
    "ArithmeticConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DapoConfig",
    "DatasetConfig",
    "EngineConfig",
    "EnvConfig",
    "EvalConfig",
    "FaultsConfig",
    "LevelReplayConfig",
    "LogConfig",
    "LoraConfig",
    "MazeConfig",
    "MiniGridConfig",
    "ModelConfig",
    "PerfConfig",
    "RayConfig",
    "RewardConfig",
    "RewardFnConfig",
    "RoleResources",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SamplingConfig",
    "SandboxConfig",
    "TelemetryConfig",
    "TrainConfig",
    "VisualMazeConfig",
    "check_ray_config",
    "describe_fields",
    "dump_config",
    "load_config",
    "resolve_run_dir",
    "tasks_per_share",
]
