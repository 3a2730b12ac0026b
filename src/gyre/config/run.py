"""The run, model, environment and rollout sections."""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from gyre.config.adapters import GymnasiumConfig, ReasoningGymConfig
from gyre.config.base import (
    SEED_LIMIT,
    THREADS_PER_CORE,
    Section,
)
from gyre.config.rewards import SandboxConfig
from gyre.config.visual import MiniGridConfig, VisualMazeConfig

_DEVICE_RE = re.compile(r"^(cpu|auto|mps|cuda(:\d+)?)$")


class RunConfig(Section):
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


class LoraConfig(Section):
    rank: int = Field(8, gt=0, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is scaled by alpha/r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] | str = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names to adapt (peft target_modules), or 'all-linear'.",
    )


class TinyVlmConfig(Section):
    hidden_size: int = Field(64, gt=0, description="Tiny VLM: the language model's width.")
    num_layers: int = Field(2, gt=0, description="Tiny VLM: the language model's layers.")
    num_heads: int = Field(4, gt=0, description="Tiny VLM: attention heads.")
    num_kv_heads: int = Field(2, gt=0, description="Tiny VLM: key/value heads (GQA).")
    intermediate_size: int = Field(128, gt=0, description="Tiny VLM: the language model's MLP.")
    patch_size: int = Field(
        0,
        ge=0,
        le=64,
        description="Tiny Qwen-VL: the vision tower's patch side in pixels (2x2 patches merge "
        "into one image token); 0: the kind's own (qwen2_5_vl 8, qwen3_vl 16). With qwen3_vl, "
        "8 and env.visual_maze.cell_px=16 make one image token per maze cell.",
    )
    vision_hidden_size: int = Field(
        0,
        ge=0,
        le=1024,
        description="Tiny Qwen-VL: the vision tower's width (its MLP twice that; heads: "
        "max(2, width / 32)); 0: the built-in 32.",
    )
    position_grid: int = Field(
        0,
        ge=0,
        le=64,
        description="Tiny Qwen3-VL: side of the tower's learned position-embedding grid, "
        "interpolated to each image's patch grid; 0: the built-in 8. A grid the size of the "
        "images' patch grid gives each patch its own embedding (160-px images, 16-px "
        "patches: 10).",
    )

    @model_validator(mode="after")
    def _check_heads(self) -> TinyVlmConfig:
        # M-RoPE splits each head's rotary half into (t, h, w) sections: a width of 4k pairs.
        if self.hidden_size % (8 * self.num_heads) or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.tiny_vlm: hidden_size={self.hidden_size} must be a multiple of 8 x "
                f"num_heads={self.num_heads}, and num_heads of num_kv_heads={self.num_kv_heads}"
            )
        if self.patch_size and (self.patch_size < 2 or self.patch_size % 2):
            raise ValueError(
                f"model.tiny_vlm.patch_size must be 0 (the kind's own) or an even size >= 2, "
                f"got {self.patch_size}"
            )
        return self


class ModelConfig(Section):
    path: str = Field(
        "",
        description="Local Hugging Face folder: a causal LM, or an image-text-to-text VLM (its "
        "config.json has a vision_config: docs/vision.md); empty builds the tiny default.",
    )
    kind: Literal["text", "qwen2_5_vl", "qwen3_vl", "idefics3"] = Field(
        "text",
        description="Tiny default (model.path empty): text = the Llama + character tokenizer; "
        "qwen2_5_vl / qwen3_vl / idefics3 = a tiny vision-language model "
        "(gyre.models.vision_build).",
    )
    freeze_vision: bool = Field(
        True,
        description="VLMs: the vision tower and projector get no gradient (LoRA never adapts "
        "them either).",
    )
    hidden_size: int = Field(128, gt=0, description="Tiny default: hidden width.")
    num_layers: int = Field(4, gt=0, description="Tiny default: transformer layers.")
    num_heads: int = Field(4, gt=0, description="Tiny default: attention heads.")
    intermediate_size: int = Field(384, gt=0, description="Tiny default: MLP width.")
    max_positions: int = Field(1024, gt=0, description="Tiny default: longest context in tokens.")
    tiny_vlm: TinyVlmConfig = Field(
        default_factory=TinyVlmConfig,
        description="The language model of the tiny VLM default (model.kind other than text; "
        "its vision tower is fixed): docs/vision.md.",
    )
    lora: LoraConfig | None = Field(
        None, description="LoRA adapter training (peft); null trains every weight."
    )

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        # The tiny default's attention splits hidden_size into num_heads heads of an even width
        # (rotary embeddings rotate pairs); HF would refuse it later with a traceback.
        if self.path and self.kind != "text":
            raise ValueError(
                f"model.kind={self.kind!r} builds a tiny default and cannot be combined with "
                f"model.path (the folder's config.json says what it is; add model.kind=text "
                "to load a folder from a config that sets model.kind)"
            )
        if not self.path and self.hidden_size % (2 * self.num_heads):
            raise ValueError(
                f"model.hidden_size={self.hidden_size} must be a multiple of 2 x "
                f"model.num_heads={self.num_heads} (each head's width must be even)"
            )
        return self


DemonstratorName = Literal["shortest", "greedy", "lookahead", "careful"]  # gyre.envs.maze's


class MazeConfig(Section):
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
        "exits",
        description="compass: grid once, then neighbours + goal offset; exits: grid once, then "
        "the open moves + goal offset; window: a local square; grid: the whole grid every turn.",
    )
    view: int = Field(
        2,
        ge=1,
        description="View radius: compass cells within this many moves; exits looks 1 or 2"
        " moves ahead; window half-width.",
    )
    demonstrator: DemonstratorName = Field(
        "careful",
        description="SFT demonstrator: shortest = a move along a shortest path (solves every "
        "maze); greedy = the legal move that brings the agent closest to the goal (never bumps, "
        "but ignores dead ends and visited cells); lookahead = greedy, but a neighbour that is a "
        "dead end (nothing open beyond it) only when every move is one; careful = lookahead, "
        "then an unvisited cell before a visited one.",
    )
    demonstrator_mix: dict[DemonstratorName, float] = Field(
        default_factory=dict,
        description="A mixed teacher: each turn's move is drawn from these demonstrators with "
        "these probabilities (summing to at most 1), the rest of the time `demonstrator`'s, e.g. "
        "{careful: 0.35} with demonstrator=greedy. SFT on it learns both rules, the more likely "
        "one as its greedy move; GRPO can then find which is worth more.",
    )
    bump_feedback: bool = Field(
        False,
        description="After a move into a wall, the next view starts with '!' (the move was "
        "blocked), as a text adventure says so; the move still costs one of the budget.",
    )
    closer_mark: bool = Field(
        False,
        description="exits: a '*' after the cell of each open move that brings the agent nearer "
        "the goal (Manhattan), as the goal offset says.",
    )
    noise_moves: Literal["uniform", "dead_end"] = Field(
        "uniform",
        description="SFT noise moves (sft.noise): uniform over u/d/l/r, or dead_end: into a "
        "neighbouring dead end when there is one (masked, as every noise move), so that the "
        "teacher's way back out is trained.",
    )
    exit_order: Literal["udlr", "nearest"] = Field(
        "udlr",
        description="exits: the open moves in the order u, d, l, r, or nearest (the move whose "
        "cell is nearest the goal first; ties u, d, l, r).",
    )
    offset_letters: Literal["udlr", "nswe"] = Field(
        "udlr",
        description="The goal offset's letters: udlr (u2r0, the move letters) or nswe (N2E0, "
        "compass letters, so no move letter appears outside the open moves).",
    )

    @model_validator(mode="after")
    def _check_reachable(self) -> MazeConfig:
        for name, p in self.demonstrator_mix.items():
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"env.maze.demonstrator_mix.{name}={p} must lie in [0, 1]")
        if sum(self.demonstrator_mix.values()) > 1.0 + 1e-9:
            raise ValueError(
                f"env.maze.demonstrator_mix={self.demonstrator_mix} sums to more than 1"
            )
        far = 2 * (self.size - 1)
        if self.min_distance > far:
            raise ValueError(
                f"env.maze.min_distance={self.min_distance} cannot be drawn in a maze of "
                f"env.maze.size={self.size}: corner to corner is {far} moves"
            )
        return self


class ArithmeticConfig(Section):
    max_operand: int = Field(99, gt=0, description="Operands are drawn from [0, max_operand].")
    ops: str = Field("+-", min_length=1, description="Operators to draw from, e.g. '+-*'.")


class DatasetConfig(Section):
    path: str = Field(
        "",
        description='Tasks: a JSONL file, one task a line ({"prompt": ..., "answer": ..., ...}), '
        "a JSON, Parquet or Arrow file, or a folder saved by datasets' save_to_disk.",
    )
    format: Literal["auto", "jsonl", "json", "parquet", "arrow"] = Field(
        "auto",
        description="auto: by extension. .jsonl: gyre's own reader (errors name file:line); "
        ".json, .parquet, .arrow or a save_to_disk folder: Hugging Face datasets.",
    )
    prompt_field: str = Field(
        "prompt",
        min_length=1,
        description="Row key holding the prompt: text, or a list of chat messages (TRL's "
        "conversational format; such a dataset runs in message mode).",
    )
    answer_field: str = Field(
        "answer", min_length=1, description="Row key holding the reference answer."
    )
    eval_rows: int = Field(
        0, ge=0, description="Last N rows are held out for evaluation; 0 evaluates on all rows."
    )
    messages: bool = Field(
        False,
        description="Message mode for text prompts too: each becomes one user message, "
        "rendered with the tokenizer's chat template.",
    )


BUILTIN_ENVS = (
    "maze",
    "arithmetic",
    "dataset",
    "gymnasium",
    "reasoning_gym",
    "visual_maze",
    "minigrid",
)


class EnvConfig(Section):
    name: str = Field(
        "maze",
        description="A built-in env (maze, arithmetic, dataset, gymnasium, reasoning_gym, "
        "visual_maze, minigrid), a name given to gyre.envs.register, an import path "
        "'module:Class' or a file path 'envs.py:Class' "
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
        default_factory=DatasetConfig,
        description="Prompt-dataset (JSONL / JSON / Parquet / Arrow) settings.",
    )
    gymnasium: GymnasiumConfig = Field(
        default_factory=GymnasiumConfig, description="gymnasium adapter settings."
    )
    reasoning_gym: ReasoningGymConfig = Field(
        default_factory=ReasoningGymConfig, description="reasoning-gym adapter settings."
    )
    visual_maze: VisualMazeConfig = Field(
        default_factory=VisualMazeConfig,
        description="Visual maze rendering (the maze itself is env.maze.*).",
    )
    minigrid: MiniGridConfig = Field(
        default_factory=MiniGridConfig, description="MiniGrid adapter settings."
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


class RolloutConfig(Section):
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
    history_turns: int | None = Field(
        None,
        ge=0,
        description="Bounded history (gyre.rollout.window): each turn's prompt holds the "
        "opening observation, the last N exchanges and the current observation, and every "
        "turn is its own training sample; 0: memoryless; null (or 'all'): the whole episode. "
        "Unset with env.name=maze: 0 (the maze default's memoryless policy) where the advantages "
        "allow a window (an outcome or turn estimator).",
    )
    keep_opening: bool = Field(
        True,
        description="With rollout.history_turns: the episode's opening observation (the task) "
        "stays at the head of every turn's prompt (a chat's system messages always do). Unset "
        "with env.name=maze: false.",
    )

    @field_validator("history_turns", mode="before")
    @classmethod
    def _whole_episode(cls, v: Any) -> Any:
        """``rollout.history_turns=all`` (or ``null``) on the command line: the whole episode."""
        return None if isinstance(v, str) and v.strip().lower() in ("all", "null", "none") else v

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
