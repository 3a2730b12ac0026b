"""The settings of the ecosystem env adapters: gymnasium and reasoning-gym (docs/envs.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gyre.config.base import SEED_LIMIT, Section

# The built-in text renderers of gyre.envs.gymnasium_env (a 'module:fn' / 'file.py:fn' path is
# accepted too).
GYM_RENDERERS = ("auto", "frozen_lake", "taxi", "ansi", "ansi_raw", "obs")


class GymnasiumConfig(Section):
    """``env.name=gymnasium``: a registered gymnasium env with a Discrete action space."""

    id: str = Field(
        "FrozenLake-v1", min_length=1, description="The gymnasium env id (gymnasium.make)."
    )
    make_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of gymnasium.make, e.g. {is_slippery: false}; "
        "render_mode is set by the renderer.",
    )
    renderer: str = Field(
        "auto",
        description="How the state becomes text: frozen_lake / taxi (gyre's grid renderers, "
        "agent marked), ansi (the env's render_mode='ansi' text, colour codes removed), "
        "ansi_raw (colour codes kept), obs (str of the observation), 'module:fn' / "
        "'file.py:fn' (fn(env, obs) -> str), or auto (frozen_lake / taxi for those envs, else "
        "ansi where the env has it, else obs).",
    )
    action_names: list[str] = Field(
        default_factory=list,
        description="What the policy writes for action 0, 1, ...; empty = derived (FrozenLake: "
        "left down right up; Taxi: south north east west pickup dropoff; else the indices).",
    )
    max_steps: int = Field(
        0,
        ge=0,
        description="Most turns per episode, wasted ones included; 0 = the env's registered "
        "time limit (FrozenLake 100, Taxi 200).",
    )
    reward: Literal["env", "success"] = Field(
        "env",
        description="env: the env's own reward each step; success: 1.0 on the step that "
        "succeeds, else 0.",
    )
    success_threshold: float = Field(
        0.0,
        description="An episode succeeds when it terminates (not truncated) on a step whose "
        "reward is above this.",
    )
    prompt: str = Field(">", description="Text after every observation, before the action.")
    list_actions: bool = Field(
        True, description="The first observation starts with a line naming the actions."
    )
    random_map_size: int = Field(
        0,
        ge=0,
        description="FrozenLake only: > 0 draws a new map of this side for every seed "
        "(generate_random_map(size, p=random_map_p, seed)), so held-out seeds are unseen maps; "
        "0 keeps make_kwargs' map.",
    )
    random_map_p: float = Field(
        0.8, gt=0.0, le=1.0, description="FrozenLake random maps: probability a cell is frozen."
    )

    @field_validator("renderer")
    @classmethod
    def _renderer(cls, v: str) -> str:
        if v not in GYM_RENDERERS and ":" not in v:
            raise ValueError(
                f"unknown renderer {v!r}; valid: {', '.join(GYM_RENDERERS)}, or 'module:fn'"
            )
        return v

    @field_validator("make_kwargs")
    @classmethod
    def _no_render_mode(cls, v: dict[str, Any]) -> dict[str, Any]:
        if "render_mode" in v:
            raise ValueError(
                "env.gymnasium.make_kwargs.render_mode: chosen by env.gymnasium.renderer; remove it"
            )
        return v

    @field_validator("action_names")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        names = [n.strip().lower() for n in v]
        if any(not n for n in names):
            raise ValueError("action names must be non-empty")
        if len(set(names)) != len(names):
            raise ValueError(f"action names must be distinct (case ignored), got {v}")
        return names


class ReasoningGymConfig(Section):
    """``env.name=reasoning_gym``: a reasoning-gym dataset, scored by its own scorer."""

    dataset: str = Field(
        "basic_arithmetic",
        min_length=1,
        description="The reasoning-gym dataset name (reasoning_gym.create_dataset).",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="The dataset's own settings, passed to create_dataset (e.g. {min_terms: 2}).",
    )
    seed: int = Field(0, ge=0, lt=SEED_LIMIT, description="Seed of the training dataset instance.")
    size: int = Field(1000, gt=0, description="Items in the training dataset instance.")
    eval_seed: int = Field(
        2**31,
        ge=0,
        lt=SEED_LIMIT,
        description="Seed of the held-out instance. reasoning-gym draws item i of a seed-s "
        "instance from Random(s + i), so [eval_seed, eval_seed + eval_size) must not meet "
        "[seed, seed + size).",
    )
    eval_size: int = Field(
        200,
        gt=0,
        description="Items in the held-out instance (held-out seeds 2^31 + i take item i mod "
        "this); items whose question is also a training question are dropped.",
    )
    prompt_template: str = Field(
        "{question}\n",
        description="The prompt; {question} is the item's question.",
    )
    answer_format: Literal["tag", "last_line", "full"] = Field(
        "tag",
        description="How the answer is read from the reply: tag (the text of the last "
        "<answer_tag>...</answer_tag>; none = no answer), last_line (the last non-blank line), "
        "full (the whole reply, stripped).",
    )
    answer_tag: str = Field(
        "answer", min_length=1, description="The tag of answer_format=tag (<answer>...</answer>)."
    )
    messages: bool = Field(
        False,
        description="Speak chat messages (message mode: the prompt is one user message, "
        "rendered by the tokenizer's chat template) instead of raw text.",
    )

    @model_validator(mode="after")
    def _distinct_seeds(self) -> ReasoningGymConfig:
        # reasoning-gym seeds item i of an instance with `seed + i`: two instances share items
        # exactly where their seed ranges overlap.
        if self.eval_seed < self.seed + self.size and self.seed < self.eval_seed + self.eval_size:
            raise ValueError(
                f"env.reasoning_gym: the held-out items (eval_seed={self.eval_seed}, eval_size="
                f"{self.eval_size}) overlap the training items (seed={self.seed}, size="
                f"{self.size}): reasoning-gym draws item i from seed + i, so keep the ranges "
                "[seed, seed + size) and [eval_seed, eval_seed + eval_size) apart"
            )
        if "{question}" not in self.prompt_template:
            raise ValueError("env.reasoning_gym.prompt_template must contain '{question}'")
        return self
