"""The two actor roles of the Ray runner, as plain classes (``ray.remote`` wraps them).

A :class:`RolloutWorker` holds one :class:`~gyre.rollout.Rollout` (engine, env factory, reward
functions), a :class:`TrainerRank` one :class:`~gyre.trainer.Trainer` built by the same
``Trainer.build`` the local runner uses, with the process group joined inside it. So a Ray run
executes the same code as ``runner: local``: LoRA, GAE, reward functions (sandboxed too) and
HTTP engines included. Nothing here imports Ray at module level; tests can drive them in-process.
"""

from __future__ import annotations

import gc
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch

from gyre.checkpoint.resume import Checkpointer
from gyre.checkpoint.store import fault_point, write_model_dir
from gyre.config import Config
from gyre.deadlines import collective_deadline
from gyre.engines.factory import initial_sync
from gyre.engines.sync import WeightSync
from gyre.envs.record import trained_on
from gyre.models.build import load_tokenizer
from gyre.models.lora import load_policy
from gyre.rollout.core import Rollout
from gyre.runners.probe import WorkerProbe, with_probe
from gyre.runners.scheduler import BUFFER_KEY, Share, write_buffer
from gyre.trainer.core import Trainer
from gyre.types import Trajectory


def _role_device(cfg: Config, num_gpus: float) -> torch.device:
    if num_gpus > 0:
        return torch.device(cfg.run.device if cfg.run.device.startswith("cuda") else "cuda")
    return torch.device("cpu")


def _quiet_threads(cfg: Config, num_cpus: float) -> None:
    torch.set_num_threads(cfg.run.threads or max(1, int(num_cpus)))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


class RolloutWorker:
    """A :class:`Rollout` that plays whole shares of tasks (all samples of each task)."""

    def __init__(self, cfg: Config, model_path: str, index: int) -> None:
        _quiet_threads(cfg, cfg.ray.rollout.num_cpus)
        device = _role_device(cfg, cfg.ray.rollout.num_gpus)
        run_dir = Path(cfg.run.dir)
        if cfg.engine.kind == "torch":  # the worker's own copy of the policy (LoRA: + adapter)
            model, tokenizer = load_policy(cfg, run_dir, Path(model_path), device)
        else:  # the servers hold the weights; requests go out with this client
            model, tokenizer = None, load_tokenizer(model_path)
        failures = f"reward_failures.rollout-{index}.jsonl"
        self.rollout = Rollout.build(
            cfg, run_dir, model, tokenizer, owns_model=True, failure_log=failures
        )
        self.cfg = cfg
        self.index = index
        self.probe = WorkerProbe(cfg.engine.verify_tolerance)  # the sync check (runners/probe.py)

    def pid(self) -> int:
        return os.getpid()

    def threads(self) -> int:
        """torch intra-op threads of this actor (``run.threads`` / the role's CPUs)."""
        return torch.get_num_threads()

    def load_weights(self, weights: Any, version: int) -> float:
        """Weight sync from the trainer (tensors, or an HTTP sync's folder); returns seconds."""
        t0 = time.perf_counter()
        if isinstance(weights, str):
            self.rollout.follow(weights, version)
            return time.perf_counter() - t0
        weights, probe = self.probe.split(weights)
        self.rollout.load_weights(weights, version)
        if probe is not None:  # exit 3 when the engine does not serve what it was sent
            engine = self.rollout.engine
            self.probe.check(engine.model, f"rollout worker {self.index}", version, probe)
        return time.perf_counter() - t0

    def _catch_up(self, weights: list[Any] | None, version: int) -> float:
        """Load ``weights[0]`` (an object-store reference, boxed in a list so Ray does not fetch
        it for every call) when it is newer than the engine's; returns the seconds spent."""
        if not weights or version <= self.rollout.version:
            return 0.0
        import ray

        t0 = time.perf_counter()
        w = weights[0]
        timeout = self.cfg.faults.call_timeout_s  # an object-store fetch (exit 69 past it)
        if isinstance(w, (dict, str)):
            state = w
        else:  # tests: an object lost with its node before this fetch
            fault_point("rollout.weights", key=w.hex())
            state = ray.get(w, timeout=timeout)
        self.load_weights(state, version)
        return time.perf_counter() - t0

    def rollout(
        self, share: Share, weights: list[Any] | None = None, version: int = -1, step: int = 0
    ) -> dict[str, Any]:
        """Play and score ``share``, first loading ``weights`` of ``version`` if the engine is
        older: the weight sync rides on the rollout call."""
        t_call, cpu_call = time.perf_counter(), time.process_time()
        fault_point("rollout.share")  # tests: GYRE_FAULT=rollout.share:pause=... (wedged actor)
        load_s = self._catch_up(weights, version)
        m: dict[str, float] = {}
        trajs, stats = self.rollout.play(share.first_task, share.num_tasks, share.seed, m, step)
        return {
            "share": share.index,
            "trajs": trajs,
            "metrics": m,
            "tokens": stats.generated_tokens,
            "seconds": stats.seconds,
            "worker": self.index,
            "version": self.rollout.version,
            "load_s": load_s,
            "wall_s": time.perf_counter() - t_call,
            # CPU seconds of this process: ~wall_s when it had its core, less when it waited
            # for one, more if it ran several threads
            "cpu_s": time.process_time() - cpu_call,
        }

    def evaluate(self, weights: list[Any] | None = None, version: int = -1) -> dict[str, float]:
        self._catch_up(weights, version)
        return self.rollout.evaluate()

    def release_memory(self) -> None:
        """Colocated placement: give memory back before the trainer runs on the same devices.
        (Episodes release their KV caches when they end; this returns the allocator's slack.)
        On a CPU there is no device pool to hand back (the host allocator frees a tensor with
        its last reference), so nothing runs: a full ``gc.collect`` cost ~0.2 s a step."""
        if torch.cuda.is_available():
            gc.collect()
            torch.cuda.empty_cache()

    def close(self) -> None:
        self.rollout.close()


class TrainerRank:
    """One data-parallel rank: a :class:`Trainer` (policy, optimizer, reference, value model)."""

    def __init__(
        self,
        cfg: Config,
        rank: int,
        world_size: int,
        policy_path: str,
        ref_path: str | None,
        resume_checkpoint: str | None,
    ) -> None:
        _quiet_threads(cfg, cfg.ray.trainer.num_cpus)
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.device = _role_device(cfg, cfg.ray.trainer.num_gpus)
        self.paths = (Path(policy_path), Path(ref_path) if ref_path else None)
        self.resume_checkpoint = resume_checkpoint
        self.trainer: Trainer | None = None
        self.http_sync: WeightSync | None = None  # rank 0 of a run whose engines are servers
        self.handover: Any = None  # colocated: the pool handed to the engines and back
        self._pushed = False

    def threads(self) -> int:
        return torch.get_num_threads()

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: an address and free port for the process group."""
        try:
            import ray

            host = ray.util.get_node_ip_address()
        except Exception:  # pragma: no cover - outside Ray
            host = "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return host, port

    def init_group(self, host: str, port: int) -> str:
        """Build the :class:`Trainer` inside the process group (and restore a checkpoint)."""
        run_dir = Path(self.cfg.run.dir)
        world = (self.rank, self.world_size, f"tcp://{host}:{port}")
        policy, ref = self.paths
        self.trainer = Trainer.build(self.cfg, run_dir, policy, ref, self.device, world)
        if self.resume_checkpoint:
            self.trainer.restore(Path(self.resume_checkpoint))
        if self.rank == 0 and self.cfg.engine.kind != "torch":
            from gyre.engines.factory import build_engine

            tok = self.trainer.tokenizer
            _, self.http_sync = build_engine(self.cfg, self.trainer.model, tok, run_dir)
        h = self.cfg.ray.handover
        if self.cfg.ray.placement == "colocated" and (
            h.sleep_engines or h.offload_optimizer or h.offload_weights
        ):
            from gyre.runners.handover import Handover

            engine = self.http_sync.engine if self.http_sync is not None else None
            self.handover = Handover(self.cfg, self.trainer, self.device, engine)
        return type(self.trainer.comm).__name__

    def update(self, step: int, trajs: list[Trajectory]) -> dict[str, float]:
        """Phases 3-4 on this rank's shard of whole groups (advantages need whole groups)."""
        assert self.trainer is not None, "init_group first"
        hand = self.handover.to_trainer() if self.handover is not None else {}
        t0, cpu0 = time.perf_counter(), time.process_time()
        fault_point(f"trainer.update.rank{self.rank}")  # tests: a rank that never gets there
        with self._collective(f"update of step {step}"):
            m = self.trainer.update(step, trajs)
        m["time/trainer_update_s"] = time.perf_counter() - t0
        m["time/trainer_update_cpu_s"] = time.process_time() - cpu0
        if self.handover is not None:  # before the weight load: the engines wake first
            hand.update(self.handover.to_engines())
        return {**m, **hand}

    def _collective(self, stage: str) -> Any:
        """A collective of ``stage`` that times out is a named fault (exit 69), not a bare
        gloo error that would restart the group to hang again."""
        return collective_deadline(
            stage, self.rank, self.world_size, self.cfg.faults.startup_timeout_s
        )

    def update_and_gather(self, step: int, trajs: list[Trajectory]) -> tuple[dict[str, float], Any]:
        """``update`` then ``get_weights`` in one call (called with ``num_returns=2``): the
        weights go from this actor into the object store and on to the engines without a second
        round trip and without passing through the driver."""
        m = self.update(step, trajs)
        t0 = time.perf_counter()
        state, nbytes = self.get_weights(step)
        m["time/sync_gather_s"] = time.perf_counter() - t0
        m["sync/bytes"] = float(nbytes)
        return m, state

    def get_weights(self, version: int = 0) -> tuple[Any, int]:
        """(full CPU state dict or the adapter's, its bytes); under FSDP2 every rank must call it
        (a gather). With HTTP engines rank 0 instead writes ``version`` to the sync folder and
        has every server load it, and returns that folder for the workers to follow."""
        assert self.trainer is not None
        if self.http_sync is not None:
            if not self._pushed:  # first push: under LoRA the servers need the SFT base first
                run_dir = Path(self.cfg.run.dir)
                lora_sft = self.cfg.model.lora is not None and (run_dir / "sft").is_dir()
                initial_sync(
                    self.http_sync,
                    self.trainer.model,
                    version,
                    run_dir / "sft" if lora_sft else None,
                )
                self._pushed = True
            else:
                self.http_sync.sync(self.trainer.model, version)
            path = str(self.http_sync.sync_dir / f"v{version}")
            return path, 0
        with self._collective("weight gather"):  # FSDP2: an all-gather
            state = self.trainer.weights()
        with self._collective("sync probe"):  # the probe rides with them (FSDP2: every rank)
            model, tok = self.trainer.model, self.trainer.tokenizer
            state = with_probe(self.cfg, state, model, tok, version)
        return state, sum(t.numel() * t.element_size() for t in state.values())

    def save(self, step: int, state: dict[str, Any], keep: int) -> str | None:
        """A GRPO checkpoint through the local loop's :class:`~gyre.checkpoint.resume.Checkpointer`
        (same layout, config hash, metrics offset, retention ``checkpoint.keep`` and
        ``checkpoint.on_error``); None when the write failed and the policy is to continue."""
        assert self.trainer is not None
        run_dir = Path(self.cfg.run.dir)
        ckpt = Checkpointer(self.cfg, run_dir)
        state = dict(state)
        buffered = state.pop(BUFFER_KEY, None)  # groups not yet trained: their own file
        if buffered is not None:
            ckpt.also_write.append(lambda folder: write_buffer(folder, buffered))
        with self._collective(f"checkpoint of step {step}"):  # FSDP2: an all-gather
            return self.trainer.save(ckpt, step, state, run_dir / "metrics.jsonl")

    def save_final(self, out_dir: str) -> None:
        """The final model; under FSDP2 a collective (every rank gathers, rank 0 writes)."""
        assert self.trainer is not None
        model: torch.nn.Module | None = self.trainer.model
        if hasattr(self.trainer.comm, "mirror"):
            from gyre.trainer.fsdp_checkpoint import gathered_model

            model = gathered_model(self.trainer)
        if model is not None:
            write_model_dir(Path(out_dir), model, self.trainer.tokenizer, trained_on(self.cfg))
