"""Typed configuration: a pydantic tree, YAML files and dotted ``key=value`` overrides.

Every field carries a one-line description (shown by ``gyre --help-config``, and in the
generated docs/reference/config.md). Unknown keys and bad values stop the run with an error that
names the dotted key and the offending value.

The sections live by subject: ``base`` (the section base, bounds), ``run`` (run, model,
rollout and the small env sections), ``envs`` (the ``env`` section, built from a registry of the
built-in envs' sections; the maze's in ``maze``), ``train``
(sampling, SFT, algorithm, DAPO, GRPO), ``engine`` (engine, ``perf:``), ``ops`` (eval,
checkpoint, faults, log, telemetry), ``ray``, ``rewards``; ``root`` holds :class:`Config` and
``loading`` the YAML / override parsing and the shipped recipes. Import them from here.

The names below load on first use (PEP 562): an env module can import ``gyre.config.base`` for
its section without loading the whole tree, which in turn imports that section.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "gyre.config.base": [
        "MAX_LR",
        "MIN_TEMPERATURE",
        "REDACTED",
        "SEED_LIMIT",
        "THREADS_PER_CORE",
        "ConfigError",
    ],
    "gyre.config.engine": ["EngineConfig", "PerfConfig"],
    "gyre.config.loading": [
        "describe_fields",
        "dump_config",
        "load_config",
        "load_recipe",
        "recipe_path",
        "resolve_run_dir",
    ],
    "gyre.config.ops": [
        "CheckpointConfig",
        "EvalConfig",
        "FaultsConfig",
        "LogConfig",
        "TelemetryConfig",
    ],
    "gyre.config.ray": ["RayConfig", "RoleResources"],
    "gyre.config.rewards": ["RewardConfig", "RewardFnConfig", "SandboxConfig"],
    "gyre.config.root": ["Config", "check_ray_config", "tasks_per_share"],
    "gyre.config.envs": ["BUILTIN_ENVS", "ENV_SECTIONS", "EnvConfig"],
    "gyre.config.run": [
        "ArithmeticConfig",
        "DatasetConfig",
        "LoraConfig",
        "ModelConfig",
        "RolloutConfig",
        "RunConfig",
    ],
    "gyre.config.maze": ["MazeConfig"],
    "gyre.config.train": [
        "AlgoConfig",
        "DapoConfig",
        "LevelReplayConfig",
        "SamplingConfig",
        "SFTConfig",
        "TrainConfig",
    ],
    "gyre.config.visual": ["MiniGridConfig", "VisualMazeConfig"],
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'gyre.config' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
