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
from gyre.rollout.core import rollout_seed
from gyre.rollout.dapo import has_reward_variance
from gyre.runners.actors import RolloutWorker, TrainerRank
from gyre.runners.bounded import Waits
from gyre.runners.nodes import NodeWatch, health_system_config, lost_deadline_s
from gyre.runners.placement import (
    actor_prefix,
    combine_ranks,
    fit_placement,
    gathers_on_every_rank,
    off_policy_default,
    placement_bundles,
    require_ray,
    user_module_path,
)
from gyre.runners.scheduler import BUFFER_FILE, Group, ShareScheduler, read_buffer
from gyre.telemetry import MetricsSink
from gyre.telemetry.factory import Telemetry
from gyre.types import Trajectory

ray = require_ray()
from ray.exceptions import RayActorError  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

_DIED = (RayActorError, ray.exceptions.ActorUnavailableError)
_LOST = ray.exceptions.ObjectLostError  # an object whose node (and copies) are gone
_ACC = ("tokens", "gen_s", "gen_actor_s", "gen_actor_cpu_s", "load_s")  # per-step sums


class TrainerGroupFailed(RuntimeError):
    """A trainer rank died; the group restarts from the latest checkpoint."""


def _trainer_get(waits: Waits, refs: Any, stage: str) -> Any:
    try:
        return waits.get(refs, "trainer", stage, "the trainer group")
    except _DIED as exc:
        raise TrainerGroupFailed(str(exc)) from exc


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
        raise PeerFault("worker", "Ray start-up", f"the Ray cluster at {address}",
                        time.monotonic() - t0, "ray.address", first) from exc  # fmt: skip
    return True


class RayPlacement:
    """The :class:`gyre.loop.Placement` of a Ray run: the driver's actors, scheduler, counters."""

    stale_ok = True

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.waits = Waits(cfg.faults)
        self.owned = False
        self.pg: Any = None
        self.workers: list[Any] = []
        self.trainers: list[Any] = []
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
        self, run_dir: Path, policy: Path, ref: Path, plan: ResumePlan, out: Telemetry,
        ckpt: Checkpointer,
    ) -> None:  # fmt: skip
        cfg = self.cfg
        cfg.run.dir = str(run_dir.resolve())  # actors on other nodes need an absolute path
        torch.set_num_threads(1)  # the driver only schedules (SFT, if any, ran before)
        self.out, self.run_dir = out, run_dir
        for note in self.notes:
            out.message(note)
        r = cfg.ray
        self.init_path, self.ref_path = ref, ref  # what fresh actors load; the KL reference
        self.share_size = r.tasks_per_share or tasks_per_share(
            cfg.train.tasks_per_step, r.rollout_workers
        )
        self.ahead = {"sync": 0, "one-step-off": 1, "async": r.async_ahead}[r.mode]
        if self.ahead < 0:
            self.ahead = r.max_staleness
        self.prefix = actor_prefix(cfg)
        bundles, self.rollout_bundle, self.trainer_bundle = placement_bundles(cfg)
        self.pg = placement_group(bundles, strategy=r.placement_strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=cfg.faults.startup_timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            self.pg = None
            raise RuntimeError(
                f"Ray cannot place the bundles {bundles} (ray.rollout / ray.trainer resources, "
                f"ray.placement={r.placement}); the cluster has {ray.cluster_resources()}"
            )
        self.worker_cls = ray.remote(RolloutWorker)
        self.trainer_cls = ray.remote(TrainerRank)
        self.worker_gen = [0] * r.rollout_workers
        self.weights_ref: Any = None
        self.version = 0
        self.counters = {
            "recovery/rollout_restarts": 0,
            "recovery/trainer_restarts": 0,
            "recovery/reissued_shares": 0,
            "recovery/lost_nodes": 0,
        }
        self.nodes = NodeWatch(ray, lost_deadline_s(cfg))
        self.epoch = 0  # bumped on a trainer restart: in-flight work of older epochs is ignored
        self.pending: dict[Any, tuple[int, int, int]] = {}  # ref -> (worker, share, epoch)
        self.traj_log = run_dir / "trajectories.jsonl"
        self.acc = dict.fromkeys(_ACC, 0.0)
        self.wait_s, self.dropped_since, self.t_last = 0.0, 0, time.perf_counter()
        self.workers = [self._new_worker(i) for i in range(r.rollout_workers)]
        self.idle = set(range(len(self.workers)))
        self._restore(plan.ckpt if plan.phase == "grpo" else None)
        self._check_threads()
        self._sync_weights(wait=True)

    # -- actors ---------------------------------------------------------------------------
    def _strategy(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)

    def _env_vars(self, num_cpus: float) -> dict[str, Any]:
        threads = str(self.cfg.run.threads or max(1, int(num_cpus)))
        env = {"OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
        path = user_module_path(self.cfg)
        if path:
            env["PYTHONPATH"] = path
        if os.environ.get("GYRE_FAULT"):  # fault injection of a test reaches the actors too
            env["GYRE_FAULT"] = os.environ["GYRE_FAULT"]
        return {"env_vars": env}

    def _new_worker(self, i: int) -> Any:
        r = self.cfg.ray
        gen = self.worker_gen[i]
        self.worker_gen[i] += 1
        name = f"{self.prefix}-rollout-{i}" + (f"-r{gen}" if gen else "")
        return self.worker_cls.options(
            name=name, num_cpus=r.rollout.num_cpus, num_gpus=r.rollout.num_gpus, max_restarts=0,
            scheduling_strategy=self._strategy(self.rollout_bundle[i]),
            runtime_env=self._env_vars(r.rollout.num_cpus),
        ).remote(self.cfg, str(self.init_path), i)  # fmt: skip

    def _count_restart(self, role: str, what: str, why: BaseException) -> int:
        """Count a restart of ``role``; past ``ray.max_<role>_restarts`` the run fails."""
        key = f"recovery/{role}_restarts"
        self.counters[key] += 1
        n, limit = self.counters[key], getattr(self.cfg.ray, f"max_{role}_restarts")
        if n > limit:
            raise RuntimeError(f"{what} {n} times (ray.max_{role}_restarts={limit})") from why
        return n

    def _note_lost_nodes(self) -> None:
        for line in self.nodes.newly_lost():
            self.out.message(line)
            self.counters["recovery/lost_nodes"] += 1

    def _replace_worker(self, i: int, why: BaseException) -> None:
        self._count_restart("rollout", "rollout workers died", why)
        self._note_lost_nodes()
        self.out.message(f"rollout worker {i} died ({type(why).__name__}); starting a replacement")
        ray.kill(self.workers[i], no_restart=True)
        what = f"replacement rollout worker {i}"
        self.workers[i] = self.nodes.place(  # its bundle may wait for a replacement node
            lambda _: [self._new_worker(i)],
            lambda a, left: self.nodes.wait_placed(a[0].pid.remote(), what, left),
            what, self.cfg.ray.replacement_wait_s, _DIED,
        )[0]  # fmt: skip
        self._note_lost_nodes()
        if self.weights_ref is not None:
            self.workers[i].load_weights.remote(self.weights_ref, self.version)

    def _start_trainers(self, policy_path: Path, checkpoint: Path | None) -> None:
        r = self.cfg.ray
        M = r.trainer_ranks

        def start(attempt: int) -> list[Any]:
            again = f"-a{attempt}" if attempt else ""
            return [
                self.trainer_cls.options(
                    name=f"{self.prefix}-trainer-{rank}-e{self.epoch}{again}",
                    num_cpus=r.trainer.num_cpus, num_gpus=r.trainer.num_gpus, max_restarts=0,
                    scheduling_strategy=self._strategy(self.trainer_bundle[rank]),
                    runtime_env=self._env_vars(r.trainer.num_cpus),
                ).remote(
                    self.cfg, rank, M, str(policy_path), str(self.ref_path),
                    str(checkpoint) if checkpoint else None,
                )
                for rank in range(M)
            ]  # fmt: skip

        def probe(trainers: list[Any], left: float) -> None:
            w = self.nodes.wait_placed
            host, port = w(trainers[0].rendezvous.remote(), "trainer rank 0", left)
            w([t.init_group.remote(host, port) for t in trainers], "the trainer group", left)

        self.trainers = self.nodes.place(
            start, probe, "the trainer group", r.replacement_wait_s, _DIED
        )

    def _scheduler(self, finalized: int, dropped: int, filtered: int = 0) -> ShareScheduler:
        first = finalized // self.share_size
        dapo = self.cfg.train.dapo
        return ShareScheduler(
            self.cfg.train.tasks_per_step, self.share_size, self.ahead, self.cfg.ray.max_staleness,
            next_share=first, consumed_share=first, finalized=finalized, dropped=dropped,
            filtered=filtered, max_rounds=dapo.max_rounds if dapo.dynamic_sampling else 0,
        )  # fmt: skip

    def _restore(self, checkpoint: Path | None) -> dict[str, Any]:
        """(Re)build the trainer group from ``checkpoint`` (None: the initial policy) and put
        the driver's counters back to that point; returns its state."""
        state: dict[str, Any] = {"step": 0, "cursor": 0, "evals": {}, "dropped": 0}
        if checkpoint is not None:
            state = json.loads((checkpoint / "state.json").read_text())
        step = int(state["step"])
        self.version = int(state.get("policy_version", step))
        for k, v in state.get("counters", {}).items():
            if k in self.counters:
                self.counters[k] = max(self.counters[k], int(v))
        self.sched = self._scheduler(
            int(state["cursor"]), int(state.get("dropped", 0)), int(state.get("filtered", 0))
        )
        self.sched.restore_buffer(read_buffer(checkpoint), f"{checkpoint}/{BUFFER_FILE}")
        self.epoch += 1  # results of shares handed out before this point are ignored
        self._start_trainers(checkpoint / "model" if checkpoint else self.init_path, checkpoint)
        if self.traj_log.exists():  # lines past the checkpoint will be trained again
            keep = [
                line
                for line in self.traj_log.read_text().splitlines()
                if json.loads(line)["step"] <= step
            ]
            self.traj_log.write_text("".join(f"{line}\n" for line in keep))
        return state

    def _restart_trainers(self, why: BaseException) -> None:
        """A trainer rank died: restart the group from the latest checkpoint and make the loop
        continue from there (:class:`gyre.loop.RolledBack`)."""
        n = self._count_restart("trainer", "the trainer group failed", why)
        self._note_lost_nodes()
        for t in self.trainers:
            ray.kill(t, no_restart=True)
        found = list_checkpoints(self.run_dir)
        ckpt = found[-1] if found else None
        self.out.message(
            f"trainer group failed ({type(why).__name__}); restart {n}: "
            f"from {ckpt.name if ckpt else 'the initial policy'}"
        )
        state = self._restore(ckpt)
        self._sync_weights(wait=True)
        self.acc = dict.fromkeys(_ACC, 0.0)
        raise RolledBack(state) from why

    def _check_threads(self) -> None:
        """Each actor must run the torch threads it was given (``run.threads`` or its CPUs): more
        would oversubscribe the cores that overlapping rollout and training rely on."""
        cfg = self.cfg
        want = {
            "rollout": cfg.run.threads or max(1, int(cfg.ray.rollout.num_cpus)),
            "trainer": cfg.run.threads or max(1, int(cfg.ray.trainer.num_cpus)),
        }
        workers = [w.threads.remote() for w in self.workers]
        trainers = [t.threads.remote() for t in self.trainers]
        got = {
            "rollout": self.waits.get(workers, "worker", "start-up", "the rollout workers", True),
            "trainer": _trainer_get(self.waits, trainers, "start-up"),
        }
        for role, threads in got.items():
            if any(n != want[role] for n in threads):
                raise RuntimeError(f"{role} actors run {threads} torch threads, not {want[role]}")
        self.out.message(f"actor torch threads: {got}")

    def _boxed(self) -> list[Any]:
        """The current weights for a rollout/evaluate call: boxed, so Ray passes the reference
        and the worker fetches it only when its engine is older than ``self.version``."""
        return [self.weights_ref] if self.weights_ref is not None else []

    def _sync_weights(self, wait: bool) -> float:
        """Rank 0's weights -> object store -> every worker, stamped (start-up and after a
        trainer restart; in the step loop the weights ride on the update and rollout calls).
        Returns the bytes sent."""
        if gathers_on_every_rank(self.cfg):
            refs = [
                t.get_weights.options(num_returns=2).remote(self.version) for t in self.trainers
            ]
            _trainer_get(self.waits, [b for _, b in refs], "weight gather")  # FSDP2: all ranks
            weights, nbytes = refs[0]
        else:
            weights, nbytes = (
                self.trainers[0].get_weights.options(num_returns=2).remote(self.version)
            )
        sent = float(_trainer_get(self.waits, nbytes, "weight gather"))
        self.weights_ref = weights
        loads = {
            i: w.load_weights.remote(weights, self.version) for i, w in enumerate(self.workers)
        }
        if wait:  # sync / colocated: engines must hold the new version before generating
            for i, ref in loads.items():
                try:
                    self.waits.get(ref, "worker", "weight load", f"rollout worker {i}")
                except _DIED as exc:
                    self._replace_worker(i, exc)
        return sent

    # -- phases 1-2: shares to idle workers, finished groups into a batch ---------------------
    def _dispatch(self) -> None:
        """Hand shares to idle workers (reissued ones first) while pacing allows."""
        for i in sorted(self.idle):
            s = self.sched.next_to_start()
            if s is None:
                return
            step = self.sched.batch_of(s) + 1
            share = self.sched.share_of(s, rollout_seed(self.cfg, step))
            ref = self.workers[i].rollout.remote(share, self._boxed(), self.version, step)
            self.pending[ref] = (i, s, self.epoch)
            self.idle.discard(i)

    def _collect(self) -> None:
        """Wait for one finished share; replace its worker if it died (and reissue the share)."""
        if not self.pending:  # nothing in flight and nothing may start: waiting would never end
            raise RuntimeError(
                f"ray runner: the batch needs groups but no rollout share is in flight "
                f"(scheduler: {self.sched.describe()}); please report this with the config"
            )
        busy = ", ".join(str(i) for i, _, _ in self.pending.values())
        ready = self.waits.any(list(self.pending), "worker", "rollout", f"rollout workers {busy}")
        for ref in ready:
            i, s, epoch = self.pending.pop(ref)
            try:
                res = ray.get(ref, timeout=self.cfg.faults.call_timeout_s)  # ready already
            except (*_DIED, _LOST) as exc:
                if not isinstance(exc, _LOST):
                    self._replace_worker(i, exc)
                # else: the weights it was to load lived on a lost node (a trainer node): the
                # worker is fine, and the share is reissued with the current weights
                if epoch == self.epoch:
                    self.counters["recovery/reissued_shares"] += 1
                    self.sched.reissue(s)
                self.idle.add(i)
                continue
            self.idle.add(i)
            if epoch != self.epoch:
                continue  # generated before a trainer restart rolled the run back
            G = self.cfg.train.group_size
            trajs = res["trajs"]
            groups = [Group(trajs[k].group_id, trajs[k : k + G]) for k in range(0, len(trajs), G)]
            self.sched.finished(s, groups, res["metrics"])
            self.acc["tokens"] += res["tokens"]
            self.acc["gen_s"] += res["seconds"]
            self.acc["gen_actor_s"] += res["wall_s"]
            self.acc["gen_actor_cpu_s"] += res["cpu_s"]
            self.acc["load_s"] += res["load_s"]

    def rollout(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """The next batch of fresh groups (with DAPO dynamic sampling: with reward variance),
        generated by the workers, scored there, collected here."""
        keep = None
        if self.cfg.train.dapo.dynamic_sampling:
            keep = lambda g: has_reward_variance(g.trajs, lambda t: t.reward)  # noqa: E731
        while True:
            self._dispatch()
            got = self.sched.take_batch(self.version, keep)
            if got is None:
                t0 = time.perf_counter()
                self._collect()
                self.wait_s += time.perf_counter() - t0
                continue
            batch, dropped = got
            if batch:
                break
            self._log_trajectories(step, [], dropped)  # only unusable groups so far
            self.dropped_since += len(dropped)
            self.sched.check_not_starving(step)
        self.batch, self.batch_dropped = batch, dropped
        trajs = [t for g in batch for t in g.trajs]
        m = self.sched.batch_metrics()
        if self.cfg.reward.functions:
            m.update(reward_metrics(trajs))
        m["time/rollout_s"] = self.wait_s
        return trajs, m

    # -- phases 3-5 ----------------------------------------------------------------------------
    def update(self, step: int, trajs: list[Trajectory]) -> dict[str, float]:
        """Phases 3-4 on the trainer group: rank r gets the r-th equal slice of whole groups;
        rank 0 (every rank under FSDP2, whose gather is collective) returns the new weights in
        the same call, as a second object-store reference that goes to the engines as is."""
        M = self.cfg.ray.trainer_ranks
        groups = self.batch
        per = len(groups) // M
        shards = [[t for g in groups[r * per : (r + 1) * per] for t in g.trajs] for r in range(M)]
        if self.cfg.ray.placement == "colocated":
            refs = [w.release_memory.remote() for w in self.workers]
            self.waits.get(refs, "worker", "release memory", "the rollout workers")
        gather_all = gathers_on_every_rank(self.cfg)
        metric_refs, weights = [], None
        try:
            for rank, (t, shard) in enumerate(zip(self.trainers, shards, strict=True)):
                if rank == 0 or gather_all:
                    m_ref, w_ref = t.update_and_gather.options(num_returns=2).remote(step, shard)
                    weights = w_ref if rank == 0 else weights
                else:
                    m_ref = t.update.remote(step, shard)
                metric_refs.append(m_ref)
            m = combine_ranks(_trainer_get(self.waits, metric_refs, f"update of step {step}"))
        except TrainerGroupFailed as exc:
            self._restart_trainers(exc)  # raises RolledBack: back to the latest checkpoint
        self.weights_ref = weights
        self.version = step
        self._log_trajectories(step, groups, self.batch_dropped)
        self.dropped_since += len(self.batch_dropped)
        return m

    def sync(self, step: int) -> dict[str, float]:
        """Phase 5: the new weights already ride on the next rollout calls; this logs the
        step's sync, generation and staleness figures."""
        G, now = self.cfg.train.group_size, time.perf_counter()
        self._note_lost_nodes()  # a node Ray declared dead since: named even if nothing failed
        trajs = [t for g in self.batch for t in g.trajs]
        staleness = np.array([step - 1 - t.policy_version for t in trajs], dtype=float)
        acc = self.acc
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
            "async/dropped_total": float(self.sched.dropped * G),
            **{k: float(v) for k, v in self.counters.items()},
            "policy_version": float(self.version),
        }
        self.acc = dict.fromkeys(_ACC, 0.0)
        self.wait_s, self.dropped_since, self.t_last = 0.0, 0, now
        if step >= self.cfg.train.steps:  # shares generated ahead of the last step: not trained
            for ref in list(self.pending):
                ray.cancel(ref)
            self.pending.clear()
            self.idle = set(range(len(self.workers)))
        return m

    def evaluate(self) -> dict[str, float]:
        if not (self.cfg.eval.episodes or self.cfg.eval.validation_episodes):
            return {}
        for _ in range(3):
            i = min(self.idle) if self.idle else 0
            try:
                ref = self.workers[i].evaluate.remote(self._boxed(), self.version)
                return self.waits.get(ref, "worker", "evaluation", f"rollout worker {i}")
            except _DIED as exc:
                self._replace_worker(i, exc)
        raise RuntimeError("evaluation failed on three rollout workers in a row")

    def _log_trajectories(self, step: int, trained: list[Group], dropped: list[Group]) -> None:
        with self.traj_log.open("a") as f:
            for status, groups in (("trained", trained), ("dropped", dropped)):
                for g in groups:
                    for t in g.trajs:
                        row = {
                            "step": step,
                            "traj_id": t.traj_id,
                            "status": status,
                            "policy_version": t.policy_version,
                            "staleness": step - 1 - t.policy_version,
                            "reward": t.reward,
                            "response_tokens": t.num_generated,
                        }
                        f.write(json.dumps(row) + "\n")

    # -- state -----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        while self.pending and ray.wait(list(self.pending), timeout=0)[0]:
            self._collect()  # shares back since the batch filled: saved, not generated again
        return {
            **self.sched.checkpoint_state(),  # frontier, counters, the groups not yet trained
            "policy_version": self.version,
            "counters": dict(self.counters),
        }

    def save(self, step: int, state: dict[str, Any]) -> str | None:
        """Rank 0 writes the usual checkpoint on the run directory (shared storage on a
        multi-node cluster)."""
        keep = self.cfg.checkpoint.keep
        every = self.trainers if gathers_on_every_rank(self.cfg) else self.trainers[:1]
        try:  # FSDP2: every rank joins the gather of the whole model, rank 0 writes it
            refs = [t.save.remote(step, state, keep) for t in every]
            return _trainer_get(self.waits, refs, f"checkpoint of step {step}")[0]
        except TrainerGroupFailed as exc:
            self._restart_trainers(exc)
            raise  # not reached: _restart_trainers raises RolledBack

    def write_final(self, out_dir: Path) -> None:
        every = self.trainers if gathers_on_every_rank(self.cfg) else self.trainers[:1]
        refs = [t.save_final.remote(str(out_dir)) for t in every]
        _trainer_get(self.waits, refs, "write final/")

    def summary(self) -> dict[str, Any]:
        return {"runner": "ray", **getattr(self, "counters", {})}

    def close(self) -> None:
        if self.workers:
            try:  # sandboxed reward workers stop with their rollout
                ray.get([w.close.remote() for w in self.workers], timeout=30)
            except Exception:
                pass
        for a in self.workers + self.trainers:
            ray.kill(a, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)
        if self.owned:
            ray.shutdown()


def train(cfg: Config, sink: MetricsSink | None = None) -> dict[str, Any]:
    """The Ray runner: :func:`gyre.loop.train` on a :class:`RayPlacement` (same config, same
    outputs as the local runner, plus ``trajectories.jsonl`` and the recovery counters)."""
    return loop_train(cfg, RayPlacement(cfg), sink)
