"""The root :class:`Config` and its cross-section checks."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from gyre.config.base import (
    Section,
)
from gyre.config.engine import EngineConfig, PerfConfig
from gyre.config.envs import EnvConfig
from gyre.config.ops import CheckpointConfig, EvalConfig, FaultsConfig, LogConfig, TelemetryConfig
from gyre.config.ray import RayConfig
from gyre.config.rewards import RewardConfig
from gyre.config.run import ModelConfig, RolloutConfig, RunConfig
from gyre.config.train import SFTConfig, TrainConfig


class Config(Section):
    """The whole run. ``Config()`` is every field's own default, for every env alike: nothing
    is filled in behind it. What ``gyre train`` runs with no config file is the shipped maze
    recipe, :func:`gyre.config.load_recipe` (``gyre/recipes/maze.yaml``)."""

    run: RunConfig = Field(default_factory=RunConfig, description="Run identity and placement.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model.")
    env: EnvConfig = Field(default_factory=EnvConfig, description="Environment.")
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig,
        description="Where a turn ends; message mode: tools, step-wise samples, limits.",
    )
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Supervised warm start.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="GRPO training.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpointing."
    )
    log: LogConfig = Field(default_factory=LogConfig, description="Console logging.")
    telemetry: TelemetryConfig = Field(
        default_factory=TelemetryConfig, description="Metric sinks, exporter and samples."
    )
    reward: RewardConfig = Field(
        default_factory=RewardConfig, description="Reward functions beyond the env's reward."
    )
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="Rollout engine and weight sync."
    )
    faults: FaultsConfig = Field(
        default_factory=FaultsConfig, description="Fault tolerance policies."
    )
    perf: PerfConfig = Field(
        default_factory=PerfConfig,
        description="Speed switches of scoring, engine and rollout (docs/performance.md).",
    )
    runner: Literal["local", "ray"] = Field(
        "local", description="local: one process; ray: rollout and trainer actors on Ray."
    )
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray runner settings.")
    # One line per value a check filled in because another key asked for it (train.source);
    # the loop prints them, and config.yaml holds the values.
    _adapted: list[str] = PrivateAttr(default_factory=list)

    def adapted(self) -> list[str]:
        """What loading filled in on the config's behalf, one line each (printed by the loop)."""
        return list(self._adapted)

    @field_validator("run")
    @classmethod
    def _check_run(cls, v: RunConfig) -> RunConfig:
        if v.resume not in ("auto", "never") and not v.resume:
            raise ValueError("run.resume must be 'auto', 'never' or a path")
        return v

    def _row_wise_problem(self, key: str) -> str | None:
        """Why ``key`` (step-wise rows: ``rollout.stepwise`` or ``rollout.history_turns``) does
        not fit the advantage settings, or None where it does."""
        adv = self.train.algo.advantage
        if adv not in ("grpo", "dr_grpo", "rloo", "gigpo", "turn_returns"):
            return (
                f"{key} needs an outcome or turn estimator (grpo, dr_grpo, rloo, gigpo, "
                f"turn_returns); train.algo.advantage={adv} is per token (set "
                "train.algo.advantage=grpo)"
            )
        if adv in ("gigpo", "turn_returns") and self.train.algo.kl_in == "reward":
            return f"{key} with train.algo.advantage={adv}: train.algo.kl_in must be 'loss'"
        if self.train.dapo.overlong_buffer_len > 0:
            return f"{key}: train.dapo.overlong_buffer_len must be 0"
        return None

    @model_validator(mode="after")
    def _check_stepwise(self) -> Config:
        r = self.rollout
        if r.stepwise or r.history_turns is not None:
            key = "rollout.stepwise" if r.stepwise else "rollout.history_turns"
            problem = self._row_wise_problem(key)
            if problem is not None:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _check_greedy_episodes(self) -> Config:
        """``train.sampling.greedy_per_group``: a greedy episode's tokens were picked with
        probability 1, so its rollout log-probs are 0 and cannot serve as the old policy's."""
        t = self.train
        if not t.sampling.greedy_per_group:
            return self
        if t.sampling.temperature == 0:
            raise ValueError(
                "train.sampling.greedy_per_group: train.sampling.temperature is 0, so every "
                "episode is greedy already; set greedy_per_group=0 or a temperature > 0"
            )
        _needs_own_sampling(
            self, "greedy_per_group", "a greedy episode's rollout log-probs are 0 (probability 1)"
        )
        return self

    @model_validator(mode="after")
    def _check_retry(self) -> Config:
        """``train.sampling.retry_temperature``: a retried turn is sampled at another
        temperature than the rest, so its rollout log-probs are not the old policy's."""
        if not self.train.sampling.retry_temperature:
            return self
        _needs_own_sampling(
            self,
            "retry_temperature",
            "a retried turn's rollout log-probs are at another temperature",
        )
        return self

    @model_validator(mode="after")
    def _check_source(self) -> Config:
        """``train.source``: the recording's policy is ``model.path``; SFT on env demonstrations
        would change it first, so it is off unless asked for (and then refused); the recorded
        tokens are off-policy after the first update, so rollout IS defaults to truncate."""
        if not self.train.source:
            return self
        if not self.model.path:
            raise ValueError("train.source needs model.path: the model gyre serve --record served")
        if "steps" not in self.sft.model_fields_set:
            self.sft.steps = 0
            self._adapted.append(
                "train.source: sft.steps=0 (the recording was sampled by model.path)"
            )
        elif self.sft.steps > 0:
            raise ValueError(
                "train.source: sft.steps must be 0 (the recording was sampled by model.path)"
            )
        if "rollout_is" not in self.train.algo.model_fields_set:
            self.train.algo.rollout_is = "truncate"
            self._adapted.append(
                "train.source: train.algo.rollout_is=truncate (recorded tokens are off-policy "
                "after the first update; set it to keep another)"
            )
        return self

    @model_validator(mode="after")
    def _check_ray(self) -> Config:
        if self.runner == "ray":
            check_ray_config(self)
        if self.engine.weight_sync == "shared" and self.model.lora is not None:
            raise ValueError(
                "engine.weight_sync=shared is for full-weight training; with model.lora use "
                "memory (the adapter's tensors are copied) or disk"
            )
        if self.eval.validation_episodes and self.env.name == "dataset":
            raise ValueError(
                "eval.validation_episodes draws tasks from its own seeds; env.name=dataset maps "
                "seeds to rows (training rows or the env.dataset.eval_rows), so it has no "
                "validation split: set eval.validation_episodes=0"
            )
        return self


def check_ray_config(cfg: Config) -> None:
    """Errors that name the field, raised before any actor starts."""
    r, t = cfg.ray, cfg.train
    if r.placement == "colocated" and r.mode != "sync":
        raise ValueError(
            f"ray.mode={r.mode!r} needs ray.placement=disaggregated: colocated roles share "
            "devices and alternate, so generation cannot overlap training"
        )
    share = r.tasks_per_share or tasks_per_share(t.tasks_per_step, r.rollout_workers)
    if t.tasks_per_step % share:
        raise ValueError(
            f"ray.tasks_per_share={share} must divide train.tasks_per_step={t.tasks_per_step}"
        )
    if t.tasks_per_step % r.trainer_ranks:
        raise ValueError(
            f"ray.trainer_ranks={r.trainer_ranks} must divide "
            f"train.tasks_per_step={t.tasks_per_step} (every rank trains whole groups)"
        )
    if t.algo.advantage.startswith("reinforce_pp") and r.trainer_ranks > 1:
        raise ValueError(
            f"train.algo.advantage={t.algo.advantage!r} whitens over the whole batch; with "
            "runner=ray it needs ray.trainer_ranks=1"
        )
    if t.level_replay.prob > 0:
        raise ValueError(
            "train.level_replay.prob > 0 replays tasks from the local runner's task stream "
            "(the Ray scheduler hands out contiguous task ranges); use runner=local, or "
            "train.level_replay.prob=0"
        )
    if cfg.engine.weight_sync == "shared":
        raise ValueError(
            "engine.weight_sync=shared makes the engine sample from the trainer's own "
            "parameters, which needs both in one process; with runner=ray the engines and the "
            "trainer are separate actors, so use engine.weight_sync=memory"
        )


def tasks_per_share(tasks_per_step: int, workers: int) -> int:
    """The default unit of rollout work: the smallest divisor of the step >= step / workers."""
    want = -(-tasks_per_step // workers)
    return next(d for d in range(want, tasks_per_step + 1) if tasks_per_step % d == 0)


def _needs_own_sampling(cfg: Config, key: str, why: str) -> None:
    """Refuse ``train.sampling.<key>`` where the trainer would take the rollout's log-probs as
    the old policy's (``old_logprobs=rollout``) or where the episodes are recorded, not sampled
    (``train.source``)."""
    if cfg.train.algo.old_logprobs == "rollout":
        raise ValueError(
            f"train.sampling.{key} needs train.algo.old_logprobs auto, recompute or current: {why}"
        )
    if cfg.train.source:
        raise ValueError(f"train.sampling.{key}: train.source episodes are recorded")
