"""The Ray runner's section: actors, placement, async modes, recovery."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from gyre.config.base import (
    Section,
)


def check_custom_resources(section: object, roles: tuple[str, ...]) -> None:
    """Each role's ``resources`` are custom resources: positive amounts, not CPU/GPU/memory."""
    for role in roles:
        for name, amount in getattr(section, role).resources.items():
            if name in ("CPU", "GPU", "memory") or amount <= 0:
                raise ValueError(
                    f"ray.{role}.resources: '{name}: {amount:g}': custom resources are "
                    "positive amounts of names other than CPU, GPU and memory (those are "
                    f"ray.{role}.num_cpus / num_gpus)"
                )


class RoleResources(Section):
    num_cpus: float = Field(1.0, ge=0, description="Logical CPUs one actor of this role reserves.")
    num_gpus: float = Field(
        0.0, ge=0, description="GPUs one actor of this role reserves (fractions share a GPU)."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources one actor of this role reserves, e.g. {gyre_rollout: 1}: "
        "its bundle is placed only on nodes started with that resource (ray start --resources="
        "'{\"gyre_rollout\": 4}'), which pins the role to those nodes.",
    )


class HandoverConfig(Section):
    """Colocated placement: the engines and the trainer hand one pool of devices back and forth
    each step (gyre.runners.handover)."""

    sleep_engines: bool = Field(
        False,
        description="HTTP engines: put every server to sleep before the update and wake it "
        "before the weight load (vLLM /sleep + /wake_up, needs --enable-sleep-mode; SGLang "
        "/release_memory_occupation + /resume_memory_occupation; gyre serve).",
    )
    sleep_level: Literal[1, 2] = Field(
        1, description="vLLM sleep level: 1 offloads the weights to host memory, 2 drops them."
    )
    offload_optimizer: bool = Field(
        False, description="Move the trainer's optimizer state to host memory while engines run."
    )
    offload_weights: bool = Field(
        False,
        description="Move the trainer's weights to host memory too while engines run (not with "
        "ray.strategy=fsdp2).",
    )


class RayConfig(Section):
    """The Ray runner (``runner: ray``): actors, placement, async mode and recovery."""

    address: str = Field(
        "",
        description="'' starts a local Ray cluster (or joins RAY_ADDRESS when set, as inside a "
        "submitted job); 'auto' or 'ray://host:10001' joins an existing one.",
    )
    num_cpus: int = Field(0, ge=0, description="Logical CPUs of a local cluster; 0 detects them.")
    temp_dir: str = Field("", description="Ray's session directory for a local cluster.")
    namespace: str = Field("gyre", description="Ray namespace; actors are named inside it.")
    rollout_workers: int = Field(2, gt=0, description="Rollout actors (engine + env factory).")
    trainer_ranks: int = Field(
        1, gt=0, description="Trainer actors doing data-parallel updates over torch.distributed."
    )
    placement: Literal["colocated", "disaggregated"] = Field(
        "disaggregated",
        description="colocated: roles share bundles and alternate; disaggregated: own bundles, "
        "generation overlaps training.",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy for the bundles."
    )
    rollout: RoleResources = Field(
        default_factory=RoleResources, description="Resources of one rollout actor."
    )
    trainer: RoleResources = Field(
        default_factory=RoleResources, description="Resources of one trainer actor."
    )
    mode: Literal["sync", "one-step-off", "async"] = Field(
        "sync",
        description="sync: generate then train; one-step-off: generate batch n+1 while training "
        "n; async: generation runs up to ray.async_ahead batches ahead.",
    )
    max_staleness: int = Field(
        1, ge=0, description="A trajectory of policy v trains version v+k only while k <= this."
    )
    async_ahead: int = Field(
        -1, ge=-1, description="async mode: batches generation may run ahead; -1 = max_staleness."
    )
    tasks_per_share: int = Field(
        0,
        ge=0,
        description="Tasks in one unit of rollout work handed to a worker; 0 = tasks_per_step / "
        "rollout_workers (rounded up to a divisor).",
    )
    strategy: Literal["auto", "ddp", "fsdp2"] = Field(
        "auto", description="Data parallelism: ddp (gloo, CPU) or fsdp2 (nccl, GPU); auto picks."
    )
    handover: HandoverConfig = Field(
        default_factory=HandoverConfig,
        description="Colocated placement: engines sleep for the update, the trainer offloads.",
    )
    max_rollout_restarts: int = Field(
        8, ge=0, description="Dead rollout actors replaced before the run fails."
    )
    max_trainer_restarts: int = Field(
        2, ge=0, description="Trainer-group restarts from the latest checkpoint before failing."
    )
    health_check_period_s: float = Field(
        3.0,
        gt=0,
        description="Seconds between Ray's health checks of a node, and each check's timeout (a "
        "local cluster gyre starts; a joined cluster uses its head's --system-config).",
    )
    health_check_failures: int = Field(
        5,
        gt=0,
        description="Missed health checks after which Ray declares a node dead: a node that "
        "stops answering is lost within 2 x health_check_period_s x this.",
    )
    replacement_wait_s: float = Field(
        600.0,
        gt=0,
        description="Seconds a replacement actor may wait for room (e.g. a replacement node "
        "with the role's resources to join) before the run stops with one line.",
    )

    @model_validator(mode="after")
    def _check_roles(self) -> RayConfig:
        check_custom_resources(self, ("rollout", "trainer"))
        h = self.handover
        on = [k for k in ("sleep_engines", "offload_optimizer", "offload_weights") if getattr(h, k)]
        if on and self.placement != "colocated":
            raise ValueError(
                f"ray.handover.{on[0]} hands the devices between engines and trainer: it needs "
                f"ray.placement=colocated (is {self.placement})"
            )
        if h.offload_weights and self.strategy == "fsdp2":
            raise ValueError("ray.handover.offload_weights does not work with ray.strategy=fsdp2")
        return self

    @field_validator("address")
    @classmethod
    def _check_address(cls, v: str) -> str:
        if v not in ("", "auto", "local") and not v.startswith(("ray://", "http")) and ":" not in v:
            raise ValueError("use '', 'auto', 'local', 'ray://HOST:PORT' or 'HOST:PORT'")
        return v
