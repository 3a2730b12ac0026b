"""The :class:`Trainer`: everything one policy update needs, built one way for every placement.

It holds the policy, its optimizer, the frozen KL reference, the value model (GAE) and the
algorithm settings (``cfg.train``), and offers

    update(step, trajectories) -> metrics     phases 3-4: collate, advantages, the policy update
    weights() -> {name: tensor}               what an engine needs (all weights, or the adapter)
    state_dict() / load_state_dict()          policy, optimizer and value model, in memory
    save(...) / restore(...)                  the same through a checkpoint folder

The local runner calls it directly; each Ray trainer rank is one ``Trainer`` inside an actor,
built by the same :meth:`Trainer.build` with a process group (DDP on gloo, FSDP2 on nccl) joined
inside it. Under data parallelism ``update`` gets this rank's shard of whole groups, and the
collective makes the loss weights global and sums the gradients over ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from gyre.algos import Turns, get_estimator
from gyre.algos.turns import self_loop_turns
from gyre.checkpoint.resume import Checkpointer, check_parameters_finite
from gyre.checkpoint.snapshot import Snapshot, load_into, seed_everything
from gyre.config import Config
from gyre.models.build import load_pretrained
from gyre.models.lora import AdapterDisabled, load_policy, trainable_parameters, trainable_state
from gyre.models.vision import vision_of
from gyre.trainer.advantages import batch_advantages
from gyre.trainer.batch import collate
from gyre.trainer.critic import ValueModel
from gyre.trainer.overlong import apply_overlong
from gyre.trainer.schedule import build_scheduler
from gyre.trainer.scoring import ScoringOptions
from gyre.trainer.stepwise import expand_steps
from gyre.trainer.update import policy_update, prepare_batch
from gyre.types import Trajectory


class Trainer:
    """Policy + optimizer (+ reference, + value model) and the update of one rollout batch."""

    def __init__(
        self,
        cfg: Config,
        model: torch.nn.Module,
        tokenizer: Any,
        optimizer: torch.optim.Optimizer,
        ref_model: torch.nn.Module | None = None,
        value_model: ValueModel | None = None,
        comm: Any = None,
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer
        self.optimizer = optimizer
        self.ref_model = ref_model
        self.value_model = value_model
        self.comm = comm  # gyre.trainer.distributed collective, or None (one process)
        t = cfg.train
        # Only a run that asks for a schedule has one: the default run's optimizer, checkpoints
        # and metrics stay exactly what they were (no scheduler.pt, no train/lr).
        self.scheduler = (
            build_scheduler(optimizer, t.warmup_steps, t.steps, t.lr_schedule, t.min_lr_ratio)
            if t.lr_schedule != "constant" or t.warmup_steps > 0
            else None
        )

    # -- building ----------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        cfg: Config,
        run_dir: Path,
        policy_path: Path,
        ref_path: Path | None,
        device: torch.device,
        world: tuple[int, int, str] | None = None,
    ) -> Trainer:
        """Load the policy from ``policy_path`` (a model folder, or a checkpoint's ``model/``),
        the KL reference from ``ref_path`` (the policy GRPO started from; the same folder on a
        fresh start), and build AdamW and the value model from ``cfg``.

        ``world = (rank, world_size, init_method)`` joins a torch.distributed process group
        first and wraps the policy for ``ray.strategy`` (DDP: parameters broadcast from rank 0;
        FSDP2: sharded).
        """
        # Every process that builds a Trainer draws the same LoRA / value-head initialisation
        # (a resumed one then restores its RNG state from the checkpoint).
        seed_everything(cfg.run.seed)
        model, tokenizer = load_policy(cfg, run_dir, policy_path, device)
        lora = cfg.model.lora is not None
        ref = None
        if cfg.train.kl_coef > 0:
            if lora:  # the same model with its adapter off: no second copy
                ref = AdapterDisabled(model)
            elif ref_path is None or Path(ref_path) == Path(policy_path):
                ref = copy.deepcopy(model).eval()
            else:
                ref, _ = load_pretrained(Path(ref_path), device)
                ref.eval()
        algo = cfg.train.algo
        value = None
        if algo.advantage == "gae":  # identical on every rank: a zero head (+ the policy's copy)
            value = ValueModel(model, algo.value_model, algo.critic_lr)
        comm = None
        if world is not None:
            model, comm, cfg = _join_group(cfg, model, device, *world)
        optimizer = torch.optim.AdamW(
            trainable_parameters(model), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
        )
        return cls(cfg, model, tokenizer, optimizer, ref, value, comm)

    # -- the update ---------------------------------------------------------------------------
    def update(
        self, step: int, trajs: list[Trajectory], metrics: dict[str, float] | None = None
    ) -> dict[str, float]:
        """Phases 3-4: collate, (DAPO overlong shaping,) advantages and the policy update.

        The update's random draws (mini-batch order) come from a generator seeded by the run
        seed and ``step``, so a resumed run repeats them exactly.
        """
        cfg = self.cfg
        m = {} if metrics is None else metrics
        device = next(self.model.parameters()).device
        algo, train = cfg.train.algo, cfg.train
        scoring = ScoringOptions.from_perf(cfg.perf)
        if self.scheduler is not None:
            m["train/lr"] = float(self.optimizer.param_groups[0]["lr"])
        needs_turns = get_estimator(algo.advantage).needs_turns
        turns = Turns.of(trajs) if needs_turns else None  # per episode, before expand_steps
        trajs, episodes = expand_steps(trajs)  # step-wise samples -> rows (trainer/stepwise.py)
        rewards = torch.tensor([t.reward for t in trajs])
        groups = torch.tensor([t.group_id for t in trajs])
        batch = collate(trajs, self.tokenizer.pad_token_id, device, vision_of(self.tokenizer))
        shaped = apply_overlong(rewards, trajs, batch, cfg.train.dapo, cfg.train.sampling, m)
        comm = self.comm
        lockstep = comm.lockstep() if comm is not None else None
        m.update(
            prepare_batch(
                self.model,
                batch,
                train,
                self.ref_model,
                self.value_model,
                scoring=scoring,
                lockstep=lockstep,
            )
        )
        adv, adv_m = batch_advantages(algo.advantage, shaped, groups, batch, train, episodes, turns)
        m.update(adv_m)
        if turns is not None and algo.self_loop_advantage != "keep":
            loops = [x for row in self_loop_turns(turns) for x in row]
            m["train/self_loop_turn_frac"] = sum(loops) / max(len(loops), 1)
        gen = torch.Generator()
        gen.manual_seed(cfg.run.seed * 100_003 + step)
        upd = policy_update(
            self.model,
            self.optimizer,
            batch,
            adv,
            train,
            ref_model=self.ref_model,
            generator=gen,
            value_model=self.value_model,
            reduce_counts=comm.reduce_counts if comm is not None else None,
            sync_grads=self._sync_grads if comm is not None else None,
            scoring=scoring,
            lockstep=lockstep,
        )
        m.update(upd)
        check_parameters_finite(self.model, "GRPO", step)  # exit 3, nothing synced or saved
        if self.scheduler is not None:
            self.scheduler.step()  # once per GRPO step (docs/algorithms.md, LR schedules)
        return m

    def _sync_grads(self, model: torch.nn.Module) -> None:
        """Sum the policy's gradients over ranks, and the value model's (never sharded)."""
        self.comm.sync_gradients(model)
        if self.value_model is not None:
            self.comm.sync_module_gradients(self.value_model)

    # -- weights and state ----------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        """What an engine needs to follow the policy: every weight, or the adapter's under LoRA
        (full CPU copies; under FSDP2 a collective every rank must join)."""
        if self.cfg.model.lora is not None:
            return {
                k: v.detach().to("cpu", copy=True) for k, v in trainable_state(self.model).items()
            }
        if self.comm is not None:
            return self.comm.full_state_dict(self.model)
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        """Policy (trainable tensors), optimizer and value model, in memory."""
        out: dict[str, Any] = {
            "model": {k: v.detach().clone() for k, v in trainable_state(self.model).items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
        }
        if self.scheduler is not None:
            out["scheduler"] = copy.deepcopy(self.scheduler.state_dict())
        if self.value_model is not None:
            out["value_model"] = copy.deepcopy(self.value_model.state_dict())
            out["value_optimizer"] = copy.deepcopy(self.value_model.optimizer.state_dict())
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with torch.no_grad():
            own = self.model.state_dict()
            for k, v in state["model"].items():
                own[k].copy_(v)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.value_model is not None and "value_model" in state:
            self.value_model.load_state_dict(state["value_model"])
            self.value_model.optimizer.load_state_dict(state["value_optimizer"])

    def save(
        self,
        ckpt: Checkpointer,
        step: int,
        state: Mapping[str, Any],
        metrics_path: Path,
        generators: Mapping[str, Any] | None = None,
    ) -> str | None:
        """A GRPO checkpoint (policy, optimizer, RNGs, ``state``, value model) through the
        run's :class:`Checkpointer`; None when the write failed and the policy is to go on.
        Under FSDP2 a collective: every rank calls it, rank 0 writes the gathered whole model
        (``gyre.trainer.fsdp_checkpoint``), the others return None."""
        if self._sharded():
            from gyre.trainer.fsdp_checkpoint import save_gathered

            return save_gathered(self, ckpt, step, state, metrics_path, generators)
        extra = self.value_model.save if self.value_model is not None else None
        snap = Snapshot(step, dict(state), self.optimizer, self.scheduler, generators, extra=extra)
        return ckpt.save(self.model, self.tokenizer, snap, metrics_path)

    def _sharded(self) -> bool:
        return hasattr(self.comm, "mirror")  # FSDPCollective: parameters are DTensor shards

    def restore(self, ckpt: Path, generators: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Optimizer, RNGs and value model from a checkpoint (the policy was loaded by
        :meth:`build` from its ``model/``); returns its ``state.json``."""
        optimizer: Any = self.optimizer
        if self._sharded():  # every rank reads the whole optimizer.pt and keeps its shard
            from gyre.trainer.fsdp_checkpoint import ShardedOptimizerLoad

            optimizer = ShardedOptimizerLoad(self.model, self.optimizer)
        state = load_into(ckpt, optimizer, self.scheduler, generators)
        if self.value_model is not None:
            self.value_model.load(ckpt)
        return state


def _join_group(
    cfg: Config, model: torch.nn.Module, device: torch.device, rank: int, size: int, init: str
) -> tuple[torch.nn.Module, Any, Config]:
    import torch.distributed as dist

    from gyre.trainer.distributed import FSDPCollective, TorchCollective, shard_fsdp2

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=init,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=cfg.faults.startup_timeout_s),  # also each collective's bound
    )
    strategy = cfg.ray.strategy
    if strategy == "auto":
        strategy = "fsdp2" if device.type == "cuda" else "ddp"
    if strategy == "fsdp2":
        if device.type == "cuda":
            torch.cuda.set_device(device)
        from gyre.trainer.fsdp_checkpoint import make_mirror

        mirror = make_mirror(model, rank)  # before sharding: checkpoints hold the whole model
        model = shard_fsdp2(model)
        comm = FSDPCollective()
        comm.mirror = mirror
        if cfg.train.algo.skip_zero_advantage:
            # every FSDP2 rank must run the same backward passes (each is a collective)
            cfg = cfg.model_copy(deep=True)
            cfg.train.algo.skip_zero_advantage = False
        return model, comm, cfg
    comm = TorchCollective()
    comm.broadcast_parameters(model)
    return model, comm, cfg
