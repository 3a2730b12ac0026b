"""``runner: ray``: the same GRPO loop with rollout workers and a trainer group as Ray actors.

The driver owns the schedule; actors own the very objects the local runner uses
(``runners/actors.py``):

    N rollout workers   a Rollout each (engine + env factory + reward functions); each plays
                        and scores whole *shares* of tasks (an in-process engine, or an HTTP
                        client of vLLM / SGLang / gyre serve servers)
    M trainer ranks     a Trainer each (policy, AdamW, reference, value model, LoRA), data-
                        parallel over torch.distributed (DDP on gloo, FSDP2 on nccl)

This module is a :class:`gyre.loop.Placement`: the loop (``gyre.loop.train``) is the same one
the local runner runs. One step: 1-2. rollout and reward (shares handed to idle workers, which
score them with the reward functions; the driver load-balances, drops stale groups and, with
DAPO dynamic sampling, groups without reward variance) -> 3-4. advantages and update on the
trainer ranks (each rank gets an equal shard of whole groups; loss weights use the step's
*global* token/row counts) -> 5. sync (rank 0's weights -- the adapter's under LoRA -- go through
the object store to every worker, stamped with the new version; with HTTP engines rank 0 writes
them to ``engine.sync_dir`` and has the servers load them) -> 6. log -> 7. checkpoint (rank 0
writes the usual checkpoint on the run directory, shared storage on a multi-node cluster).

Modes (``ray.mode``): ``sync`` generates batch n with version n-1 and trains it; ``one-step-off``
lets generation of batch n+1 run while batch n trains; ``async`` lets generation run
``ray.async_ahead`` batches ahead. Every trajectory carries the policy version that generated it
and trains only while ``staleness <= ray.max_staleness``; otherwise it is dropped and counted
(``runners/scheduler.py``). ``placement: colocated`` forces the alternation generate -> release
-> train -> sync on shared bundles; ``disaggregated`` gives each role its own bundles.

Recovery: a rollout worker that dies is replaced in the same bundle, given the current weights,
and its share is reissued (ids are ``task:sample``, so nothing is lost or trained twice). A
trainer failure restarts the whole group from the latest checkpoint, up to
``ray.max_trainer_restarts`` times. Every recovery is logged and counted in the metrics.

Every trained or dropped trajectory gets a line in ``<run.dir>/trajectories.jsonl``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gyre.checkpoint.resume import Checkpointer, ResumePlan
from gyre.checkpoint.store import list_checkpoints
from gyre.config import Config, tasks_per_share
from gyre.deadlines import PeerFault
from gyre.loop import RolledBack
from gyre.loop import train as loop_train
from gyre.rewards.contract import reward_metrics
from gyre.rollout.dapo import has_reward_variance
from gyre.runners.bounded import Waits
from gyre.runners.nodes import NodeWatch, health_system_config, lost_deadline_s
from gyre.runners.placement import (  # noqa: F401 - names this module has always offered
    actor_prefix,
    combine_ranks,
    fit_placement,
    gathers_on_every_rank,
    off_policy_default,
    placement_bundles,
    require_ray,
    user_module_path,
)
from gyre.runners.ray_site import ActorSite, placement_group, ray, remove_placement_group
from gyre.runners.rollout_pool import RolloutPool
from gyre.runners.scheduler import BUFFER_FILE, ShareScheduler, read_buffer
from gyre.runners.trainer_group import TrainerGroup, TrainerGroupFailed
from gyre.runners.traj_log import TrajectoryLog
from gyre.telemetry import MetricsSink
from gyre.telemetry.factory import Telemetry
from gyre.types import Trajectory


def connect_ray(cfg: Config) -> bool:
    """Start or join Ray; True when this call started it (so the run shuts it down)."""
    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS") or "local"
    kwargs: dict[str, Any] = {"namespace": cfg.ray.namespace, "log_to_driver": True}
    if address == "local":
        kwargs["num_cpus"] = cfg.ray.num_cpus or None
        kwargs["include_dashboard"] = False
        kwargs["_system_config"] = health_system_config(cfg)  # the node-lost deadline
        if cfg.ray.temp_dir:
            kwargs["_temp_dir"] = str(Path(cfg.ray.temp_dir).resolve())
    t0 = time.monotonic()
    try:
        ray.init(address=address, **kwargs)
    except (ValueError, ImportError):
        raise  # a bad address or missing package: the user's to fix, said as it is
    except Exception as exc:  # a raylet or GCS that did not start in time: a bare Exception
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise PeerFault(
            "worker",
            "Ray start-up",
            f"the Ray cluster at {address}",
            waited_s=time.monotonic() - t0,
            key="ray.address",
            detail=first,
        ) from exc
    return True


class RayPlacement:
    """The :class:`gyre.loop.Placement` of a Ray run: the placement group, the rollout-worker
    pool (:class:`~gyre.runners.rollout_pool.RolloutPool`), the trainer group
    (:class:`~gyre.runners.trainer_group.TrainerGroup`), and the run's state between them."""

    stale_ok = True

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.waits = Waits(cfg.faults)
        self.owned = False
        self.pg: Any = None
        self.pool: RolloutPool | None = None
        self.group: TrainerGroup | None = None
        self.notes: list[str] = []

    # -- start-up ------------------------------------------------------------------------------
    def connect(self) -> None:
        """Start or join Ray; fit the default placement to the cluster; switch on the off-policy
        correction for stale modes (before setup, so config.yaml shows both)."""
        cfg = self.cfg
        self.owned = connect_ray(cfg)
        note = fit_placement(cfg, float(ray.cluster_resources().get("CPU", 0.0)))
        if note:
            self.notes.append(note)
        if off_policy_default(cfg):
            self.notes.append(
                f"ray.mode={cfg.ray.mode} trains samples up to {cfg.ray.max_staleness} versions "
                "old: train.algo.rollout_is=truncate (off-policy correction; set it to keep "
                "another)"
            )

    def start(
        self,
        run_dir: Path,
        policy: Path,
        ref: Path,
        plan: ResumePlan,
        out: Telemetry,
        ckpt: Checkpointer,
    ) -> None:
        cfg = self.cfg
        cfg.run.dir = str(run_dir.resolve())  # actors on other nodes need an absolute path
        torch.set_num_threads(1)  # the driver only schedules (SFT, if any, ran before)
        self.out, self.run_dir = out, run_dir
        for note in self.notes:
            out.message(note)
        r = cfg.ray
        self.share_size = r.tasks_per_share or tasks_per_share(
            cfg.train.tasks_per_step, r.rollout_workers
        )
        self.ahead = {"sync": 0, "one-step-off": 1, "async": r.async_ahead}[r.mode]
        if self.ahead < 0:
            self.ahead = r.max_staleness
        bundles, rollout_bundle, trainer_bundle = placement_bundles(cfg)
        self.pg = placement_group(bundles, strategy=r.placement_strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=cfg.faults.startup_timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            self.pg = None
            raise RuntimeError(
                f"Ray cannot place the bundles {bundles} (ray.rollout / ray.trainer resources, "
                f"ray.placement={r.placement}); the cluster has {ray.cluster_resources()}"
            )
        nodes = NodeWatch(ray, lost_deadline_s(cfg))
        self.site = ActorSite(cfg, self.pg, self.waits, nodes, actor_prefix(cfg), out)
        self.counters = self.site.counters
        self.traj_log = TrajectoryLog(run_dir / "trajectories.jsonl")
        self.wait_s, self.dropped_since, self.t_last = 0.0, 0, time.perf_counter()
        # what fresh actors load, and the KL reference
        self.pool = RolloutPool(self.site, rollout_bundle, ref)
        self.group = TrainerGroup(self.site, trainer_bundle, ref)
        self.init_path = ref
        self._restore(plan.ckpt if plan.phase == "grpo" else None)
        self._check_threads()
        self._sync_weights()

    def _scheduler(self, finalized: int, dropped: int, filtered: int = 0) -> ShareScheduler:
        first = finalized // self.share_size
        dapo = self.cfg.train.dapo
        return ShareScheduler(
            tasks_per_step=self.cfg.train.tasks_per_step,
            tasks_per_share=self.share_size,
            ahead=self.ahead,
            max_staleness=self.cfg.ray.max_staleness,
            next_share=first,
            consumed_share=first,
            finalized=finalized,
            dropped=dropped,
            filtered=filtered,
            max_rounds=dapo.max_rounds if dapo.dynamic_sampling else 0,
        )

    def _restore(self, checkpoint: Path | None) -> dict[str, Any]:
        """(Re)build the trainer group from ``checkpoint`` (None: the initial policy) and put
        the driver's counters back to that point; returns its state."""
        assert self.pool is not None and self.group is not None
        state: dict[str, Any] = {"step": 0, "cursor": 0, "evals": {}, "dropped": 0}
        if checkpoint is not None:
            state = json.loads((checkpoint / "state.json").read_text())
        step = int(state["step"])
        self.pool.version = int(state.get("policy_version", step))
        for k, v in state.get("counters", {}).items():
            if k in self.counters:
                self.counters[k] = max(self.counters[k], int(v))
        self.pool.restart_shares(
            self._scheduler(
                int(state["cursor"]), int(state.get("dropped", 0)), int(state.get("filtered", 0))
            )
        )
        self.pool.sched.restore_buffer(read_buffer(checkpoint), f"{checkpoint}/{BUFFER_FILE}")
        policy = checkpoint / "model" if checkpoint else self.init_path
        self.group.start(policy, checkpoint, self.pool.epoch)
        self.traj_log.truncate_after(step)  # lines past the checkpoint will be trained again
        return state

    def _restart_trainers(self, why: BaseException) -> None:
        """A trainer rank died: restart the group from the latest checkpoint and make the loop
        continue from there (:class:`gyre.loop.RolledBack`)."""
        assert self.pool is not None and self.group is not None
        n = self.site.count_restart("trainer", "the trainer group failed", why)
        self.site.note_lost_nodes()
        self.group.kill()
        found = list_checkpoints(self.run_dir)
        ckpt = found[-1] if found else None
        self.out.message(
            f"trainer group failed ({type(why).__name__}); restart {n}: "
            f"from {ckpt.name if ckpt else 'the initial policy'}"
        )
        state = self._restore(ckpt)
        self._sync_weights()
        self.pool.step_sums()  # the rolled-back step's sums are dropped
        raise RolledBack(state) from why

    def _check_threads(self) -> None:
        """Each actor must run the torch threads it was given (``run.threads`` or its CPUs): more
        would oversubscribe the cores that overlapping rollout and training rely on."""
        assert self.pool is not None and self.group is not None
        cfg = self.cfg
        want = {
            "rollout": cfg.run.threads or max(1, int(cfg.ray.rollout.num_cpus)),
            "trainer": cfg.run.threads or max(1, int(cfg.ray.trainer.num_cpus)),
        }
        got = {"rollout": self.pool.threads(), "trainer": self.group.threads()}
        for role, threads in got.items():
            if any(n != want[role] for n in threads):
                raise RuntimeError(f"{role} actors run {threads} torch threads, not {want[role]}")
        self.out.message(f"actor torch threads: {got}")

    def _sync_weights(self) -> float:
        """Rank 0's weights -> object store -> every worker, stamped, and waited for (start-up
        and after a trainer restart; in the step loop the weights ride on the update and rollout
        calls). Returns the bytes sent."""
        assert self.pool is not None and self.group is not None
        weights, sent = self.group.gather_weights(self.pool.version)
        self.pool.publish(weights, self.pool.version, wait=True)
        return sent

    def _republish_weights(self) -> None:
        """The weights the workers were to load were lost with their node: gather them again
        (a rank lost with it: a trainer restart from the newest checkpoint, RolledBack)."""
        try:
            self._sync_weights()
        except TrainerGroupFailed as exc:
            self._restart_trainers(exc)

    # -- phases 1-2: shares to idle workers, finished groups into a batch ---------------------
    def rollout(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """The next batch of fresh groups (with DAPO dynamic sampling: with reward variance),
        generated by the workers, scored there, collected here."""
        assert self.pool is not None
        keep = None
        if self.cfg.train.dapo.dynamic_sampling:
            keep = lambda g: has_reward_variance(g.trajs, lambda t: t.reward)  # noqa: E731
        while True:
            self.pool.dispatch()
            got = self.pool.sched.take_batch(self.pool.version, keep)
            if got is None:
                t0 = time.perf_counter()
                self.pool.collect()
                self.wait_s += time.perf_counter() - t0
                if self.pool.weights_lost:
                    self._republish_weights()
                continue
            batch, dropped = got
            if batch:
                break
            self.traj_log.append(step, [], dropped)  # only unusable groups so far
            self.dropped_since += len(dropped)
            self.pool.sched.check_not_starving(step)
        self.batch, self.batch_dropped = batch, dropped
        trajs = [t for g in batch for t in g.trajs]
        m = self.pool.sched.batch_metrics()
        if self.cfg.reward.functions:
            m.update(reward_metrics(trajs))
        m["time/rollout_s"] = self.wait_s
        return trajs, m

    # -- phases 3-5 ----------------------------------------------------------------------------
    def update(self, step: int, trajs: list[Trajectory]) -> dict[str, float]:
        """Phases 3-4 on the trainer group: rank r gets the r-th equal slice of whole groups;
        rank 0 (every rank under FSDP2, whose gather is collective) returns the new weights in
        the same call, as a second object-store reference that goes to the engines as is."""
        assert self.pool is not None and self.group is not None
        M = self.cfg.ray.trainer_ranks
        groups = self.batch
        per = len(groups) // M
        shards = [[t for g in groups[r * per : (r + 1) * per] for t in g.trajs] for r in range(M)]
        release_s = None
        if self.cfg.ray.placement == "colocated":
            t0 = time.perf_counter()
            self.pool.release_memory()
            release_s = time.perf_counter() - t0
        try:
            m, weights = self.group.update(step, shards)
        except TrainerGroupFailed as exc:
            self._restart_trainers(exc)  # raises RolledBack: back to the latest checkpoint
        if release_s is not None:  # the engines' side of the hand-over (gyre plan's h)
            m["handover/release_s"] = release_s
        self.pool.publish(weights, step, wait=False)
        self.traj_log.append(step, groups, self.batch_dropped)
        self.dropped_since += len(self.batch_dropped)
        return m

    def sync(self, step: int) -> dict[str, float]:
        """Phase 5: the new weights already ride on the next rollout calls; this logs the
        step's sync, generation and staleness figures."""
        assert self.pool is not None
        G, now = self.cfg.train.group_size, time.perf_counter()
        self.site.note_lost_nodes()  # a node Ray declared dead since: named even if nothing failed
        trajs = [t for g in self.batch for t in g.trajs]
        staleness = np.array([step - 1 - t.policy_version for t in trajs], dtype=float)
        acc = self.pool.step_sums()
        m = {
            "perf/rollout_tokens_per_s": acc["tokens"] / acc["gen_s"] if acc["gen_s"] else 0.0,
            "perf/samples_per_s": len(trajs) / (now - self.t_last),
            "time/step_s": now - self.t_last,
            # what the actors spent inside their calls, and what the calls cost beyond
            "time/gen_actor_s": acc["gen_actor_s"],
            "time/gen_actor_cpu_s": acc["gen_actor_cpu_s"],
            "time/sync_load_s": acc["load_s"],
            "async/staleness_mean": float(staleness.mean()),
            "async/staleness_max": float(staleness.max()),
            "async/dropped": float(self.dropped_since * G),
            "async/dropped_total": float(self.pool.sched.dropped * G),
            **{k: float(v) for k, v in self.counters.items()},
            "policy_version": float(self.pool.version),
        }
        self.wait_s, self.dropped_since, self.t_last = 0.0, 0, now
        if step >= self.cfg.train.steps:  # shares generated ahead of the last step: not trained
            self.pool.cancel_pending()
        return m

    def evaluate(self) -> dict[str, float]:
        assert self.pool is not None
        if not (self.cfg.eval.episodes or self.cfg.eval.validation_episodes):
            return {}
        return self.pool.evaluate()

    # -- state -----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        assert self.pool is not None
        pool = self.pool
        while pool.pending and ray.wait(list(pool.pending), timeout=0)[0]:
            pool.collect()  # shares back since the batch filled: saved, not generated again
        return {
            **pool.sched.checkpoint_state(),  # frontier, counters, the groups not yet trained
            "policy_version": pool.version,
            "counters": dict(self.counters),
        }

    def save(self, step: int, state: dict[str, Any]) -> str | None:
        """Rank 0 writes the usual checkpoint on the run directory (shared storage on a
        multi-node cluster); FSDP2: every rank joins the gather of the whole model."""
        assert self.group is not None
        try:
            return self.group.save(step, state)
        except TrainerGroupFailed as exc:
            self._restart_trainers(exc)
            raise  # not reached: _restart_trainers raises RolledBack

    def write_final(self, out_dir: Path) -> None:
        assert self.group is not None
        self.group.write_final(out_dir)

    def summary(self) -> dict[str, Any]:
        return {"runner": "ray", **getattr(self, "counters", {})}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.group is not None:
            self.group.kill()
        if self.pg is not None:
            remove_placement_group(self.pg)
        if self.owned:
            ray.shutdown()


def train(cfg: Config, sink: MetricsSink | None = None) -> dict[str, Any]:
    """The Ray runner: :func:`gyre.loop.train` on a :class:`RayPlacement` (same config, same
    outputs as the local runner, plus ``trajectories.jsonl`` and the recovery counters)."""
    return loop_train(cfg, RayPlacement(cfg), sink)
