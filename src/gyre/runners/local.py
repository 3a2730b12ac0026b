"""``runner: local``: every phase in this process, on the objects themselves.

One :class:`~gyre.trainer.Trainer` and one :class:`~gyre.rollout.Rollout` whose in-process
engine holds a copy of the policy (``engine.weight_sync=shared``: the policy itself), or an HTTP
engine in front of vLLM / SGLang / ``gyre serve`` servers; the weight sync is
:class:`~gyre.engines.sync.WeightSync` (memory copy, shared parameters, or files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gyre.checkpoint.resume import Checkpointer, ResumePlan
from gyre.checkpoint.store import write_model_dir
from gyre.config import Config
from gyre.envs.record import trained_on
from gyre.loop import train as loop_train
from gyre.models.build import resolve_device
from gyre.rollout.core import Rollout
from gyre.telemetry import MetricsSink, timed
from gyre.telemetry.factory import Telemetry
from gyre.trainer.core import Trainer
from gyre.types import Trajectory


class LocalPlacement:
    """The :class:`gyre.loop.Placement` of one process."""

    stale_ok = False

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.trainer: Trainer | None = None
        self.rollout_: Rollout | None = None
        self.ckpt: Checkpointer | None = None
        self.run_dir = Path(".")

    def connect(self) -> None:
        return

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
        self.run_dir, self.ckpt = run_dir, ckpt
        device = resolve_device(cfg.run.device)
        trainer = Trainer.build(cfg, run_dir, policy, ref, device)
        rollout = Rollout.build(cfg, run_dir, trainer.model, trainer.tokenizer)
        self.trainer, self.rollout_ = trainer, rollout
        if plan.phase == "grpo":
            assert plan.ckpt is not None
            state = trainer.restore(plan.ckpt, rollout.generators())
            rollout.engine.version = int(state.get("policy_version", state["step"]))
            rollout.next_task = int(state["cursor"])
        lora = cfg.model.lora is not None
        sft_base = run_dir / "sft" if lora and (run_dir / "sft").is_dir() else None
        rollout.start_sync(trainer.model, sft_base)

    # -- the phases ----------------------------------------------------------------------------
    def rollout(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        assert self.rollout_ is not None
        return self.rollout_.generate(step)

    def update(self, step: int, trajs: list[Trajectory]) -> dict[str, float]:
        assert self.trainer is not None
        return self.trainer.update(step, trajs)

    def sync(self, step: int) -> dict[str, float]:
        assert self.trainer is not None and self.rollout_ is not None
        m: dict[str, float] = {}
        if self.rollout_.sync_due(step):
            with timed(m, "time/sync_s"):
                m.update(self.rollout_.sync(self.trainer.model, step))
        m["policy_version"] = float(self.rollout_.version)
        return m

    def evaluate(self) -> dict[str, float]:
        assert self.rollout_ is not None
        return self.rollout_.evaluate()

    # -- state -----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        assert self.rollout_ is not None
        return {"cursor": self.rollout_.next_task, "policy_version": self.rollout_.version}

    def save(self, step: int, state: dict[str, Any]) -> str | None:
        assert self.trainer is not None and self.rollout_ is not None and self.ckpt is not None
        return self.trainer.save(
            self.ckpt, step, state, self.run_dir / "metrics.jsonl", self.rollout_.generators()
        )

    def write_final(self, out_dir: Path) -> None:
        assert self.trainer is not None
        write_model_dir(out_dir, self.trainer.model, self.trainer.tokenizer, trained_on(self.cfg))

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        if self.rollout_ is not None:
            self.rollout_.close()


def train(cfg: Config, sink: MetricsSink | None = None) -> dict[str, Any]:
    """The local runner: :func:`gyre.loop.train` on a :class:`LocalPlacement`."""
    return loop_train(cfg, LocalPlacement(cfg), sink)
