"""The Ray runner's rollout-worker pool: ``ray.rollout_workers``
:class:`~gyre.runners.actors.RolloutWorker` actors, the shares they play, and their recovery.

The pool hands *shares* of the task stream (:class:`~gyre.runners.scheduler.ShareScheduler`) to
idle workers, collects the finished groups, and keeps every worker on the policy version the
driver last published (``weights_ref``, ``version``): the weights ride on each rollout call as a
boxed object-store reference, loaded only by a worker whose engine is older.

A worker that dies is replaced in the same bundle (waiting, up to ``ray.replacement_wait_s``,
for a node with room), loaded with the current weights, and its share reissued: trajectory ids
are ``task:sample``, so nothing is lost or trained twice. A share whose weights lived on a lost
node is reissued to the same (live) worker. Results of shares handed out before a trainer
restart (an older ``epoch``) are ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gyre.rollout.core import rollout_seed
from gyre.runners.actors import RolloutWorker
from gyre.runners.ray_site import DIED, LOST, ActorSite, ray
from gyre.runners.scheduler import Group, ShareScheduler

ACC = ("tokens", "gen_s", "gen_actor_s", "gen_actor_cpu_s", "load_s")  # per-step sums


class RolloutPool:
    """The rollout workers of one Ray run, in the bundles ``bundles`` (one per worker)."""

    def __init__(self, site: ActorSite, bundles: list[int], init_path: Path) -> None:
        self.site, self.cfg = site, site.cfg
        self.bundles = bundles
        self.init_path = init_path  # what a fresh worker's engine loads before any sync
        self.cls = ray.remote(RolloutWorker)
        n = self.cfg.ray.rollout_workers
        self.gen = [0] * n  # replacements of each worker so far (in the actor names)
        self.weights_ref: Any = None  # the published policy, and its version
        self.version = 0
        self.epoch = 0  # bumped on a trainer restart: in-flight work of older epochs is ignored
        self.pending: dict[Any, tuple[int, int, int]] = {}  # ref -> (worker, share, epoch)
        # a share found the weights it was to load gone with their node: until the placement
        # publishes them again, every reissued share would fail on the same lost object
        self.weights_lost = False
        self.acc = dict.fromkeys(ACC, 0.0)
        self.sched: ShareScheduler  # set by the placement's restore
        self.workers = [self._new_worker(i) for i in range(n)]
        self.idle = set(range(n))

    # -- the actors ---------------------------------------------------------------------------
    def _new_worker(self, i: int) -> Any:
        site, r = self.site, self.cfg.ray
        gen = self.gen[i]
        self.gen[i] += 1
        name = f"{site.prefix}-rollout-{i}" + (f"-r{gen}" if gen else "")
        actor = site.actor(self.cls, name, r.rollout, self.bundles[i])
        return actor.remote(self.cfg, str(self.init_path), i)

    def replace(self, i: int, why: BaseException) -> None:
        """Worker ``i`` died: count it, start a replacement and give it the current weights."""
        site = self.site
        site.count_restart("rollout", "rollout workers died", why)
        site.note_lost_nodes()
        site.out.message(f"rollout worker {i} died ({type(why).__name__}); starting a replacement")
        ray.kill(self.workers[i], no_restart=True)
        what = f"replacement rollout worker {i}"
        self.workers[i] = site.nodes.place(  # its bundle may wait for a replacement node
            start=lambda _: [self._new_worker(i)],
            probe=lambda a, left: site.nodes.wait_placed(a[0].pid.remote(), what, left),
            what=what,
            timeout_s=self.cfg.ray.replacement_wait_s,
            died=DIED,
        )[0]
        site.note_lost_nodes()
        if self.weights_ref is not None:
            self.workers[i].load_weights.remote(self.weights_ref, self.version)

    def threads(self) -> list[int]:
        """Each worker's torch threads."""
        refs = [w.threads.remote() for w in self.workers]
        return self.site.waits.get(refs, "worker", "start-up", "the rollout workers", True)

    def publish(self, weights: Any, version: int, wait: bool) -> None:
        """Make ``weights`` (an object-store reference) the policy the workers follow; with
        ``wait``, every worker loads it now (replacing one that died)."""
        self.weights_ref, self.version, self.weights_lost = weights, version, False
        if not wait:  # the weights ride on the next rollout and evaluate calls
            return
        loads = {i: w.load_weights.remote(weights, version) for i, w in enumerate(self.workers)}
        for i, ref in loads.items():  # sync / colocated: engines hold it before generating
            try:
                self.site.waits.get(ref, "worker", "weight load", f"rollout worker {i}")
            except DIED as exc:
                self.replace(i, exc)

    def boxed(self) -> list[Any]:
        """The current weights for a rollout/evaluate call: boxed, so Ray passes the reference
        and the worker fetches it only when its engine is older than ``self.version``."""
        return [self.weights_ref] if self.weights_ref is not None else []

    def release_memory(self) -> None:
        """Colocated placement: the workers free their caches before the update."""
        refs = [w.release_memory.remote() for w in self.workers]
        self.site.waits.get(refs, "worker", "release memory", "the rollout workers")

    # -- shares ---------------------------------------------------------------------------
    def restart_shares(self, sched: ShareScheduler) -> None:
        """Continue from ``sched`` (a fresh start or a checkpoint); work handed out before is
        ignored when it comes back."""
        self.sched = sched
        self.epoch += 1

    def dispatch(self) -> None:
        """Hand shares to idle workers (reissued ones first) while pacing allows."""
        for i in sorted(self.idle):
            s = self.sched.next_to_start()
            if s is None:
                return
            step = self.sched.batch_of(s) + 1
            share = self.sched.share_of(s, rollout_seed(self.cfg, step))
            ref = self.workers[i].rollout.remote(share, self.boxed(), self.version, step)
            self.pending[ref] = (i, s, self.epoch)
            self.idle.discard(i)

    def collect(self) -> None:
        """Wait for one finished share; replace its worker if it died (and reissue the share)."""
        if not self.pending:  # nothing in flight and nothing may start: waiting would never end
            raise RuntimeError(
                f"ray runner: the batch needs groups but no rollout share is in flight "
                f"(scheduler: {self.sched.describe()}); please report this with the config"
            )
        busy = ", ".join(str(i) for i, _, _ in self.pending.values())
        waits = self.site.waits
        ready = waits.any(list(self.pending), "worker", "rollout", f"rollout workers {busy}")
        for ref in ready:
            i, s, epoch = self.pending.pop(ref)
            try:
                res = ray.get(ref, timeout=self.cfg.faults.call_timeout_s)  # ready already
            except (*DIED, LOST) as exc:
                if not isinstance(exc, LOST):
                    self.replace(i, exc)
                elif not self.weights_lost:  # the weights it was to load lived on a lost node
                    self._lost_weights()  # (a trainer node): the worker is fine
                if epoch == self.epoch:
                    self.site.counters["recovery/reissued_shares"] += 1
                    self.sched.reissue(s)
                self.idle.add(i)
                continue
            self.idle.add(i)
            if epoch != self.epoch:
                continue  # generated before a trainer restart rolled the run back
            self._take(s, res)

    def _lost_weights(self) -> None:
        """Name and count it; the placement gathers the weights again before the next share."""
        self.weights_lost = True
        self.site.counters["recovery/regathered_weights"] += 1
        self.site.out.message(
            f"the weights of version {self.version} were lost with their node before every "
            "rollout worker fetched them: gathering them again from the trainers"
        )

    def _take(self, s: int, res: dict[str, Any]) -> None:
        G = self.cfg.train.group_size
        trajs = res["trajs"]
        groups = [Group(trajs[k].group_id, trajs[k : k + G]) for k in range(0, len(trajs), G)]
        self.sched.finished(s, groups, res["metrics"])
        self.acc["tokens"] += res["tokens"]
        self.acc["gen_s"] += res["seconds"]
        self.acc["gen_actor_s"] += res["wall_s"]
        self.acc["gen_actor_cpu_s"] += res["cpu_s"]
        self.acc["load_s"] += res["load_s"]

    def step_sums(self) -> dict[str, float]:
        """This step's generation sums (tokens, seconds, load seconds); starts the next."""
        acc, self.acc = self.acc, dict.fromkeys(ACC, 0.0)
        return acc

    def cancel_pending(self) -> None:
        """After the last step: shares generated ahead are not trained."""
        for ref in list(self.pending):
            ray.cancel(ref)
        self.pending.clear()
        self.idle = set(range(len(self.workers)))

    def evaluate(self) -> dict[str, float]:
        """Held-out evaluation on an idle worker (another if it dies, three tries)."""
        for _ in range(3):
            i = min(self.idle) if self.idle else 0
            try:
                ref = self.workers[i].evaluate.remote(self.boxed(), self.version)
                return self.site.waits.get(ref, "worker", "evaluation", f"rollout worker {i}")
            except DIED as exc:
                self.replace(i, exc)
        raise RuntimeError("evaluation failed on three rollout workers in a row")

    def close(self) -> None:
        if self.workers:
            try:  # sandboxed reward workers stop with their rollout
                ray.get([w.close.remote() for w in self.workers], timeout=30)
            except Exception:
                pass
        for w in self.workers:
            ray.kill(w, no_restart=True)
