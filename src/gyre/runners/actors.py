"""The two actor roles of the Ray runner, as plain classes (``ray.remote`` wraps them).

They hold the very objects the local runner uses -- a :class:`~gyre.engines.TorchEngine` and an
env factory for rollouts, the policy + AdamW (+ frozen reference) for updates -- and call the
loop's own phase functions, so a Ray run executes the same code as ``runner: local``. Nothing
here imports Ray at module level; tests can drive them in-process.
"""

from __future__ import annotations

import gc
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from gyre.checkpoint.resume import Checkpointer
from gyre.checkpoint.store import load_checkpoint_state
from gyre.config import Config
from gyre.engines import TorchEngine
from gyre.engines.factory import torch_engine_options
from gyre.envs import env_factory
from gyre.loop import STREAM_GRPO, _sampling, run_eval, update_phase
from gyre.models.build import load_pretrained
from gyre.rollout.episodes import RolloutStats, run_episodes
from gyre.rollout.evaluate import train_seed
from gyre.runners.scheduler import Share
from gyre.trainer.distributed import (
    FSDPCollective,
    TorchCollective,
    shard_fsdp2,
    state_bytes,
)
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
    """An engine + env factory that plays whole shares of tasks (all samples of each task)."""

    def __init__(self, cfg: Config, model_path: str, index: int) -> None:
        _quiet_threads(cfg, cfg.ray.rollout.num_cpus)
        device = _role_device(cfg, cfg.ray.rollout.num_gpus)
        model, self.tokenizer = load_pretrained(Path(model_path), device)
        self.engine = TorchEngine(
            model, self.tokenizer.pad_token_id, seed=cfg.run.seed, **torch_engine_options(cfg.perf)
        )
        self.make_env = env_factory(cfg.env)
        self.cfg = cfg
        self.index = index

    def pid(self) -> int:
        return os.getpid()

    def threads(self) -> int:
        """torch intra-op threads of this actor (``run.threads`` / the role's CPUs)."""
        return torch.get_num_threads()

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> float:
        """Weight sync from the trainer; returns the seconds the copy took."""
        t0 = time.perf_counter()
        self.engine.load_weights(state, version)
        return time.perf_counter() - t0

    def _catch_up(self, weights: list[Any] | None, version: int) -> float:
        """Load ``weights[0]`` (an object-store reference, boxed in a list so Ray does not fetch
        it for every call) when it is newer than the engine's; returns the seconds spent."""
        if not weights or version <= self.engine.version:
            return 0.0
        import ray

        t0 = time.perf_counter()
        state = weights[0] if isinstance(weights[0], dict) else ray.get(weights[0])
        self.engine.load_weights(state, version)
        return time.perf_counter() - t0

    def rollout(
        self, share: Share, weights: list[Any] | None = None, version: int = -1
    ) -> dict[str, Any]:
        """Play ``group_size`` episodes of each task of ``share``, first loading ``weights`` of
        ``version`` if the engine is older: the weight sync rides on the rollout call."""
        t_call, cpu_call = time.perf_counter(), time.process_time()
        load_s = self._catch_up(weights, version)
        cfg = self.cfg
        seeds = [
            train_seed(cfg.run.seed, STREAM_GRPO, share.first_task + k)
            for k in range(share.num_tasks)
        ]
        stats = RolloutStats()
        trajs = run_episodes(
            self.make_env,
            self.engine,
            self.tokenizer,
            seeds,
            cfg.train.group_size,
            _sampling(cfg, self.tokenizer, seed=share.seed),
            stats,
            continuous=cfg.perf.continuous,
        )
        G = cfg.train.group_size
        for i, t in enumerate(trajs):
            task = share.first_task + i // G
            t.group_id = task
            t.traj_id = f"{task}:{i % G}"
        return {
            "share": share.index,
            "trajs": trajs,
            "tokens": stats.generated_tokens,
            "seconds": stats.seconds,
            "worker": self.index,
            "version": self.engine.version,
            "load_s": load_s,
            "wall_s": time.perf_counter() - t_call,
            # CPU seconds of this process: ~wall_s when it had its core, less when it waited
            # for one, more if it ran several threads
            "cpu_s": time.process_time() - cpu_call,
        }

    def evaluate(self, weights: list[Any] | None = None, version: int = -1) -> dict[str, float]:
        self._catch_up(weights, version)
        return run_eval(self.cfg, self.engine, self.tokenizer)

    def release_memory(self) -> None:
        """Colocated placement: give memory back before the trainer runs on the same devices.
        (Episodes release their KV caches when they end; this returns the allocator's slack.)"""
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class TrainerRank:
    """One data-parallel rank: policy, optimizer and optional frozen reference."""

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
        self.model, self.tokenizer = load_pretrained(Path(policy_path), self.device)
        self.ref_model = None
        if cfg.train.kl_coef > 0 and ref_path:
            self.ref_model, _ = load_pretrained(Path(ref_path), self.device)
            self.ref_model.eval()
        self.strategy = cfg.ray.strategy
        if self.strategy == "auto":
            self.strategy = "fsdp2" if self.device.type == "cuda" else "ddp"
        self.optimizer: torch.optim.Optimizer | None = None
        self.resume_checkpoint = resume_checkpoint
        self.comm: TorchCollective | None = None

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
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(minutes=10),
        )
        if self.strategy == "fsdp2":
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self.model = shard_fsdp2(self.model)
            self.comm = FSDPCollective()
            if self.cfg.train.algo.skip_zero_advantage:
                # every FSDP2 rank must run the same backward passes (each is a collective)
                self.cfg = self.cfg.model_copy(deep=True)
                self.cfg.train.algo.skip_zero_advantage = False
        else:
            self.comm = TorchCollective()
            self.comm.broadcast_parameters(self.model)
        cfg = self.cfg
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
        )
        if self.resume_checkpoint:
            load_checkpoint_state(Path(self.resume_checkpoint), self.optimizer)
        return f"{backend}/{self.strategy}"

    def update(self, step: int, trajs: list[Trajectory]) -> dict[str, float]:
        """Phases 3-4 on this rank's shard of whole groups (advantages need whole groups)."""
        assert self.optimizer is not None, "init_group first"
        t0, cpu0 = time.perf_counter(), time.process_time()
        m = update_phase(
            self.cfg,
            step,
            self.model,
            self.optimizer,
            trajs,
            self.tokenizer.pad_token_id,
            self.ref_model,
            comm=self.comm,
        )
        m["time/trainer_update_s"] = time.perf_counter() - t0
        m["time/trainer_update_cpu_s"] = time.process_time() - cpu0
        return m

    def update_and_gather(
        self, step: int, trajs: list[Trajectory]
    ) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """``update`` then ``get_weights`` in one call (called with ``num_returns=2``): the
        weights go from this actor into the object store and on to the engines without a second
        round trip and without passing through the driver."""
        m = self.update(step, trajs)
        t0 = time.perf_counter()
        state, nbytes = self.get_weights()
        m["time/sync_gather_s"] = time.perf_counter() - t0
        m["sync/bytes"] = float(nbytes)
        return m, state

    def get_weights(self) -> tuple[dict[str, torch.Tensor], int]:
        """(full CPU state dict, its bytes); under FSDP2 every rank must call it (a gather)."""
        assert self.comm is not None
        state = self.comm.full_state_dict(self.model)
        return state, state_bytes(state)

    def save(self, step: int, state: dict[str, Any], keep: int) -> str | None:
        """A GRPO checkpoint through the local loop's :class:`~gyre.checkpoint.resume.Checkpointer`
        (same layout, config hash, metrics offset, retention ``checkpoint.keep`` and
        ``checkpoint.on_error``); None when the write failed and the policy is to continue."""
        assert self.optimizer is not None
        run_dir = Path(self.cfg.run.dir)
        return Checkpointer(self.cfg, run_dir).save(
            "grpo", step, self.model, self.tokenizer, self.optimizer, state,
            run_dir / "metrics.jsonl",
        )  # fmt: skip

    def save_final(self, out_dir: str) -> None:
        import shutil

        final = Path(out_dir)
        if final.exists():
            shutil.rmtree(final)
        self.model.save_pretrained(final)
        self.tokenizer.save_pretrained(final)
