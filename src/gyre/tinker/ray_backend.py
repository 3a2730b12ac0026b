"""``gyre tinker-serve runner=ray``: the trainer and the samplers as Ray actors.

The HTTP server, the sessions and the future queue stay in the driver (the ``gyre tinker-serve``
process). The work goes to actors that hold the very objects the one-process server uses:

    1 trainer actor     a :class:`~gyre.tinker.training.TrainWork` (the base model, every
                        tenant's adapter or full copy, its AdamW state, the saves)
    N sampler actors    a :class:`~gyre.tinker.sampling.SampleWork` each, on its own copy of
                        the base model; saved sampler weights are read from ``state_dir``

So ``state_dir`` must be one path every node sees (a shared file system). Training calls run
one at a time on the future queue's ``train`` lane, in arrival order, as in one process;
sampling runs on a ``sample`` lane with one worker per sampler actor, each batch sent to the
actor with the fewest batches in flight.

Faults: every actor call waits at most ``ray.call_timeout_s``. A sampler actor that dies is
replaced by Ray (``ray.max_sampler_restarts``) and the batch is sent once more (to another
actor when there is one): a sample is a function of saved weights and its seed, so the answer
is the same. A trainer actor that dies fails the requests in flight with one line naming it; Ray
replaces it (``ray.max_trainer_restarts``) with no tenants, so training state not saved with
``save_state`` is lost, and ``load_state`` from a save continues exactly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from gyre.config.ray import RoleResources
from gyre.deadlines import Heartbeat, PeerFault, ray_ready
from gyre.tinker.config import TinkerRayConfig, TinkerServeConfig
from gyre.tinker.custom_loss import CustomLoss
from gyre.tinker.errors import TinkerError
from gyre.tinker.sampling import SampleWork
from gyre.tinker.service import Backend
from gyre.tinker.tenants import LoraSpec, ModelCard
from gyre.tinker.training import TrainWork, load_host
from gyre.tinker.wire import FwdBwdCall

log = logging.getLogger("gyre.tinker")

REPLACED = (
    " (the trainer actor was replaced since: training state not saved with save_state is "
    "gone; load_state from a save continues)"
)


class ActorGone(TinkerError):
    """An actor died (``died``; ``final``: with no restarts left) or did not answer in time;
    the message names it in one line."""

    status = 503

    def __init__(
        self, message: str, died: bool = False, final: bool = False, fault: Any = None
    ) -> None:
        super().__init__(message)
        self.died, self.final = died, final
        self.fault: PeerFault | None = fault  # the deadline that passed


class ActorStartError(ValueError):
    """An actor's start raised (a bad device, a model folder missing on its node): the server
    does not start, and the message carries the actor's error."""


def _quiet(num_cpus: float) -> None:
    torch.set_num_threads(max(1, int(num_cpus)))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _where() -> dict[str, Any]:
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}


class TrainerActor:
    """A :class:`TrainWork` in its own process (``ray.remote`` wraps it)."""

    def __init__(self, cfg: TinkerServeConfig, folder: str, name: str, hub_id: str | None) -> None:
        import ray

        _quiet(cfg.ray.trainer.num_cpus)
        self.work = TrainWork(cfg, load_host(cfg, folder, name, hub_id))
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self.work.lost_note = REPLACED

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.work, method)(*args)

    def card(self) -> dict[str, Any]:
        return self.work.host.identity()

    def where(self) -> dict[str, Any]:
        return _where()


class SamplerActor:
    """A :class:`SampleWork` on this actor's own copy of the base model."""

    def __init__(self, cfg: TinkerServeConfig, folder: str, name: str, hub_id: str | None) -> None:
        _quiet(cfg.ray.sampler.num_cpus)
        self.work = SampleWork(cfg, load_host(cfg, folder, name, hub_id))

    def sample(self, folder: Path | None, jobs: list[Any]) -> list[bytes]:
        return self.work.sample(folder, jobs)

    def where(self) -> dict[str, Any]:
        return _where()


def _why(exc: Exception) -> str:
    """The error's type, and for an actor whose start raised, that error's last line (Ray's
    message holds the whole traceback)."""
    text = str(exc)
    if "creation task" not in text:
        return type(exc).__name__
    last = [line.strip() for line in text.splitlines() if line.strip()][-1]
    return f"{type(exc).__name__}: {last}"


class Calls:
    """Actor calls with a deadline; an actor's error comes back as it was raised (a
    :class:`TinkerError` names the field), a dead or silent actor as :class:`ActorGone`."""

    def __init__(self, r: TinkerRayConfig) -> None:
        self.r = r

    def get(self, ref: Any, peer: str, stage: str, startup: bool = False) -> Any:
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        timeout = self.r.startup_timeout_s if startup else self.r.call_timeout_s
        key = f"ray.{'startup' if startup else 'call'}_timeout_s={timeout:g}"
        hb = Heartbeat(stage, peer, timeout, self.r.heartbeat_s)

        def gone() -> ActorGone:
            fault = PeerFault("worker", stage, peer, hb.waited, key)
            return ActorGone(str(fault), fault=fault)

        ray_ready([ref], hb, gone)
        try:
            return ray.get(ref, timeout=max(hb.left, 1.0))  # ready: returns at once
        except (RayActorError, ActorUnavailableError) as exc:
            raise ActorGone(f"{peer} died ({_why(exc)}) during {stage}", True) from None
        except RayTaskError as exc:
            if isinstance(exc.cause, TinkerError):
                raise exc.cause from None
            raise

    def revive(self, actor: Any, peer: str) -> None:
        """Wait until Ray has replaced ``actor`` (it answers again), within the start-up
        deadline; an actor with no restarts left is :class:`ActorGone`."""
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        t0 = time.monotonic()
        while (left := self.r.startup_timeout_s - (time.monotonic() - t0)) > 0:
            try:
                ray.get(actor.where.remote(), timeout=left)
                return
            except ActorUnavailableError:  # restarting
                time.sleep(0.2)
            except GetTimeoutError:
                break
            except RayActorError as exc:
                raise ActorGone(
                    f"{peer} is dead ({type(exc).__name__}): no restarts left", True, True
                ) from None
        key = f"ray.startup_timeout_s={self.r.startup_timeout_s:g}"
        raise ActorGone(f"{peer} was not replaced within {key}", True)


class RemoteTrain:
    """:class:`TrainWork`'s methods, each one call on the trainer actor."""

    def __init__(self, actor: Any, calls: Calls, restarts: int) -> None:
        self.actor, self.calls, self.restarts = actor, calls, restarts
        self.down = False  # a call saw the actor die: the next one waits for its replacement

    def _call(self, method: str, *args: Any) -> Any:
        if self.down:
            self.calls.revive(self.actor, "trainer actor")
            self.down = False
        try:
            return self.calls.get(self.actor.call.remote(method, *args), "trainer actor", method)
        except ActorGone as exc:
            if not exc.died:
                raise
            self.down = True
            log.warning("%s", exc.message)
            raise ActorGone(
                f"{exc.message}: training state not saved with save_state is lost; Ray "
                f"replaces the actor (ray.max_trainer_restarts={self.restarts}), then "
                "load_state from a save continues",
                True,
            ) from None

    def create_model(self, model_id: str, session_id: str, spec: LoraSpec | None) -> None:
        self._call("create_model", model_id, session_id, spec)

    def drop_models(self, model_ids: list[str]) -> None:
        self._call("drop_models", model_ids)

    def forward_backward(self, call: FwdBwdCall, custom: CustomLoss | None) -> bytes:
        return self._call("forward_backward", call, custom)

    def optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, Any]:
        return self._call("optim_step", model_id, adam)

    def save(self, model_id: str, kind: str, name: str | None, overwrite: bool) -> str:
        return self._call("save", model_id, kind, name, overwrite)

    def load(self, model_id: str, uri: str, folder: Path, with_opt: bool) -> LoraSpec | None:
        return self._call("load", model_id, uri, folder, with_opt)


class SamplerPool:
    """:class:`SampleWork`'s ``sample`` over the sampler actors, least busy first."""

    def __init__(self, actors: list[Any], calls: Calls) -> None:
        self.actors, self.calls = actors, calls
        self.busy = [0] * len(actors)  # batches in flight
        self.served = [0] * len(actors)  # batches sent (ties of busy go to the least used)
        self.down: set[int] = set()  # died under a batch: wait for the replacement first
        self.dead: set[int] = set()  # no restarts left: never sent work again
        self.deaths: list[str] = []  # one line per sampler actor that died under a batch
        self._lock = threading.Lock()

    def _take(self, avoid: set[int]) -> int:
        with self._lock:
            live = [i for i in range(len(self.actors)) if i not in self.dead]
            if not live:
                raise ActorGone("every sampler actor is dead (ray.max_sampler_restarts)", True)
            free = [i for i in live if i not in avoid] or live
            i = min(free, key=lambda k: (self.busy[k], self.served[k]))
            self.busy[i] += 1
            self.served[i] += 1
            return i

    def sample(self, folder: Path | None, jobs: list[Any]) -> list[bytes]:
        """One batch on the least busy actor; if it dies, once more (on another one if any)."""
        tried: set[int] = set()
        while True:
            i = self._take(tried)
            peer = f"sampler actor {i}"
            try:
                if i in self.down:
                    self.calls.revive(self.actors[i], peer)
                    self.down.discard(i)
                return self.calls.get(self.actors[i].sample.remote(folder, jobs), peer, "sample")
            except ActorGone as exc:
                if exc.died:
                    self.down.add(i)
                if exc.final:
                    self.dead.add(i)
                if not exc.died or tried:
                    raise
                line = f"{exc.message}; the batch is sent again"
                log.warning("%s", line)
                self.deaths.append(line)
                tried.add(i)
            finally:
                with self._lock:
                    self.busy[i] -= 1


def _connect(r: TinkerRayConfig) -> bool:
    """Start or join Ray; True when this call started it (so closing shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    address = r.address or os.environ.get("RAY_ADDRESS") or "local"
    kwargs: dict[str, Any] = {"namespace": r.namespace, "log_to_driver": True}
    if address == "local":
        kwargs.update(num_cpus=r.num_cpus or None, include_dashboard=False)
    ray.init(address=address, **kwargs)
    return True


def _options(role: RoleResources, name: str, max_restarts: int) -> dict[str, Any]:
    threads = str(max(1, int(role.num_cpus)))
    return {
        "name": name,
        "num_cpus": role.num_cpus,
        "num_gpus": role.num_gpus,
        "resources": dict(role.resources),
        "max_restarts": max_restarts,
        "max_task_retries": 0,  # a call in flight when the actor dies fails, named
        "runtime_env": {
            "env_vars": {"OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
        },
    }


def ray_backend(cfg: TinkerServeConfig, folder: str, name: str, hub_id: str | None) -> Backend:
    """Start (or join) Ray, start the trainer and sampler actors on the base model in
    ``folder``, and wait until each has loaded it; the driver keeps only the tokenizer."""
    from gyre.models.build import load_tokenizer

    try:
        import ray
    except ImportError as exc:
        raise ImportError("tinker-serve runner=ray needs Ray: pip install 'gyre[ray]'") from exc
    r = cfg.ray
    cfg = cfg.model_copy(update={"state_dir": str(Path(cfg.state_dir).resolve())})
    owned = _connect(r)
    prefix = f"tinker-{hashlib.sha1(cfg.state_dir.encode()).hexdigest()[:8]}-{os.getpid()}"
    args = (cfg, folder, name, hub_id)
    trainer = (
        ray.remote(TrainerActor)
        .options(**_options(r.trainer, f"{prefix}-trainer", r.max_trainer_restarts))
        .remote(*args)
    )
    samplers = [
        ray.remote(SamplerActor)
        .options(**_options(r.sampler, f"{prefix}-sampler-{i}", r.max_sampler_restarts))
        .remote(*args)
        for i in range(r.sampler_workers)
    ]
    calls = Calls(r)

    def close() -> None:
        for actor in [trainer, *samplers]:
            ray.kill(actor)
        if owned:
            ray.shutdown()

    try:
        t0 = time.perf_counter()
        ident = calls.get(trainer.card.remote(), "trainer actor", "start-up", startup=True)
        for i, s in enumerate(samplers):
            calls.get(s.where.remote(), f"sampler actor {i}", "start-up", startup=True)
    except ActorGone as exc:
        have = ray.cluster_resources()
        close()
        if exc.died:  # its start raised: the message says what
            raise ActorStartError(exc.message) from None
        f = exc.fault
        if f is None:
            raise
        need = {role: getattr(r, role).model_dump() for role in ("trainer", "sampler")}
        detail = f"the actors need {need}, the cluster has {have}"
        raise PeerFault(f.kind, f.stage, f.peer, f.waited_s, f.key, detail) from None
    except BaseException:
        close()
        raise
    log.info(
        "ray: trainer + %d sampler actor(s) up in %.1fs", len(samplers), time.perf_counter() - t0
    )
    ident["arch"] = tuple(ident["arch"])
    card = ModelCard(load_tokenizer(folder), **ident)
    lanes = {"train": 1, "sample": r.sampler_workers}
    train, pool = RemoteTrain(trainer, calls, r.max_trainer_restarts), SamplerPool(samplers, calls)
    return Backend(card, train, pool, lanes, "train", "sample", close)
