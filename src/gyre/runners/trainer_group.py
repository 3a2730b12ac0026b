"""The Ray runner's trainer group: ``ray.trainer_ranks`` :class:`~gyre.runners.actors.TrainerRank`
actors, data-parallel over torch.distributed (DDP on gloo, FSDP2 on nccl).

It starts the ranks in their bundles (waiting, up to ``ray.replacement_wait_s``, for a node with
room, e.g. a replacement node), joins them into one process group, runs the update of each
rank's shard, gathers the new weights for the engines (rank 0; every rank under FSDP2, whose
gather is a collective) and writes checkpoints. A rank that dies raises
:class:`TrainerGroupFailed`: the placement then kills the whole group and starts it again from
the newest checkpoint (:meth:`gyre.runners.ray.RayPlacement.restart_trainers`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gyre.runners.actors import TrainerRank
from gyre.runners.bounded import Waits
from gyre.runners.placement import combine_ranks, gathers_on_every_rank
from gyre.runners.ray_site import DIED, ActorSite, ray
from gyre.types import Trajectory


class TrainerGroupFailed(RuntimeError):
    """A trainer rank died; the group restarts from the latest checkpoint."""


def trainer_get(waits: Waits, refs: Any, stage: str) -> Any:
    """Wait for trainer calls; a dead rank is :class:`TrainerGroupFailed`."""
    try:
        return waits.get(refs, "trainer", stage, "the trainer group")
    except DIED as exc:
        raise TrainerGroupFailed(str(exc)) from exc


class TrainerGroup:
    """The trainer ranks of one Ray run, in the bundles ``bundles`` (one per rank)."""

    def __init__(self, site: ActorSite, bundles: list[int], ref_path: Path) -> None:
        self.site, self.cfg = site, site.cfg
        self.bundles = bundles
        self.ref_path = ref_path  # the KL reference every rank loads
        self.cls = ray.remote(TrainerRank)
        self.trainers: list[Any] = []
        # FSDP2: every rank joins the gather of the whole model, rank 0 returns or writes it
        self.gather_all = gathers_on_every_rank(self.cfg)

    def _get(self, refs: Any, stage: str) -> Any:
        return trainer_get(self.site.waits, refs, stage)

    def start(self, policy_path: Path, checkpoint: Path | None, epoch: int) -> None:
        """Start every rank on ``policy_path`` (restoring ``checkpoint``) and join the group."""
        site, r = self.site, self.cfg.ray
        M = r.trainer_ranks
        policy, ref = str(policy_path), str(self.ref_path)
        resume = str(checkpoint) if checkpoint else None

        def start(attempt: int) -> list[Any]:
            again = f"-a{attempt}" if attempt else ""
            trainers = []
            for rank in range(M):
                name = f"{site.prefix}-trainer-{rank}-e{epoch}{again}"
                actor = site.actor(self.cls, name, r.trainer, self.bundles[rank])
                trainers.append(actor.remote(self.cfg, rank, M, policy, ref, resume))
            return trainers

        def probe(trainers: list[Any], left: float) -> None:
            w = site.nodes.wait_placed
            host, port = w(trainers[0].rendezvous.remote(), "trainer rank 0", left)
            w([t.init_group.remote(host, port) for t in trainers], "the trainer group", left)

        self.trainers = site.nodes.place(
            start, probe, "the trainer group", r.replacement_wait_s, DIED
        )

    def kill(self) -> None:
        for t in self.trainers:
            ray.kill(t, no_restart=True)

    def threads(self) -> list[int]:
        """Each rank's torch threads."""
        return self._get([t.threads.remote() for t in self.trainers], "start-up")

    def gather_weights(self, version: int) -> tuple[Any, float]:
        """The current weights as an object-store reference (not fetched here), and their bytes."""
        if self.gather_all:
            refs = [t.get_weights.options(num_returns=2).remote(version) for t in self.trainers]
            self._get([b for _, b in refs], "weight gather")  # FSDP2: all ranks
            weights, nbytes = refs[0]
        else:
            weights, nbytes = self.trainers[0].get_weights.options(num_returns=2).remote(version)
        return weights, float(self._get(nbytes, "weight gather"))

    def update(self, step: int, shards: list[list[Trajectory]]) -> tuple[dict[str, float], Any]:
        """Rank r updates on ``shards[r]``; returns the combined metrics and rank 0's new
        weights as an object-store reference, returned by the same call."""
        metric_refs, weights = [], None
        for rank, (t, shard) in enumerate(zip(self.trainers, shards, strict=True)):
            if rank == 0 or self.gather_all:
                m_ref, w_ref = t.update_and_gather.options(num_returns=2).remote(step, shard)
                weights = w_ref if rank == 0 else weights
            else:
                m_ref = t.update.remote(step, shard)
            metric_refs.append(m_ref)
        return combine_ranks(self._get(metric_refs, f"update of step {step}")), weights

    def _writers(self) -> list[Any]:
        return self.trainers if self.gather_all else self.trainers[:1]

    def save(self, step: int, state: dict[str, Any]) -> str | None:
        """Rank 0 writes the usual checkpoint on the run directory (shared storage on a
        multi-node cluster)."""
        keep = self.cfg.checkpoint.keep
        refs = [t.save.remote(step, state, keep) for t in self._writers()]
        return self._get(refs, f"checkpoint of step {step}")[0]

    def write_final(self, out_dir: Path) -> None:
        refs = [t.save_final.remote(str(out_dir)) for t in self._writers()]
        self._get(refs, "write final/")
