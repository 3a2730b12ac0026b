"""The training sections: sampling, SFT, the RL algorithm, DAPO, level replay, GRPO."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from gyre.config.base import (
    MAX_LR,
    MIN_TEMPERATURE,
    Section,
)


class SamplingConfig(Section):
    temperature: float = Field(
        0.6, ge=0.0, description="Sampling temperature; 0 is greedy, else at least 0.01."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(4, gt=0, description="Most tokens the policy may write per turn.")
    greedy_per_group: int = Field(
        0,
        ge=0,
        le=1,
        description="GRPO: the last episode of each group is played greedily (temperature 0), "
        "so the update sees the policy's own greedy failures; 0 or 1 (docs/algorithms.md).",
    )
    retry_temperature: float = Field(
        0.0,
        ge=0.0,
        description="GRPO exploration: a turn that follows an invalid action (the env's "
        "info['invalid'], e.g. a maze wall bump) is sampled at this temperature; 0 is off "
        "(docs/algorithms.md).",
    )

    @field_validator("temperature", "retry_temperature")
    @classmethod
    def _check_temperature(cls, v: float) -> float:
        if 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"use 0 (greedy) or at least {MIN_TEMPERATURE}")
        return v


class SFTConfig(Section):
    steps: int = Field(40, ge=0, description="SFT optimizer steps; 0 skips SFT.")
    batch_size: int = Field(32, gt=0, description="Demonstration episodes per SFT step.")
    lr: float = Field(1e-3, gt=0, le=MAX_LR, description="SFT AdamW learning rate, in (0, 1].")
    warmup_steps: int = Field(10, ge=0, description="Linear LR warmup steps.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "cosine", description="LR after warmup: constant, or linear / cosine decay to the end."
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="linear / cosine: the last LR as a fraction of sft.lr."
    )
    demos: int = Field(4000, gt=0, description="Number of demonstration episodes generated.")
    noise: float = Field(
        0.25, ge=0.0, le=1.0, description="Probability that the demonstrator makes a random move."
    )
    successful_only: bool = Field(
        False,
        description="Keep only demonstrations that succeed (filtered behaviour cloning): the SFT "
        "task stream goes on until sft.demos successes (docs/algorithms.md).",
    )
    validation_demos: int = Field(
        0,
        ge=0,
        description="Held-out demonstrations (noise 0, on the validation seeds) scored "
        "teacher-forced during SFT: sft/val_loss, val_token_acc, val_exact; 0: none.",
    )
    validation_every: int = Field(
        0, ge=0, description="Score them every N SFT steps and after the last; 0: after the last."
    )


class AlgoConfig(Section):
    """The RL algorithm beyond GRPO's defaults; every formula is in docs/algorithms.md."""

    @model_validator(mode="after")
    def _check_self_loops(self) -> AlgoConfig:
        if self.self_loop_advantage != "keep" and self.advantage not in ("gigpo", "turn_returns"):
            raise ValueError(
                "self_loop_advantage needs a turn-level advantage (gigpo or turn_returns), "
                f"not {self.advantage}"
            )
        return self

    @property
    def discount(self) -> float:
        """``gamma``, or the estimator's usual discount when it is null (0.95 for gigpo)."""
        if self.gamma is not None:
            return self.gamma
        return 0.95 if self.advantage == "gigpo" else 1.0

    advantage: Literal[
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "gae",
        "gigpo",
        "turn_returns",
    ] = Field("gigpo", description="Advantage estimator (verl: adv_estimator).")
    policy_loss: Literal["ppo_clip", "gspo", "cispo", "reinforce"] = Field(
        "ppo_clip", description="Per-token policy loss; gspo wants clip_eps ~3e-4."
    )
    clip_eps_high: float | None = Field(
        None, gt=0, description="Upper clip eps (DAPO clip-higher 0.28); null = train.clip_eps."
    )
    dual_clip: float | None = Field(
        None, gt=1, description="Dual-clip c for negative advantages (3 is usual); null = off."
    )
    kl_type: Literal["k1", "k2", "k3", "low_var_kl", "abs", "k1+", "k3+", "low_var_kl+", "abs+"] = (
        Field(
            "k3",
            description="KL estimator (k3 = low_var_kl, clamped to [-10, 10]; 'X+': X's value with "
            "k2's gradient); coefficient is train.kl_coef.",
        )
    )
    kl_in: Literal["loss", "reward"] = Field(
        "loss", description="Apply the KL penalty as a loss term or subtract it from the reward."
    )
    entropy_coef: float = Field(0.0, description="Entropy bonus: loss -= coef * entropy.")
    ppo_epochs: int = Field(1, gt=0, description="Passes over each rollout batch.")
    mini_batch_size: int = Field(
        0, ge=0, description="Trajectories per optimizer step; 0 uses train.mini_batches."
    )
    loss_norm_len: int = Field(
        0, ge=0, description="L of seq-mean-token-sum-norm; 0 = the step's longest row."
    )
    old_logprobs: Literal["auto", "recompute", "current", "rollout"] = Field(
        "auto",
        description="Old policy of the ratio: auto = trainer recompute when >1 update per batch, "
        "else current detached; rollout = engine log-probs.",
    )
    skip_zero_advantage: bool = Field(
        True,
        description="Leave rows whose advantage is 0 everywhere out of the update's forward/"
        "backward (their gradient is exactly 0; loss weights keep the whole step's counts).",
    )
    gamma: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Discount (reinforce_pp, gae: per policy token; gigpo, turn_returns: per "
        "turn); null = the estimator's usual value: 0.95 for gigpo (its paper's), else 1.0.",
    )

    gigpo_step_weight: float = Field(
        1.0, ge=0, description="gigpo: weight w of the anchor-state step advantage (A^E + w A^S)."
    )
    gigpo_step_norm: Literal["std", "none"] = Field(
        "std",
        description="gigpo: step advantages divided by the anchor group's std, or mean-centred "
        "only (the paper's F_norm = 1).",
    )
    self_loop_advantage: Literal["keep", "nonpositive"] = Field(
        "keep",
        description="gigpo, turn_returns: a turn that leaves the env's state key unchanged (a "
        "maze wall bump) gets min(A, 0), its true advantage's sign (docs/algorithms.md).",
    )
    whiten_std: Literal["population", "unbiased"] = Field(
        "population",
        description="gae, reinforce_pp*: whitening std over the batch's policy tokens; "
        "population (OpenRLHF) or unbiased (verl, x sqrt(n/(n-1))).",
    )
    count_masked_rows: bool = Field(
        True,
        description="seq-mean-* aggregations: rows whose loss mask is all 0 count in the row "
        "denominator (true) or not (false, as verl).",
    )
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    value_model: Literal["critic", "head"] = Field(
        "critic", description="gae: a separate critic, or a value head on the policy."
    )
    critic_lr: float = Field(
        1e-3, gt=0, le=MAX_LR, description="AdamW learning rate of the value model, in (0, 1]."
    )
    vf_coef: float = Field(0.5, ge=0, description="Value-loss coefficient.")
    value_clip: float = Field(0.2, gt=0, description="Clip range of the clipped value loss.")
    rollout_is: Literal["none", "truncate", "mask"] = Field(
        "none", description="Rollout importance sampling: truncated (TIS) or masked (MIS)."
    )
    rollout_is_level: Literal["token", "sequence"] = Field(
        "token", description="IS weight per token or per sequence (product of token ratios)."
    )
    rollout_is_threshold: float = Field(
        2.0, gt=1, description="TIS cap C / MIS upper bound on pi_old_train / pi_rollout."
    )
    rollout_is_threshold_lower: float = Field(
        0.0, ge=0, lt=1, description="MIS lower bound; 0 = 1 / rollout_is_threshold."
    )


class DapoConfig(Section):
    """DAPO's sampling-side parts (arXiv:2503.14476); clip-higher is train.algo.clip_eps_high."""

    dynamic_sampling: bool = Field(
        False, description="Drop zero-reward-variance groups and sample more tasks to refill."
    )
    max_rounds: int = Field(
        4, gt=0, description="Most rollout rounds per step when refilling the batch."
    )
    overlong_buffer_len: int = Field(
        0, ge=0, description="Soft overlong punishment buffer in policy tokens; 0 = off."
    )
    overlong_max_len: int = Field(
        0, ge=0, description="L_max in policy tokens per episode; 0 = max_new_tokens."
    )
    overlong_penalty_factor: float = Field(1.0, ge=0, description="Largest overlong penalty.")
    mask_truncated: bool = Field(
        False, description="Drop from the loss episodes whose last turn hit max_new_tokens."
    )


class LevelReplayConfig(Section):
    """Prioritised level replay (Jiang et al. 2021, arXiv:2010.03934) over training tasks."""

    prob: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Chance that a task slot replays a buffered task; 0 = off (the maze recipe: "
        "0.5). runner=local only.",
    )
    buffer_size: int = Field(
        64, gt=0, description="Most tasks kept for replay (the lowest-scored one is evicted)."
    )
    temperature: float = Field(
        0.3, gt=0, description="Rank prioritisation: P(task) ~ (1 / rank)^(1 / temperature)."
    )


class TrainConfig(Section):
    steps: int = Field(150, ge=0, description="GRPO steps (rollout + update each).")
    tasks_per_step: int = Field(32, gt=0, description="Distinct tasks (prompts) per GRPO step.")
    group_size: int = Field(
        8, ge=2, description="Samples per task (G) for group-relative advantages."
    )
    lr: float = Field(3e-4, gt=0, le=MAX_LR, description="GRPO AdamW learning rate, in (0, 1].")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "linear",
        description="GRPO LR after warmup: constant, or linear / cosine decay over train.steps "
        "(stepped once per GRPO step).",
    )
    warmup_steps: int = Field(0, ge=0, description="GRPO steps of linear LR warmup.")
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="linear / cosine: the last LR as a fraction of train.lr."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    clip_eps: float = Field(0.2, gt=0, description="PPO clip range epsilon.")
    kl_coef: float = Field(0.0, ge=0, description="k3 KL-to-reference coefficient; 0 loads no ref.")
    adv_eps: float = Field(1e-6, gt=0, description="Epsilon in the group std normalisation.")
    loss_agg: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = Field(
        "seq-mean-token-mean",
        description="How token losses combine: per token, or per sequence then averaged "
        "(docs/algorithms.md).",
    )
    mini_batches: int = Field(
        4, gt=0, description="Optimizer steps per rollout batch (PPO mini-batches)."
    )
    micro_batch_size: int = Field(
        64, gt=0, description="Trajectories per forward/backward (gradient accumulation)."
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig, description="Rollout sampling parameters."
    )
    algo: AlgoConfig = Field(
        default_factory=AlgoConfig,
        description="Estimator, policy loss, KL, epochs, off-policy correction.",
    )
    dapo: DapoConfig = Field(
        default_factory=DapoConfig,
        description="DAPO dynamic sampling and overlong handling.",
    )
    level_replay: LevelReplayConfig = Field(
        default_factory=LevelReplayConfig,
        description="Replay training tasks whose groups had mixed outcomes (local runner).",
    )
    source: str = Field(
        "",
        description="Train on trajectories recorded by 'gyre serve --record DIR' (that DIR or "
        "one .jsonl file) instead of playing env: groups by the agent's gyre_group, "
        "train.group_size episodes each (docs/envs.md, 'Agents gyre did not write').",
    )
