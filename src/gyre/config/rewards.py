"""Reward functions and their sandbox."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
)

from gyre.config.base import (
    Section,
)


class RewardFnConfig(Section):
    fn: str = Field(description="Import path 'module:function' of a batched reward function.")
    name: str = Field("", description="Metric name (reward/<name>_mean); default: function name.")
    weight: float = Field(1.0, description="Weight of this term in the total reward.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments passed on every call."
    )
    sandbox: bool = Field(
        False, description="Run in the sandbox (subprocess, time/memory limits, no network)."
    )

    @field_validator("fn")
    @classmethod
    def _import_path(cls, v: str) -> str:
        mod, sep, attr = v.partition(":")
        if not sep or not mod.strip() or not attr.strip():
            raise ValueError(f"expected 'module:function', got {v!r}")
        return v


class SandboxConfig(Section):
    timeout_s: float = Field(10.0, gt=0, description="Wall-time limit of one sandboxed call.")
    memory_mb: int = Field(
        1024, ge=64, description="Address-space limit (RLIMIT_AS) of a sandbox worker, in MiB."
    )
    network: Literal["deny", "allow"] = Field(
        "deny",
        description="deny: a new user+network namespace (no interfaces); fails loudly if the "
        "kernel refuses. allow: no network isolation.",
    )
    workers: int = Field(2, gt=0, description="Worker processes, reused across calls.")
    max_processes: int = Field(
        64,
        ge=4,
        description="Processes and threads a worker may have at once, the sandbox's own 3 "
        "included: a pids cgroup for root trainers where one can be made, else RLIMIT_NPROC "
        "(docs/rewards.md: where each is enforced).",
    )
    user: str = Field(
        "",
        description="When the trainer runs as root, workers switch to this user (e.g. 'nobody') "
        "before confining themselves: file permissions then apply, and so does RLIMIT_NPROC. "
        "'' keeps root. Python and the reward modules must be readable by that user.",
    )
    read_only: list[str] = Field(
        default_factory=list,
        description="Extra paths made read-only for reward code (bind mounts in the worker's "
        "mount namespace); the run dir always is.",
    )
    failure_reward: float = Field(
        0.0, description="Reward given to a sample whose call failed (sandboxed or in process)."
    )
    max_failure_frac: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="Stop the run when more than this fraction of a step's sandboxed calls, or "
        "of a batch an in-process function raised on, fail.",
    )


class RewardConfig(Section):
    functions: list[RewardFnConfig] = Field(
        default_factory=list,
        description="Reward functions, each {fn: 'module:function', name, weight, kwargs, "
        "sandbox}; empty uses the env's own reward exactly.",
    )
    env_weight: float = Field(
        1.0, description="Weight of the env's reward (the term 'env') when functions are set."
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig, description="Limits for functions with sandbox: true."
    )

    @property
    def env_success_scored(self) -> bool:
        """Whether the env's own reward (and so its ``success``) is part of the run's reward;
        False when reward functions alone score it (``env_weight: 0``), where the console and
        the results table show the functions' reward instead of the env's success."""
        return not self.functions or self.env_weight != 0
