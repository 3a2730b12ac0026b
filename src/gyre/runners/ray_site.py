"""What the Ray runner's rollout-worker pool and trainer group share: the placement group their
actors go into, the bounded waits, the node watch and the recovery counters.

:class:`ActorSite` is built once per run by :class:`gyre.runners.ray.RayPlacement` and handed
to :class:`gyre.runners.rollout_pool.RolloutPool` and
:class:`gyre.runners.trainer_group.TrainerGroup`: each places its actors in their bundles, and
counts its restarts (past ``ray.max_<role>_restarts`` the run fails) and the nodes Ray declared
lost, in the same ``recovery/*`` counters the metrics show.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from gyre.config import Config
from gyre.config.ray import RoleResources
from gyre.runners.bounded import Waits
from gyre.runners.nodes import NodeWatch
from gyre.runners.placement import require_ray, user_module_path
from gyre.telemetry.factory import Telemetry

ray = require_ray()
from ray.exceptions import RayActorError  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402, F401
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

DIED = (RayActorError, ray.exceptions.ActorUnavailableError)  # the actor is gone
LOST = ray.exceptions.ObjectLostError  # an object whose node (and copies) are gone

RECOVERY_COUNTERS = (
    "recovery/rollout_restarts",
    "recovery/trainer_restarts",
    "recovery/reissued_shares",
    "recovery/regathered_weights",
    "recovery/lost_nodes",
)


@dataclass
class ActorSite:
    """The placement group, waits, node watch and recovery counters of one Ray run."""

    cfg: Config
    pg: Any  # the run's placement group
    waits: Waits
    nodes: NodeWatch
    prefix: str  # actor names start with it (gyre.runners.placement.actor_prefix)
    out: Telemetry
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RECOVERY_COUNTERS, 0))

    def actor(self, cls: Any, name: str, role: RoleResources, bundle: int) -> Any:
        """``cls`` (a Ray actor class) as the actor ``name`` in ``bundle`` of the run's
        placement group, with its role's CPUs and GPUs; ``.remote(...)`` starts it. Ray never
        restarts it: gyre does, and counts it."""
        return cls.options(
            name=name,
            num_cpus=role.num_cpus,
            num_gpus=role.num_gpus,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=bundle
            ),
            runtime_env=self.env_vars(role.num_cpus),
        )

    def env_vars(self, num_cpus: float) -> dict[str, Any]:
        """An actor's runtime env: its torch threads, the user's module path, fault injection."""
        threads = str(self.cfg.run.threads or max(1, int(num_cpus)))
        env = {"OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
        path = user_module_path(self.cfg)
        if path:
            env["PYTHONPATH"] = path
        if os.environ.get("GYRE_FAULT"):  # fault injection of a test reaches the actors too
            env["GYRE_FAULT"] = os.environ["GYRE_FAULT"]
        return {"env_vars": env}

    def count_restart(self, role: str, what: str, why: BaseException) -> int:
        """Count a restart of ``role``; past ``ray.max_<role>_restarts`` the run fails."""
        key = f"recovery/{role}_restarts"
        self.counters[key] += 1
        n, limit = self.counters[key], getattr(self.cfg.ray, f"max_{role}_restarts")
        if n > limit:
            raise RuntimeError(f"{what} {n} times (ray.max_{role}_restarts={limit})") from why
        return n

    def note_lost_nodes(self) -> None:
        """Name every node Ray declared dead since the last call, and count it."""
        for line in self.nodes.newly_lost():
            self.out.message(line)
            self.counters["recovery/lost_nodes"] += 1
