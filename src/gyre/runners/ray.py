"""``runner: ray``: the same GRPO loop with rollout workers and a trainer group as Ray actors.

The driver owns the schedule; actors own the objects (``runners/actors.py``):

    N rollout workers   TorchEngine + env factory; each plays whole *shares* of tasks
    M trainer ranks     policy + AdamW; data-parallel over torch.distributed (gloo on CPU)

One step, as in ``gyre.loop``: 1. rollout (shares handed to idle workers: the driver
load-balances) -> 2-3. reward and advantages on the driver, over whole groups -> 4. update (each
rank gets an equal shard of rows; loss weights use the step's *global* token/row counts) ->
5. sync (rank 0's weights go through the object store to every worker, stamped with the new
version; time and bytes are logged) -> 6. log -> 7. checkpoint (rank 0 writes the usual
checkpoint on the run directory, which must be shared storage on a multi-node cluster).

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

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gyre.checkpoint.resume import StopGuard, preempt_if_requested
from gyre.checkpoint.store import list_checkpoints
from gyre.config import Config, tasks_per_share
from gyre.loop import base_model_path, rollout_metrics, rollout_seed, run_sft, setup
from gyre.runners import require_ray
from gyre.runners.actors import RolloutWorker, TrainerRank
from gyre.runners.scheduler import Group, ShareScheduler
from gyre.telemetry import MetricsSink, timed
from gyre.telemetry.factory import build_telemetry

ray = require_ray()
from ray.exceptions import RayActorError  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

_DIED = (RayActorError, ray.exceptions.ActorUnavailableError)
_ACC = ("tokens", "gen_s", "gen_actor_s", "gen_actor_cpu_s", "load_s")  # per-step sums


class TrainerGroupFailed(RuntimeError):
    """A trainer rank died; the group restarts from the latest checkpoint."""


def _trainer_get(refs: Any) -> Any:
    try:
        return ray.get(refs)
    except _DIED as exc:
        raise TrainerGroupFailed(str(exc)) from exc


def actor_prefix(cfg: Config) -> str:
    """Actor names of a run: ``<prefix>-rollout-<i>``, ``<prefix>-trainer-<rank>``."""
    key = hashlib.sha1(str(Path(cfg.run.dir).resolve()).encode()).hexdigest()[:8]
    return f"gyre-{key}"


def connect(cfg: Config) -> bool:
    """Start or join Ray; True when this call started it (so the run shuts it down)."""
    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS") or "local"
    kwargs: dict[str, Any] = {"namespace": cfg.ray.namespace, "log_to_driver": True}
    if address == "local":
        kwargs["num_cpus"] = cfg.ray.num_cpus or None
        kwargs["include_dashboard"] = False
        if cfg.ray.temp_dir:
            kwargs["_temp_dir"] = str(Path(cfg.ray.temp_dir).resolve())
    ray.init(address=address, **kwargs)
    return True


def _bundle(*roles: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in roles:
        if r.num_cpus:
            out["CPU"] = out.get("CPU", 0.0) + r.num_cpus
        if r.num_gpus:
            out["GPU"] = out.get("GPU", 0.0) + r.num_gpus
    return out


def placement_bundles(cfg: Config) -> tuple[list[dict[str, float]], list[int], list[int]]:
    """(bundles, bundle of each rollout worker, bundle of each trainer rank).

    colocated: bundle i holds rollout worker i and trainer rank i (max(N, M) bundles), so the two
    roles share devices and must alternate. disaggregated: N rollout bundles, then M trainer ones.
    """
    r = cfg.ray
    N, M = r.rollout_workers, r.trainer_ranks
    for name, role in (("rollout", r.rollout), ("trainer", r.trainer)):
        if role.num_cpus <= 0 and role.num_gpus <= 0:
            raise ValueError(f"ray.{name} reserves nothing; set ray.{name}.num_cpus or num_gpus")
    if r.placement == "colocated":
        bundles = [
            _bundle(*([r.rollout] if i < N else []), *([r.trainer] if i < M else []))
            for i in range(max(N, M))
        ]
        return bundles, list(range(N)), list(range(M))
    bundles = [_bundle(r.rollout) for _ in range(N)] + [_bundle(r.trainer) for _ in range(M)]
    return bundles, list(range(N)), [N + j for j in range(M)]


def _gathers_on_every_rank(cfg: Config) -> bool:
    """FSDP2's full-state-dict gather is a collective: every rank must take part."""
    strategy = cfg.ray.strategy
    if strategy == "auto":
        strategy = "fsdp2" if cfg.ray.trainer.num_gpus > 0 else "ddp"
    return strategy == "fsdp2"


def _combine(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Rank metrics -> step metrics: per-token means weighted by tokens, the loss summed (each
    rank holds its share of the global objective), the grad norm of the synced gradients."""
    if len(per_rank) == 1:
        return dict(per_rank[0])
    tokens = [m["train/tokens"] for m in per_rank]
    total = max(sum(tokens), 1.0)
    out = {}
    for k in per_rank[0]:
        if k in ("train/loss", "train/skipped_rows"):
            out[k] = sum(m.get(k, 0.0) for m in per_rank)
        elif k == "train/tokens":
            out[k] = sum(tokens)
        elif k.startswith("sync/") or k in ("train/grad_norm", "train/optimizer_steps"):
            out[k] = per_rank[0][k]  # equal on every rank, or rank 0's (the weights it sends)
        elif k.startswith("time/"):
            out[k] = max(m.get(k, 0.0) for m in per_rank)  # the slowest rank sets the pace
        else:
            out[k] = sum(m[k] * n for m, n in zip(per_rank, tokens, strict=True)) / total
    return out


class RayRun:
    """One run's driver state: actors, scheduler, counters."""

    def __init__(self, cfg: Config, run_dir: Path, init_path: Path, ref_path: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.init_path = init_path  # what a fresh trainer group / rollout worker loads
        self.ref_path = ref_path  # the policy GRPO started from (the KL reference)
        r = cfg.ray
        self.share_size = r.tasks_per_share or tasks_per_share(
            cfg.train.tasks_per_step, r.rollout_workers
        )
        self.ahead = {"sync": 0, "one-step-off": 1, "async": r.async_ahead}[r.mode]
        if self.ahead < 0:
            self.ahead = r.max_staleness
        self.prefix = actor_prefix(cfg)
        bundles, self.rollout_bundle, self.trainer_bundle = placement_bundles(cfg)
        self.pg = placement_group(bundles, strategy=r.placement_strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=120)
        if not ready:
            remove_placement_group(self.pg)
            raise RuntimeError(
                f"Ray cannot place the bundles {bundles} (ray.rollout / ray.trainer resources, "
                f"ray.placement={r.placement}); the cluster has {ray.cluster_resources()}"
            )
        self.worker_cls = ray.remote(RolloutWorker)
        self.trainer_cls = ray.remote(TrainerRank)
        self.workers: list[Any] = []
        self.worker_gen = [0] * r.rollout_workers
        self.trainers: list[Any] = []
        self.weights_ref: Any = None
        self.version = 0
        self.step = 0
        self.evals: dict[str, Any] = {}
        self.counters = {
            "recovery/rollout_restarts": 0,
            "recovery/trainer_restarts": 0,
            "recovery/reissued_shares": 0,
            "faults/nonfinite_steps": 0,  # optimizer-step skips (NaN/inf), as the local loop logs
        }
        self.epoch = 0  # bumped on a trainer restart: in-flight work of older epochs is ignored
        self.pending: dict[Any, tuple[int, int, int]] = {}  # ref -> (worker, share, epoch)
        self.idle: set[int] = set()
        self.sched = self._scheduler(0, 0)
        self.traj_log = run_dir / "trajectories.jsonl"

    # -- actors ---------------------------------------------------------------------------
    def _strategy(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)

    def _env_vars(self, num_cpus: float) -> dict[str, Any]:
        threads = str(self.cfg.run.threads or max(1, int(num_cpus)))
        return {"env_vars": {"OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}}

    def _new_worker(self, i: int) -> Any:
        r = self.cfg.ray
        gen = self.worker_gen[i]
        self.worker_gen[i] += 1
        name = f"{self.prefix}-rollout-{i}" + (f"-r{gen}" if gen else "")
        return self.worker_cls.options(
            name=name,
            num_cpus=r.rollout.num_cpus,
            num_gpus=r.rollout.num_gpus,
            max_restarts=0,
            scheduling_strategy=self._strategy(self.rollout_bundle[i]),
            runtime_env=self._env_vars(r.rollout.num_cpus),
        ).remote(self.cfg, str(self.init_path), i)

    def _replace_worker(self, i: int, why: BaseException, out: MetricsSink) -> None:
        self.counters["recovery/rollout_restarts"] += 1
        if self.counters["recovery/rollout_restarts"] > self.cfg.ray.max_rollout_restarts:
            raise RuntimeError(
                f"rollout workers died {self.counters['recovery/rollout_restarts']} times "
                f"(ray.max_rollout_restarts={self.cfg.ray.max_rollout_restarts})"
            ) from why
        out.message(f"rollout worker {i} died ({type(why).__name__}); starting a replacement")
        ray.kill(self.workers[i], no_restart=True)
        self.workers[i] = self._new_worker(i)
        if self.weights_ref is not None:
            self.workers[i].load_weights.remote(self.weights_ref, self.version)

    def _start_trainers(self, policy_path: Path, checkpoint: Path | None) -> None:
        r = self.cfg.ray
        M = r.trainer_ranks
        self.trainers = [
            self.trainer_cls.options(
                name=f"{self.prefix}-trainer-{rank}-e{self.epoch}",
                num_cpus=r.trainer.num_cpus,
                num_gpus=r.trainer.num_gpus,
                max_restarts=0,
                scheduling_strategy=self._strategy(self.trainer_bundle[rank]),
                runtime_env=self._env_vars(r.trainer.num_cpus),
            ).remote(
                self.cfg,
                rank,
                M,
                str(policy_path),
                str(self.ref_path),
                str(checkpoint) if checkpoint else None,
            )
            for rank in range(M)
        ]
        host, port = ray.get(self.trainers[0].rendezvous.remote())
        ray.get([t.init_group.remote(host, port) for t in self.trainers])

    def _scheduler(self, finalized: int, dropped: int) -> ShareScheduler:
        first = finalized // self.share_size
        return ShareScheduler(
            self.cfg.train.tasks_per_step,
            self.share_size,
            self.ahead,
            self.cfg.ray.max_staleness,
            next_share=first,
            consumed_share=first,
            finalized=finalized,
            dropped=dropped,
        )

    # -- state: fresh start, resume, trainer restart ---------------------------------------
    def restore(self, checkpoint: Path | None) -> None:
        """(Re)build the trainer group from ``checkpoint`` (None: the initial policy) and put
        the driver's counters back to that point."""
        state: dict[str, Any] = {"step": 0, "cursor": 0, "evals": {}, "dropped": 0}
        if checkpoint is not None:
            state = json.loads((checkpoint / "state.json").read_text())
        self.step = int(state["step"])
        self.version = int(state.get("policy_version", self.step))
        self.evals = dict(state.get("evals", {}))
        self.sched = self._scheduler(int(state["cursor"]), int(state.get("dropped", 0)))
        self.epoch += 1  # results of shares handed out before this point are ignored
        self._start_trainers(checkpoint / "model" if checkpoint else self.init_path, checkpoint)
        if self.traj_log.exists():  # lines past the checkpoint will be trained again
            keep = [
                line
                for line in self.traj_log.read_text().splitlines()
                if json.loads(line)["step"] <= self.step
            ]
            self.traj_log.write_text("".join(f"{line}\n" for line in keep))

    def _restart_trainers(self, why: BaseException, out: MetricsSink) -> None:
        self.counters["recovery/trainer_restarts"] += 1
        n = self.counters["recovery/trainer_restarts"]
        if n > self.cfg.ray.max_trainer_restarts:
            raise RuntimeError(
                f"the trainer group failed {n} times "
                f"(ray.max_trainer_restarts={self.cfg.ray.max_trainer_restarts})"
            ) from why
        for t in self.trainers:
            ray.kill(t, no_restart=True)
        found = list_checkpoints(self.run_dir)
        ckpt = found[-1] if found else None
        out.message(
            f"trainer group failed ({type(why).__name__}); restart {n}: "
            f"from {ckpt.name if ckpt else 'the initial policy'}"
        )
        self.restore(ckpt)
        self._sync_weights({}, out, wait=True)

    def _check_threads(self, out: MetricsSink) -> None:
        """Each actor must run the torch threads it was given (``run.threads`` or its CPUs): more
        would oversubscribe the cores that overlapping rollout and training rely on."""
        want = {
            "rollout": self.cfg.run.threads or max(1, int(self.cfg.ray.rollout.num_cpus)),
            "trainer": self.cfg.run.threads or max(1, int(self.cfg.ray.trainer.num_cpus)),
        }
        got = {
            "rollout": ray.get([w.threads.remote() for w in self.workers]),
            "trainer": _trainer_get([t.threads.remote() for t in self.trainers]),
        }
        for role, threads in got.items():
            if any(n != want[role] for n in threads):
                raise RuntimeError(f"{role} actors run {threads} torch threads, not {want[role]}")
        out.message(f"actor torch threads: {got}")

    def _boxed(self) -> list[Any]:
        """The current weights for a rollout/evaluate call: boxed, so Ray passes the reference
        and the worker fetches it only when its engine is older than ``self.version``."""
        return [self.weights_ref] if self.weights_ref is not None else []

    # -- phases -----------------------------------------------------------------------------
    def _sync_weights(self, m: dict[str, float], out: MetricsSink, wait: bool) -> None:
        """Rank 0's full weights -> object store -> every worker, stamped (start-up and after
        a trainer restart; in the step loop the weights ride on the update and rollout calls)."""
        with timed(m, "time/sync_s"):
            if _gathers_on_every_rank(self.cfg):
                refs = [t.get_weights.options(num_returns=2).remote() for t in self.trainers]
                _trainer_get([b for _, b in refs])  # FSDP2: every rank takes part in the gather
                weights, nbytes = refs[0]
            else:
                weights, nbytes = self.trainers[0].get_weights.options(num_returns=2).remote()
            m["sync/bytes"] = float(_trainer_get(nbytes))
            self.weights_ref = weights
            loads = {
                i: w.load_weights.remote(weights, self.version) for i, w in enumerate(self.workers)
            }
            if wait:  # sync / colocated: engines must hold the new version before generating
                for i, ref in loads.items():
                    try:
                        ray.get(ref)
                    except _DIED as exc:
                        self._replace_worker(i, exc, out)

    def _evaluate(self, out: MetricsSink) -> dict[str, float]:
        for _ in range(3):
            i = min(self.idle) if self.idle else 0
            try:
                return ray.get(self.workers[i].evaluate.remote(self._boxed(), self.version))
            except _DIED as exc:
                self._replace_worker(i, exc, out)
        raise RuntimeError("evaluation failed on three rollout workers in a row")

    def _dispatch(self) -> None:
        """Hand shares to idle workers (reissued ones first) while pacing allows."""
        for i in sorted(self.idle):
            s = self.sched.next_to_start()
            if s is None:
                return
            share = self.sched.share_of(s, rollout_seed(self.cfg, self.sched.batch_of(s) + 1))
            ref = self.workers[i].rollout.remote(share, self._boxed(), self.version)
            self.pending[ref] = (i, s, self.epoch)
            self.idle.discard(i)

    def _collect(self, out: MetricsSink, acc: dict[str, float]) -> None:
        """Wait for one finished share; replace its worker if it died (and reissue the share)."""
        ready, _ = ray.wait(list(self.pending), num_returns=1)
        for ref in ready:
            i, s, epoch = self.pending.pop(ref)
            try:
                res = ray.get(ref)
            except _DIED as exc:
                self._replace_worker(i, exc, out)
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
            self.sched.finished(s, groups)
            acc["tokens"] += res["tokens"]
            acc["gen_s"] += res["seconds"]
            acc["gen_actor_s"] += res["wall_s"]
            acc["gen_actor_cpu_s"] += res["cpu_s"]
            acc["load_s"] += res["load_s"]

    def _train(self, step: int, groups: list[Group]) -> dict[str, float]:
        """Phases 3-5 on the trainer group: rank r gets the r-th equal slice of whole groups;
        rank 0 (every rank under FSDP2, whose gather is collective) returns the new weights in
        the same call, as a second object-store reference that goes to the engines as is."""
        M = self.cfg.ray.trainer_ranks
        per = len(groups) // M
        shards = [[t for g in groups[r * per : (r + 1) * per] for t in g.trajs] for r in range(M)]
        if self.cfg.ray.placement == "colocated":
            ray.get([w.release_memory.remote() for w in self.workers])
        gather_all = _gathers_on_every_rank(self.cfg)
        metric_refs, weights = [], None
        for rank, (t, shard) in enumerate(zip(self.trainers, shards, strict=True)):
            if rank == 0 or gather_all:
                m_ref, w_ref = t.update_and_gather.options(num_returns=2).remote(step, shard)
                weights = w_ref if rank == 0 else weights
            else:
                m_ref = t.update.remote(step, shard)
            metric_refs.append(m_ref)
        m = _combine(_trainer_get(metric_refs))
        self.weights_ref = weights
        return m

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
                        }
                        f.write(json.dumps(row) + "\n")

    def _checkpoint(self, step: int) -> str | None:
        state = {
            "cursor": self.sched.finalized,
            "dropped": self.sched.dropped,
            "evals": self.evals,
            "policy_version": self.version,
            "counters": self.counters,
        }
        return _trainer_get(self.trainers[0].save.remote(step, state, self.cfg.checkpoint.keep))

    # -- the loop ----------------------------------------------------------------------------
    def run(
        self, out: Any, resume_from: Path | None, guard: StopGuard | None = None
    ) -> dict[str, Any]:
        """The step loop; on SIGTERM/SIGINT (``guard``) it stops after the current step with a
        checkpoint and raises :class:`~gyre.checkpoint.resume.Preempted`, as the local loop does."""
        cfg = self.cfg
        self.workers = [self._new_worker(i) for i in range(cfg.ray.rollout_workers)]
        self.idle = set(range(len(self.workers)))
        self.restore(resume_from)
        self._check_threads(out)
        self._sync_weights({}, out, wait=True)
        if "before" not in self.evals:
            self.evals["before"] = self._evaluate(out) if cfg.eval.episodes else {}
            out.log(self.step, dict(self.evals["before"]))
        acc = dict.fromkeys(_ACC, 0.0)
        t_last = time.perf_counter()
        wait_s = 0.0
        dropped_since = 0
        while self.step < cfg.train.steps:
            self._dispatch()
            got = self.sched.take_batch(self.version)
            if got is None:
                t0 = time.perf_counter()
                self._collect(out, acc)
                wait_s += time.perf_counter() - t0
                continue
            batch, stale = got
            if not batch:  # only stale groups at the head: drop and log them, keep going
                self._log_trajectories(self.step + 1, [], stale)
                dropped_since += len(stale)
                continue
            step = self.step + 1
            m: dict[str, float] = {}
            try:
                with timed(m, "time/train_s"):
                    m.update(self._train(step, batch))  # the new weights come back with it
                self.version = step
                self.step = step
            except TrainerGroupFailed as exc:
                self._restart_trainers(exc, out)  # back to the latest checkpoint's step
                acc = dict.fromkeys(_ACC, 0.0)
                continue
            trajs = [t for g in batch for t in g.trajs]
            staleness = np.array([step - 1 - t.policy_version for t in trajs], dtype=float)
            self._log_trajectories(step, batch, stale)
            dropped_since += len(stale)
            now = time.perf_counter()
            m.update(rollout_metrics(trajs, cfg.train.group_size))
            self.counters["faults/nonfinite_steps"] += int(m.get("train/nonfinite_skipped", 0) > 0)
            m["rollout/failed_episodes"] = float(sum(bool(t.info.get("failed")) for t in trajs))
            m.update(
                {
                    "time/rollout_s": wait_s,
                    "perf/rollout_tokens_per_s": acc["tokens"] / acc["gen_s"]
                    if acc["gen_s"]
                    else 0.0,
                    "perf/samples_per_s": len(trajs) / (now - t_last),
                    "time/step_s": now - t_last,
                    # what the actors spent inside their calls, and what the calls cost beyond
                    "time/gen_actor_s": acc["gen_actor_s"],
                    "time/gen_actor_cpu_s": acc["gen_actor_cpu_s"],
                    "time/sync_load_s": acc["load_s"],
                    "time/sync_s": m.get("time/sync_gather_s", 0.0) + acc["load_s"],
                    "time/train_call_overhead_s": m["time/train_s"]
                    - m.get("time/trainer_update_s", 0.0)
                    - m.get("time/sync_gather_s", 0.0),
                    "async/staleness_mean": float(staleness.mean()),
                    "async/staleness_max": float(staleness.max()),
                    "async/dropped": float(dropped_since * cfg.train.group_size),
                    "async/dropped_total": float(self.sched.dropped * cfg.train.group_size),
                    **{k: float(v) for k, v in self.counters.items()},
                    "policy_version": float(self.version),
                }
            )
            acc = dict.fromkeys(_ACC, 0.0)
            wait_s, dropped_since, t_last = 0.0, 0, now
            if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.train.steps:
                with timed(m, "time/eval_s"):
                    m.update(self._evaluate(out))
            # Per-episode histograms incl. staleness (the update of `step` trains version step-1);
            # no samples here: the driver holds no tokenizer.
            out.trajectories(step, trajs, trained_version=step - 1)
            out.log(step, m)
            saved = None
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                try:
                    saved = self._checkpoint(step)
                except TrainerGroupFailed as exc:
                    self._restart_trainers(exc, out)
                    continue
            preempt_if_requested(guard, "grpo", step, saved, lambda s=step: self._checkpoint(s))
        for ref in list(self.pending):  # shares generated ahead of the last step: not trained
            ray.cancel(ref)
        self.pending.clear()
        self.idle = set(range(len(self.workers)))
        after = self._evaluate(out) if cfg.eval.episodes else {}
        self.evals["after"] = after
        out.log(cfg.train.steps, dict(after))
        if not cfg.checkpoint.every or cfg.train.steps % cfg.checkpoint.every:
            self._checkpoint(cfg.train.steps)
        _trainer_get(self.trainers[0].save_final.remote(str(self.run_dir / "final")))
        return {"before": self.evals["before"], "after": after}

    def shutdown(self) -> None:
        for a in self.workers + self.trainers:
            ray.kill(a, no_restart=True)
        remove_placement_group(self.pg)


def off_policy_default(cfg: Config) -> bool:
    """Switch on the off-policy correction for runs that train stale trajectories.

    With ``ray.mode`` one-step-off or async and ``ray.max_staleness >= 1`` a batch holds samples
    of older policy versions, so unless the config names ``train.algo.rollout_is`` itself, it
    becomes ``truncate`` (TIS: each token's loss times min(pi_old_train / pi_rollout, C); with
    recomputed or current old log-probs that ratio carries the versions of drift). Returns True
    when it changed the config. Sync runs (and max_staleness 0) are left as they are.
    """
    algo = cfg.train.algo
    stale = cfg.ray.mode != "sync" and cfg.ray.max_staleness >= 1
    if not stale or "rollout_is" in algo.model_fields_set or algo.rollout_is != "none":
        return False
    algo.rollout_is = "truncate"
    return True


def train(cfg: Config, sink: MetricsSink | None = None) -> dict[str, Any]:
    """The Ray runner's ``train``: same config, same outputs as :func:`gyre.loop.train`."""
    from gyre.checkpoint.store import find_resume

    t_start = time.perf_counter()
    corrected = off_policy_default(cfg)  # before setup, so config.yaml shows it
    run_dir, device = setup(cfg, fresh_check=True)
    cfg.run.dir = str(run_dir.resolve())  # actors on other nodes need an absolute path
    resume_from = find_resume(run_dir, cfg.run.resume)
    start = base_model_path(cfg, run_dir)
    if resume_from is None and cfg.sft.steps > 0:
        start = run_sft(cfg, run_dir, device, start)  # the warm start runs in the driver
    elif (run_dir / "sft").is_dir():
        start = run_dir / "sft"
    torch.set_num_threads(1)  # the driver only schedules and computes advantages
    owned = connect(cfg)
    out = build_telemetry(cfg, run_dir, None, extra=sink)  # the driver decodes no samples
    if corrected:
        out.message(
            f"ray.mode={cfg.ray.mode} trains samples up to {cfg.ray.max_staleness} versions "
            "old: train.algo.rollout_is=truncate (off-policy correction; set it to keep another)"
        )
    run = None
    try:
        with StopGuard() as guard:  # after ray.init, so this handler is the one that runs
            run = RayRun(cfg, run_dir, start, start)
            res = run.run(out, resume_from, guard)
        counters = dict(run.counters)
    finally:
        out.close()
        if run is not None:
            run.shutdown()
        if owned:
            ray.shutdown()
    summary = {
        "run_dir": str(run_dir),
        "steps": cfg.train.steps,
        "sft_steps": cfg.sft.steps,
        "before": res["before"],
        "after": res["after"],
        "wall_s": time.perf_counter() - t_start,
        "runner": "ray",
        **counters,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
