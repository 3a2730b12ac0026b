"""Typed configuration: a pydantic tree, YAML files and dotted ``key=value`` overrides.

Every field carries a one-line description (shown by ``gyre train --help-config``). Unknown keys
and bad values stop the run with an error that names the dotted key and the offending value.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the value."""


class _Section(BaseModel):
    # allow_inf_nan=False: every float field of every section must be finite (nan/inf would
    # reach the optimizer or the sampler and poison the weights); the error names the key.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# -- bounds (docs/operations.md, "NaN policy") ---------------------------------------------------
# AdamW moves each weight by about lr per step: above 1 every step overshoots any weight scale.
MAX_LR = 1.0
# Below this a temperature divides logits into overflow / a one-hot in all but name; 0 = greedy.
MIN_TEMPERATURE = 1e-2
# run.threads above cores x this oversubscribes to the point of failure (100000 segfaults).
THREADS_PER_CORE = 4
# numpy's legacy seeding (and SeedSequence users such as the data order) take [0, 2**32).
SEED_LIMIT = 2**32
_DEVICE_RE = re.compile(r"^(cpu|auto|mps|cuda(:\d+)?)$")
# What a secret is written as in config.yaml, checkpoints and logs.
REDACTED = "***"


class RunConfig(_Section):
    dir: str = Field("", description="Run directory; empty means runs/<env>-<timestamp>.")
    seed: int = Field(
        0,
        ge=0,
        lt=SEED_LIMIT,
        description="Master seed for model init, data order and sampling, in [0, 2**32).",
    )
    resume: str = Field(
        "never",
        description="'auto' resumes from the newest checkpoint in run.dir, 'never' starts fresh, "
        "or a checkpoint path.",
    )
    device: str = Field(
        "cpu", description="Torch device: 'cpu', 'cuda', 'cuda:1', 'mps' or 'auto'."
    )
    threads: int = Field(
        0, ge=0, description="Torch intra-op threads; 0 uses every core; at most 4 x the cores."
    )
    overwrite: bool = Field(
        False,
        description="With run.resume=never, delete an earlier run in run.dir instead of refusing.",
    )

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if not _DEVICE_RE.match(v):
            raise ValueError("use 'cpu', 'cuda', 'cuda:N', 'mps' or 'auto'")
        return v

    @field_validator("threads")
    @classmethod
    def _check_threads(cls, v: int) -> int:
        most = THREADS_PER_CORE * (os.cpu_count() or 1)
        if v > most:
            raise ValueError(f"at most {THREADS_PER_CORE} x the {os.cpu_count()} cores = {most}")
        return v


class LoraConfig(_Section):
    rank: int = Field(8, gt=0, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is scaled by alpha/r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] | str = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names to adapt (peft target_modules), or 'all-linear'.",
    )


class ModelConfig(_Section):
    path: str = Field(
        "", description="Local Hugging Face causal-LM folder; empty builds the tiny default."
    )
    hidden_size: int = Field(128, gt=0, description="Tiny default: hidden width.")
    num_layers: int = Field(4, gt=0, description="Tiny default: transformer layers.")
    num_heads: int = Field(4, gt=0, description="Tiny default: attention heads.")
    intermediate_size: int = Field(384, gt=0, description="Tiny default: MLP width.")
    max_positions: int = Field(1024, gt=0, description="Tiny default: longest context in tokens.")
    lora: LoraConfig | None = Field(
        None, description="LoRA adapter training (peft); null trains every weight."
    )

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        # The tiny default's attention splits hidden_size into num_heads heads of an even width
        # (rotary embeddings rotate pairs); HF would refuse it later with a traceback.
        if not self.path and self.hidden_size % (2 * self.num_heads):
            raise ValueError(
                f"model.hidden_size={self.hidden_size} must be a multiple of 2 x "
                f"model.num_heads={self.num_heads} (each head's width must be even)"
            )
        return self


class MazeConfig(_Section):
    size: int = Field(5, ge=5, description="Maze side length in cells (at least 5).")
    wall_density: float = Field(
        0.3, ge=0.0, lt=0.7, description="Fraction of cells that are walls."
    )
    min_distance: int = Field(
        4, ge=4, description="Shortest start-to-goal path, in moves, is at least this."
    )
    budget_factor: float = Field(
        2.0, ge=1.0, le=2.0, description="Move budget = floor(factor * shortest path), at most 2x."
    )
    observation: Literal["compass", "exits", "window", "grid"] = Field(
        "compass",
        description="compass: grid once, then neighbours + goal offset; exits: grid once, then "
        "the open moves + goal offset; window: a local square; grid: the whole grid every turn.",
    )
    view: int = Field(
        1,
        ge=1,
        description="View radius: compass cells within this many moves; exits looks 1 or 2"
        " moves ahead; window half-width.",
    )

    @model_validator(mode="after")
    def _check_reachable(self) -> MazeConfig:
        far = 2 * (self.size - 1)
        if self.min_distance > far:
            raise ValueError(
                f"env.maze.min_distance={self.min_distance} cannot be drawn in a maze of "
                f"env.maze.size={self.size}: corner to corner is {far} moves"
            )
        return self


class ArithmeticConfig(_Section):
    max_operand: int = Field(99, gt=0, description="Operands are drawn from [0, max_operand].")
    ops: str = Field("+-", min_length=1, description="Operators to draw from, e.g. '+-*'.")


class DatasetConfig(_Section):
    path: str = Field(
        "", description='JSONL file, one task a line: {"prompt": ..., "answer": ..., ...}.'
    )
    prompt_field: str = Field("prompt", min_length=1, description="Row key holding the prompt.")
    answer_field: str = Field(
        "answer", min_length=1, description="Row key holding the reference answer."
    )
    eval_rows: int = Field(
        0, ge=0, description="Last N rows are held out for evaluation; 0 evaluates on all rows."
    )


BUILTIN_ENVS = ("maze", "arithmetic", "dataset")


class EnvConfig(_Section):
    name: str = Field(
        "maze",
        description="A built-in env (maze, arithmetic, dataset), a name given to "
        "gyre.envs.register, an import path 'module:Class' or a file path 'envs.py:Class' "
        "(docs/envs.md).",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of a plug-in env's class or factory (built-in envs "
        "take their own sections instead).",
    )
    maze: MazeConfig = Field(default_factory=MazeConfig, description="Maze settings.")
    arithmetic: ArithmeticConfig = Field(
        default_factory=ArithmeticConfig, description="Arithmetic settings."
    )
    dataset: DatasetConfig = Field(
        default_factory=DatasetConfig, description="Prompt-dataset (JSONL) settings."
    )

    @field_validator("name")
    @classmethod
    def _env_name(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError("empty; give a built-in env, a registered name or 'module:Class'")
        mod, sep, attr = v.rpartition(":")
        if sep and (not mod.strip() or not attr.strip()):
            raise ValueError(f"expected 'module:Class' or 'file.py:Class', got {v!r}")
        from gyre.plugins import ENV_REGISTRY

        if not sep and v not in BUILTIN_ENVS and v not in ENV_REGISTRY:
            raise ValueError(
                f"unknown env; valid: {', '.join([*BUILTIN_ENVS, *sorted(ENV_REGISTRY)])}, a "
                "name given to gyre.envs.register, 'module:Class' or 'file.py:Class'"
            )
        return v

    @model_validator(mode="after")
    def _kwargs_for_plugins(self) -> EnvConfig:
        if self.kwargs and self.name in BUILTIN_ENVS:
            raise ValueError(
                f"env.kwargs is for plug-in envs; the built-in env {self.name!r} takes "
                f"env.{self.name}.* settings"
            )
        return self


class SamplingConfig(_Section):
    temperature: float = Field(
        1.0, ge=0.0, description="Sampling temperature; 0 is greedy, else at least 0.01."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(4, gt=0, description="Most tokens the policy may write per turn.")

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, v: float) -> float:
        if 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"use 0 (greedy) or at least {MIN_TEMPERATURE}")
        return v


class SFTConfig(_Section):
    steps: int = Field(600, ge=0, description="SFT optimizer steps; 0 skips SFT.")
    batch_size: int = Field(32, gt=0, description="Demonstration episodes per SFT step.")
    lr: float = Field(3e-3, gt=0, le=MAX_LR, description="SFT AdamW learning rate, in (0, 1].")
    warmup_steps: int = Field(10, ge=0, description="Linear LR warmup steps.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="LR after warmup: constant, or linear / cosine decay to the end."
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="linear / cosine: the last LR as a fraction of sft.lr."
    )
    demos: int = Field(4000, gt=0, description="Number of demonstration episodes generated.")
    noise: float = Field(
        0.25, ge=0.0, le=1.0, description="Probability that the demonstrator makes a random move."
    )


class AlgoConfig(_Section):
    """The RL algorithm beyond GRPO's defaults; every formula is in docs/algorithms.md."""

    advantage: Literal[
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "gae",
        "gigpo",
        "turn_returns",
    ] = Field("grpo", description="Advantage estimator (verl: adv_estimator).")
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
        False,
        description="Leave rows whose advantage is 0 everywhere out of the update's forward/"
        "backward (their gradient is exactly 0; loss weights keep the whole step's counts).",
    )
    gamma: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Discount (reinforce_pp, gae: per policy token; gigpo, turn_returns: per "
        "turn; GiGPO's paper uses 0.95).",
    )
    gigpo_step_weight: float = Field(
        1.0, ge=0, description="gigpo: weight w of the anchor-state step advantage (A^E + w A^S)."
    )
    gigpo_step_norm: Literal["std", "none"] = Field(
        "std",
        description="gigpo: step advantages divided by the anchor group's std, or mean-centred "
        "only (the paper's F_norm = 1).",
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


class DapoConfig(_Section):
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


class LevelReplayConfig(_Section):
    """Prioritised level replay (Jiang et al. 2021, arXiv:2010.03934) over training tasks."""

    prob: float = Field(
        0.0, ge=0, le=1, description="Chance that a task slot replays a buffered task; 0 = off."
    )
    buffer_size: int = Field(
        64, gt=0, description="Most tasks kept for replay (the lowest-scored one is evicted)."
    )
    temperature: float = Field(
        0.3, gt=0, description="Rank prioritisation: P(task) ~ (1 / rank)^(1 / temperature)."
    )


class TrainConfig(_Section):
    steps: int = Field(60, ge=0, description="GRPO steps (rollout + update each).")
    tasks_per_step: int = Field(16, gt=0, description="Distinct tasks (prompts) per GRPO step.")
    group_size: int = Field(
        8, ge=2, description="Samples per task (G) for group-relative advantages."
    )
    lr: float = Field(3e-4, gt=0, le=MAX_LR, description="GRPO AdamW learning rate, in (0, 1].")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
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


class EngineConfig(_Section):
    kind: Literal["torch", "http"] = Field(
        "torch", description="torch: in-process engine; http: OpenAI-compatible servers."
    )
    urls: list[str] = Field(
        default_factory=list, description="http: server base URLs, e.g. http://10.0.0.5:8000."
    )
    api: Literal["openai", "sglang"] = Field(
        "openai",
        description="http: openai = /v1/completions + /v1/load_lora_adapter (vLLM, gyre serve); "
        "sglang = SGLang's native /generate + /load_lora_adapter.",
    )
    api_key: SecretStr = Field(
        SecretStr(""),
        description="http: bearer token for a one-off (visible in the command line); prefer the "
        "GYRE_API_KEY environment variable or engine.api_key_file. Written as '***'.",
    )
    api_key_file: str = Field(
        "", description="http: file whose first line is the bearer token (used if no key is set)."
    )
    model: str = Field("", description="http: served base model name; empty asks /v1/models.")
    timeout_s: float = Field(120.0, gt=0, description="http: per-request timeout in seconds.")
    max_retries: int = Field(
        8, ge=0, description="http: retries of one request on other servers before giving up."
    )
    health_interval_s: float = Field(
        1.0, gt=0, description="http: how often dead servers are probed to be put back."
    )
    max_concurrency: int = Field(
        64, gt=0, description="http: requests in flight at once across all servers."
    )
    sync_dir: str = Field(
        "", description="Where weights/adapters are written for engines; empty = <run.dir>/sync."
    )
    sync_every: int = Field(1, gt=0, description="Sync the engines every N policy updates.")
    sync_keep: int = Field(2, ge=1, description="Synced versions kept on disk.")
    weight_sync: Literal["memory", "disk", "shared"] = Field(
        "memory",
        description="torch engine only: copy tensors in memory, go through sync_dir files, or "
        "shared: the engine samples from the trainer's own parameters (zero-copy; needs "
        "sync_every=1 and no LoRA). http engines always use disk.",
    )

    @field_serializer("api_key", when_used="json")
    def _redact(self, v: SecretStr) -> str:
        return REDACTED if v.get_secret_value() else ""

    @model_validator(mode="after")
    def _need_urls(self) -> EngineConfig:
        if self.kind == "http" and not self.urls:
            raise ValueError("engine.urls must list at least one server when engine.kind=http")
        if self.weight_sync == "shared":
            if self.kind != "torch":
                raise ValueError("engine.weight_sync=shared needs engine.kind=torch")
            if self.sync_every != 1:
                raise ValueError(
                    f"engine.weight_sync=shared samples from the trainer's current weights: it "
                    f"needs engine.sync_every=1 (got {self.sync_every}); use memory to lag"
                )
        return self


class PerfConfig(_Section):
    """Speed switches of the trainer's scoring and the torch engine (docs/performance.md).

    The defaults are the fast paths. Each switch exists to measure what it buys; results agree
    with the plain paths to float tolerance, but float order (and so a long run's trajectory)
    may change, which is why these keys are part of the resume config hash.
    """

    train_lean_forward: bool = Field(
        True,
        description="Trainer scoring through the lean forward for Llama/Mistral/Qwen2 "
        "(gyre.models.lean); false = the HF forward.",
    )
    engine_lean_forward: bool = Field(
        True,
        description="torch engine: prefill/decode through the lean forward for Llama/Mistral/"
        "Qwen2; false = the HF forward.",
    )
    pack: bool = Field(
        True,
        description="Trainer: pack short trajectories into shared rows (first-fit decreasing) "
        "when that saves >10 % of positions.",
    )
    logprob_chunk: int = Field(
        1024,
        ge=0,
        description="Trainer: positions per LM-head/log-softmax chunk (checkpointed); 0 = all "
        "at once (with pack=false: the plain full-logits path).",
    )
    share_prefix: bool = Field(
        True,
        description="Trainer: tree-pack rows sharing a prefix (a group's prompt) so it is "
        "computed once in forward and backward; needs train_lean_forward.",
    )
    score_trim: bool = Field(
        True,
        description="Trainer: feed only the positions a scored token needs (no row's last "
        "token, nothing after its last action); false = whole rows.",
    )
    shared_prefix_attention: bool = Field(
        True,
        description="torch engine, lean forward: decode attends a forked group's prompt once "
        "per group (grouped layout / cascade); false = per-row attention.",
    )
    prefix_sharing: bool = Field(
        True,
        description="torch engine: identical prompts admitted together are prefilled once and "
        "the KV cache is forked.",
    )
    compaction: bool = Field(
        True,
        description="torch engine: finished rows leave the decode batch; false = a static "
        "batch that decodes padding until every row is done.",
    )
    compact_min: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="torch engine: fraction of finished rows at which compaction gathers the "
        "live rows (0 = at every finish).",
    )
    compile_decode: bool = Field(
        False,
        description="torch engine: run the one-token decode step through torch.compile "
        "(minutes of compilation on a small CPU).",
    )
    continuous: bool = Field(
        True,
        description="Rollout: continuous batching (a finished turn's next request joins the "
        "running batch); false = turns in lockstep.",
    )


class EvalConfig(_Section):
    episodes: int = Field(
        500, ge=0, le=2**31, description="Held-out episodes per evaluation (seeds 2^31 + i)."
    )
    validation_episodes: int = Field(
        0,
        ge=0,
        le=2**31,
        description="Validation episodes per evaluation on their own seeds (2^32 + i), never "
        "training or held-out ones; 0 = none. Logged as val/*.",
    )
    every: int = Field(20, ge=0, description="Evaluate every N GRPO steps; 0 only before/after.")
    sampled: bool = Field(True, description="Also report sampled (temperature) success.")


class CheckpointConfig(_Section):
    every: int = Field(20, ge=0, description="Checkpoint every N GRPO steps; 0 only at the end.")
    keep: int = Field(3, ge=1, description="How many recent checkpoints to keep.")
    keep_every: int = Field(
        0, ge=0, description="Also keep every checkpoint whose step is a multiple of this; 0: none."
    )
    sft_every: int = Field(
        100, ge=0, description="Checkpoint every N SFT steps (resumable SFT); 0: never."
    )
    dir: str = Field(
        "",
        description="Checkpoint root: a path or fsspec URL (s3://... needs s3fs); "
        "empty: <run.dir>/checkpoints.",
    )
    on_error: Literal["stop", "continue"] = Field(
        "stop", description="A failed checkpoint write (e.g. disk full): stop the run or go on."
    )


class FaultsConfig(_Section):
    max_nonfinite_streak: int = Field(
        3, ge=1, description="Abort after this many steps in a row with a NaN/inf loss or grad."
    )
    max_failed_fraction: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Abort when more than this share of all episodes so far raised in the env.",
    )


class LogConfig(_Section):
    console: Literal["auto", "rich", "plain", "off"] = Field(
        "auto", description="Console output: rich live view, plain lines, or nothing."
    )
    no_signal_steps: int = Field(
        3,
        ge=0,
        description="Warn when this many steps in a row have no group with reward spread "
        "(rollout/frac_reward_zero_std = 1.0: nothing to learn); 0 = never.",
    )

    @field_validator("console", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` in a config file as False.
        return "off" if v is False else v


class RoleResources(_Section):
    num_cpus: float = Field(1.0, ge=0, description="Logical CPUs one actor of this role reserves.")
    num_gpus: float = Field(
        0.0, ge=0, description="GPUs one actor of this role reserves (fractions share a GPU)."
    )


class RayConfig(_Section):
    """The Ray runner (``runner: ray``): actors, placement, async mode and recovery."""

    address: str = Field(
        "",
        description="'' starts a local Ray cluster (or joins RAY_ADDRESS when set, as inside a "
        "submitted job); 'auto' or 'ray://host:10001' joins an existing one.",
    )
    num_cpus: int = Field(0, ge=0, description="Logical CPUs of a local cluster; 0 detects them.")
    temp_dir: str = Field("", description="Ray's session directory for a local cluster.")
    namespace: str = Field("gyre", description="Ray namespace; actors are named inside it.")
    rollout_workers: int = Field(2, gt=0, description="Rollout actors (engine + env factory).")
    trainer_ranks: int = Field(
        1, gt=0, description="Trainer actors doing data-parallel updates over torch.distributed."
    )
    placement: Literal["colocated", "disaggregated"] = Field(
        "disaggregated",
        description="colocated: roles share bundles and alternate; disaggregated: own bundles, "
        "generation overlaps training.",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy for the bundles."
    )
    rollout: RoleResources = Field(
        default_factory=RoleResources, description="Resources of one rollout actor."
    )
    trainer: RoleResources = Field(
        default_factory=RoleResources, description="Resources of one trainer actor."
    )
    mode: Literal["sync", "one-step-off", "async"] = Field(
        "sync",
        description="sync: generate then train; one-step-off: generate batch n+1 while training "
        "n; async: generation runs up to ray.async_ahead batches ahead.",
    )
    max_staleness: int = Field(
        1, ge=0, description="A trajectory of policy v trains version v+k only while k <= this."
    )
    async_ahead: int = Field(
        -1, ge=-1, description="async mode: batches generation may run ahead; -1 = max_staleness."
    )
    tasks_per_share: int = Field(
        0,
        ge=0,
        description="Tasks in one unit of rollout work handed to a worker; 0 = tasks_per_step / "
        "rollout_workers (rounded up to a divisor).",
    )
    strategy: Literal["auto", "ddp", "fsdp2"] = Field(
        "auto", description="Data parallelism: ddp (gloo, CPU) or fsdp2 (nccl, GPU); auto picks."
    )
    max_rollout_restarts: int = Field(
        8, ge=0, description="Dead rollout actors replaced before the run fails."
    )
    max_trainer_restarts: int = Field(
        2, ge=0, description="Trainer-group restarts from the latest checkpoint before failing."
    )

    @field_validator("address")
    @classmethod
    def _check_address(cls, v: str) -> str:
        if v not in ("", "auto", "local") and not v.startswith(("ray://", "http")) and ":" not in v:
            raise ValueError("use '', 'auto', 'local', 'ray://HOST:PORT' or 'HOST:PORT'")
        return v


class RewardFnConfig(_Section):
    fn: str = Field(description="Import path 'module:function' of a batched reward function.")
    name: str = Field("", description="Metric name (reward/<name>_mean); default: function name.")
    weight: float = Field(1.0, description="Weight of this term in the total reward.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments passed on every call."
    )
    sandbox: bool = Field(
        False, description="Run in the sandbox (subprocess, time/memory limits, no network)."
    )

    @field_validator("fn")
    @classmethod
    def _import_path(cls, v: str) -> str:
        mod, sep, attr = v.partition(":")
        if not sep or not mod.strip() or not attr.strip():
            raise ValueError(f"expected 'module:function', got {v!r}")
        return v


class SandboxConfig(_Section):
    timeout_s: float = Field(10.0, gt=0, description="Wall-time limit of one sandboxed call.")
    memory_mb: int = Field(
        1024, ge=64, description="Address-space limit (RLIMIT_AS) of a sandbox worker, in MiB."
    )
    network: Literal["deny", "allow"] = Field(
        "deny",
        description="deny: a new user+network namespace (no interfaces); fails loudly if the "
        "kernel refuses. allow: no network isolation.",
    )
    workers: int = Field(2, gt=0, description="Worker processes, reused across calls.")
    max_processes: int = Field(
        64,
        ge=4,
        description="Processes and threads a worker may have at once, the sandbox's own 3 "
        "included: a pids cgroup for root trainers where one can be made, else RLIMIT_NPROC "
        "(docs/rewards.md: where each is enforced).",
    )
    user: str = Field(
        "",
        description="When the trainer runs as root, workers switch to this user (e.g. 'nobody') "
        "before confining themselves: file permissions then apply, and so does RLIMIT_NPROC. "
        "'' keeps root. Python and the reward modules must be readable by that user.",
    )
    read_only: list[str] = Field(
        default_factory=list,
        description="Extra paths made read-only for reward code (bind mounts in the worker's "
        "mount namespace); the run dir always is.",
    )
    failure_reward: float = Field(
        0.0, description="Reward given to a sample whose call failed (sandboxed or in process)."
    )
    max_failure_frac: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="Stop the run when more than this fraction of a step's sandboxed calls, or "
        "of a batch an in-process function raised on, fail.",
    )


class RolloutConfig(_Section):
    """Where a turn ends, and message-mode rollouts: chat templates, tool calls, limits
    (docs/envs.md)."""

    stop_tokens: list[str] = Field(
        default_factory=list,
        description="Tokens that end a turn, each one token of the tokenizer (e.g. "
        "'<|im_end|>'); empty = derived: the chat template's end-of-turn token, EOS, and the "
        "newline where it is one token.",
    )
    stop_strings: list[str] = Field(
        default_factory=list,
        description="Texts that end a turn: the action is cut after the token whose decoded "
        "text first contains one; empty = derived: '\\n' where the newline is a stop token.",
    )
    tools: list[str] = Field(
        default_factory=list,
        description="Tools offered to the model in message mode: built-in names (calculator, "
        "python) or 'module:attr' import paths of a gyre.rollout.tools.Tool.",
    )
    tool_parser: str = Field(
        "hermes",
        description="How tool calls are read from the model's text (gyre.rollout.tools "
        "PARSERS; hermes: <tool_call>{json}</tool_call>, Qwen's format).",
    )
    stepwise: bool = Field(
        False,
        description="Message mode: every assistant turn is its own training sample whose prompt "
        "is the template's rendering at that turn; turns share their episode's advantage.",
    )
    max_turns: int = Field(
        16, gt=0, description="Message mode: most assistant turns per episode (then truncated)."
    )
    max_tool_calls: int = Field(
        8, ge=0, description="Message mode: most tool calls per episode; later ones get an error."
    )
    max_context_tokens: int = Field(
        0,
        ge=0,
        description="Message mode: an episode whose tokens would pass this ends as truncated "
        "(rollout/truncated_context); 0: no limit.",
    )
    tool_output_chars: int = Field(
        2000, gt=0, description="Longest tool result text given back to the model (cut after)."
    )
    python: SandboxConfig = Field(
        default_factory=lambda: SandboxConfig(timeout_s=5.0, memory_mb=512, workers=1),
        description="Sandbox of the python tool (time, memory, network; gyre.rewards.sandbox).",
    )


class RewardConfig(_Section):
    functions: list[RewardFnConfig] = Field(
        default_factory=list,
        description="Reward functions, each {fn: 'module:function', name, weight, kwargs, "
        "sandbox}; empty uses the env's own reward exactly.",
    )
    env_weight: float = Field(
        1.0, description="Weight of the env's reward (the term 'env') when functions are set."
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig, description="Limits for functions with sandbox: true."
    )


class TelemetryConfig(_Section):
    tensorboard: bool = Field(False, description="Write TensorBoard event files to <run.dir>/tb.")
    prometheus_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve Prometheus metrics on this port (0: any free port); None: no exporter.",
    )
    prometheus_host: str = Field(
        "127.0.0.1", description="Address the Prometheus exporter binds (loopback by default)."
    )
    wandb: bool = Field(False, description="Log to Weights & Biases (needs gyre[wandb]).")
    wandb_project: str = Field("gyre", description="wandb project name.")
    mlflow: bool = Field(False, description="Log to MLflow (needs gyre[mlflow]).")
    mlflow_tracking_uri: str = Field(
        "", description="MLflow tracking URI; empty uses MLflow's default (MLFLOW_TRACKING_URI)."
    )
    samples: float = Field(
        0.0625,
        ge=0.0,
        le=1.0,
        description="Fraction of each step's trajectories written to <run.dir>/samples.jsonl.",
    )

    @field_validator("prometheus_port", mode="before")
    @classmethod
    def _port_off(cls, v: Any) -> Any:
        # 'off', 'none' or 'null' on the command line (or `off` in YAML, read as False) disable it.
        if v is False or (isinstance(v, str) and v.strip().lower() in ("off", "none", "null", "")):
            return None
        return v


class Config(_Section):
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

    @field_validator("run")
    @classmethod
    def _check_run(cls, v: RunConfig) -> RunConfig:
        if v.resume not in ("auto", "never") and not v.resume:
            raise ValueError("run.resume must be 'auto', 'never' or a path")
        return v

    @model_validator(mode="after")
    def _check_stepwise(self) -> Config:
        if self.rollout.stepwise:
            adv = self.train.algo.advantage
            if adv not in ("grpo", "dr_grpo", "rloo"):
                raise ValueError(
                    f"rollout.stepwise needs an outcome estimator (grpo, dr_grpo, rloo); "
                    f"train.algo.advantage={adv} is per token"
                )
            if self.train.dapo.overlong_buffer_len > 0:
                raise ValueError("rollout.stepwise: train.dapo.overlong_buffer_len must be 0")
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


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{'.'.join(parts[: i + 1])}' is not a section")
        node = child
    node[parts[-1]] = value


_YAML11_BOOL_WORDS = {"on", "off", "yes", "no", "y", "n"}


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's SafeLoader, except that a mapping with the same key twice is an error (plain
    PyYAML keeps the last one and silently drops the first block)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: let SafeLoader report it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None,
                    f"duplicate key {key!r} (first on line {first})", key_node.start_mark,
                )  # fmt: skip
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass


def _yaml_error_line(exc: yaml.YAMLError) -> str:
    """A YAML error as one line: what went wrong, and where (line N, column M)."""
    mark = getattr(exc, "problem_mark", None)
    what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{what}"


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{item}' has an empty key")
    if raw.strip().lower() in _YAML11_BOOL_WORDS:
        # YAML 1.1 reads on/off/yes/no as booleans; keep the word so 'log.console=off' works
        # (pydantic still accepts these words for bool fields).
        return key, raw.strip()
    try:
        value = _yaml_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        problem = str(getattr(exc, "problem", "") or "")
        if problem.startswith("duplicate key"):  # not a plain string either: say so
            raise ConfigError(f"override '{key}': {problem}") from None
        value = raw
    if value is None:
        value = raw
    return key, value


def _describe(errors: ValidationError, tree: dict[str, Any]) -> str:
    lines = []
    for err in errors.errors():
        loc = [str(p) for p in err["loc"]]
        if not loc:  # a cross-field check (e.g. the ray section); its message names the fields
            lines.append(err["msg"].removeprefix("Value error, "))
            continue
        key = ".".join(loc)
        node: Any = tree
        for p in loc:
            if isinstance(node, list) and p.isdigit() and int(p) < len(node):
                node = node[int(p)]  # list items, e.g. reward.functions.0.fn
            else:
                node = node.get(p, "<missing>") if isinstance(node, dict) else "<missing>"
        if loc[-1] == "api_key":
            node = REDACTED  # never echo a secret
        if err["type"] == "value_error" and isinstance(node, dict):
            # a section's cross-field check: its message names the keys and values
            lines.append(err["msg"].removeprefix("Value error, "))
            continue
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown config key '{key}' (value {node!r})")
        else:
            lines.append(f"bad value for '{key}': {node!r} ({err['msg']})")
    return "; ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build a :class:`Config` from an optional YAML file plus dotted overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist")
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            line = exc.object[: exc.start].count(b"\n") + 1
            byte = exc.object[exc.start]
            raise ConfigError(
                f"config file '{p}' line {line}: not UTF-8 text (byte 0x{byte:02x})"
            ) from None
        except OSError as exc:
            raise ConfigError(f"config file '{p}' cannot be read: {exc.strerror}") from None
        try:
            loaded = _yaml_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"config file '{p}' is not valid YAML: {_yaml_error_line(exc)}"
            ) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file '{p}' must hold a mapping at the top level")
        tree = loaded
    for item in overrides or []:
        key, value = _parse_override(item)
        _set_dotted(tree, key, value)
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, tree)) from None
    _absolute_file_specs(cfg, [Path(path).resolve().parent] if path is not None else [])
    return cfg


def _absolute_file_specs(cfg: Config, bases: list[Path]) -> None:
    """Make ``file.py:attr`` specs (env.name, reward.functions[*].fn) absolute: relative to the
    config file's folder when the file is there, else to the current directory."""
    from gyre.plugins import PluginError, absolute_spec

    try:
        if ":" in cfg.env.name:
            cfg.env.name = absolute_spec(cfg.env.name, "env.name", bases)
        for i, f in enumerate(cfg.reward.functions):
            f.fn = absolute_spec(f.fn, f"reward.functions.{i}.fn", bases)
    except PluginError as exc:
        raise ConfigError(str(exc)) from None


def resolve_run_dir(cfg: Config) -> Path:
    """Fill in ``run.dir`` when empty (runs/<env>-<timestamp>) and return it as a Path."""
    if not cfg.run.dir:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", cfg.env.name.rpartition(":")[2])
        cfg.run.dir = str(Path("runs") / f"{name}-{stamp}")
    return Path(cfg.run.dir)


def dump_config(cfg: Config) -> str:
    """The config as YAML, secrets written as '***' (see :func:`resolve_api_key`)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def describe_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """One line per leaf field: dotted key, default and description (for ``--help-config``)."""
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(describe_fields(ann, key + "."))
        else:
            default = field.get_default(call_default_factory=True)
            out.append(f"{key} = {default!r}  # {field.description}")
    return out
