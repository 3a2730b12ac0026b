"""A reasoning-gym dataset as a single-turn env, scored by the dataset's own scorer.

``env.name=reasoning_gym`` with ``env.reasoning_gym.dataset`` (any name
``reasoning_gym.create_dataset`` knows: ``basic_arithmetic``, ``leg_counting``,
``spell_backward``, ...). Needs the ``reasoning-gym`` extra (``pip install
'gyre[reasoning-gym]'``).

**Items and seeds.** Two dataset instances are built once per process:
``create_dataset(name, seed=seed, size=size, **kwargs)`` for training and ``create_dataset(name,
seed=eval_seed, size=eval_size, **kwargs)`` for evaluation. A training seed ``s < 2^31`` plays
training item ``s mod size``; a held-out seed ``2^31 + i`` plays held-out item ``i mod
eval_size``. Held-out items whose question is also a training question are dropped, so no
held-out question is ever trained on (a small procedural space can repeat questions).

**Prompt and answer.** The prompt is ``prompt_template`` with ``{question}`` filled in. The
answer is read from the reply by ``answer_format``: ``tag`` (the text inside the last
``<answer>...</answer>``, reasoning-gym's convention; a reply without one has no answer and
scores 0), ``last_line`` (the last non-blank line) or ``full`` (the whole reply). The reward is
``dataset.score_answer(answer, entry)`` (a float in [0, 1]; partial credit where the dataset
gives it); ``success`` is a score of 1.0. ``info["task"]`` carries ``answer`` and the item's
``question`` for reward functions.

**Message mode** (``messages: true``): the prompt is one ``user`` message, rendered by the
tokenizer's chat template (docs/envs.md); the reply is read the same way.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gyre.config.adapters import ReasoningGymConfig
from gyre.errors import InputError

MISSING = (
    "env.name=reasoning_gym needs the reasoning-gym package: pip install 'gyre[reasoning-gym]'"
)
EVAL_SEED_BASE = 2**31  # gyre.rollout.evaluate.EVAL_SEED_BASE (not imported: envs stay light)


def extract_answer(reply: str, answer_format: str, tag: str = "answer") -> str | None:
    """The answer text of ``reply`` under ``answer_format`` (module docstring), or None."""
    if answer_format == "tag":
        found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", reply, re.DOTALL)
        return found[-1].strip() if found else None
    if answer_format == "last_line":
        lines = [line for line in reply.splitlines() if line.strip()]
        return lines[-1].strip() if lines else None
    return reply.strip()


@dataclass
class Items:
    """The two dataset instances and their items, shared by every env of the process."""

    train: Any
    held_out: Any
    train_items: list[dict[str, Any]]
    eval_items: list[dict[str, Any]]
    dropped: int  # held-out items dropped because their question is a training question


def load_items(cfg: ReasoningGymConfig) -> Items:
    try:
        import reasoning_gym
    except ImportError:
        raise InputError(MISSING) from None
    where = f"env.reasoning_gym.dataset={cfg.dataset!r}"
    try:
        train = reasoning_gym.create_dataset(
            cfg.dataset, seed=cfg.seed, size=cfg.size, **cfg.kwargs
        )
        held = reasoning_gym.create_dataset(
            cfg.dataset, seed=cfg.eval_seed, size=cfg.eval_size, **cfg.kwargs
        )
    except (ValueError, TypeError, AssertionError) as exc:
        raise InputError(f"{where} with env.reasoning_gym.kwargs={cfg.kwargs}: {exc}") from None
    train_items = [train[i] for i in range(cfg.size)]
    seen = {item["question"] for item in train_items}
    eval_all = [held[i] for i in range(cfg.eval_size)]
    eval_items = [item for item in eval_all if item["question"] not in seen]
    if not eval_items:
        raise InputError(
            f"{where}: every one of the {cfg.eval_size} held-out questions is also a training "
            "question; use a larger task space (env.reasoning_gym.kwargs) or a smaller size"
        )
    return Items(train, held, train_items, eval_items, len(eval_all) - len(eval_items))


class _ReasoningGymBase:
    """One reasoning-gym item per episode (see the module docstring)."""

    def __init__(self, cfg: ReasoningGymConfig, items: Items) -> None:
        self.cfg = cfg
        self.items = items
        self.entry: dict[str, Any] | None = None
        self.dataset: Any = None
        self.done = True

    def pick(self, seed: int) -> tuple[Any, dict[str, Any]]:
        """The dataset instance and item a seed plays."""
        if seed >= EVAL_SEED_BASE:
            held = self.items.eval_items
            return self.items.held_out, held[(seed - EVAL_SEED_BASE) % len(held)]
        return self.items.train, self.items.train_items[seed % len(self.items.train_items)]

    def prompt(self, seed: int) -> str:
        self.dataset, self.entry = self.pick(seed)
        self.done = False
        return self.cfg.prompt_template.replace("{question}", self.entry["question"])

    def reset(self, seed: int) -> Any:
        return self.prompt(seed)

    def score(self, reply: str) -> tuple[float, dict[str, Any]]:
        if self.done or self.entry is None:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self.done = True
        answer = extract_answer(reply, self.cfg.answer_format, self.cfg.answer_tag)
        score = float(self.dataset.score_answer(answer, self.entry)) if answer is not None else 0.0
        task = {"answer": str(self.entry["answer"]), "question": self.entry["question"]}
        info = {"success": score >= 1.0, "moves": 1, "malformed": answer is None, "task": task}
        return score, info


class ReasoningGymEnv(_ReasoningGymBase):
    """The raw-text env; it demonstrates (the reference answer) for SFT."""

    def step(self, action: str) -> tuple[Any, float, bool, dict[str, Any]]:
        score, info = self.score(action)
        return "", score, True, info

    def expert_action(self, rng: np.random.Generator) -> str:
        assert self.entry is not None
        answer = str(self.entry["answer"])
        if self.cfg.answer_format == "tag":
            return f"<{self.cfg.answer_tag}>{answer}</{self.cfg.answer_tag}>"
        return answer

    def random_action(self, rng: np.random.Generator) -> str:
        """Another training item's answer: well-formed, usually wrong."""
        other = self.items.train_items[int(rng.integers(len(self.items.train_items)))]
        if self.cfg.answer_format == "tag":
            return f"<{self.cfg.answer_tag}>{other['answer']}</{self.cfg.answer_tag}>"
        return str(other["answer"])


class ReasoningGymMessageEnv(_ReasoningGymBase):
    """The same env in message mode: the prompt is one user message. It has no demonstrator:
    gyre's SFT demonstrations are raw text, so ``sft.steps`` must be 0 (the run says so)."""

    message_mode = True

    def reset(self, seed: int) -> Any:
        return [{"role": "user", "content": self.prompt(seed)}]

    def step(self, action: str) -> tuple[Any, float, bool, dict[str, Any]]:
        score, info = self.score(action)
        return [], score, True, info


def reasoning_gym_factory(cfg: ReasoningGymConfig) -> Callable[[], _ReasoningGymBase]:
    """Build both instances once (shared by every episode of the process), then envs."""
    items = load_items(cfg)
    cls = ReasoningGymMessageEnv if cfg.messages else ReasoningGymEnv
    return lambda: cls(cfg, items)
