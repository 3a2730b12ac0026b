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

from gyre.config.base import (
    SEED_LIMIT,
    THREADS_PER_CORE,
    Section,
)
from gyre.config.rewards import SandboxConfig

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
        description="A Hugging Face model: a local folder, or a hub id (org/name) resolved "
        "through the local hub cache (HF_HUB_OFFLINE=1: the cache only; online: downloaded as "
        "transformers does). A causal LM, or an image-text-to-text VLM (its config.json has a "
        "vision_config: docs/vision.md). A GGUF file is imported first with gyre import. Empty "
        "builds the tiny default.",
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
        "Needs an outcome or turn estimator (train.algo.advantage).",
    )
    keep_opening: bool = Field(
        True,
        description="With rollout.history_turns: the episode's opening observation (the task) "
        "stays at the head of every turn's prompt (a chat's system messages always do).",
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
