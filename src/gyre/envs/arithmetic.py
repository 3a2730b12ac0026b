"""Single-turn arithmetic: a verifiable task that is just a one-step env.

Observation ``"37+45="``; the policy writes the answer (``"82"``); reward 1.0 iff the integer it
wrote equals the true result (whitespace ignored), else 0.0. The episode always ends after one step.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np


@functools.lru_cache(maxsize=4096)
def _task(seed: int, max_operand: int, ops: str) -> tuple[int, str, int]:
    """The task of ``seed`` (a pure function of it; cached: a GRPO group resets G envs with
    the same seed, and a numpy generator costs more to build than the rest of a step's env
    work)."""
    rng = np.random.default_rng(seed)
    a, b = (int(x) for x in rng.integers(0, max_operand + 1, size=2))
    return a, ops[int(rng.integers(len(ops)))], b


class ArithmeticEnv:
    def __init__(self, max_operand: int = 99, ops: str = "+-") -> None:
        bad = set(ops) - set("+-*")
        if bad:
            raise ValueError(f"arithmetic ops may only contain '+-*', got {ops!r}")
        self.max_operand = max_operand
        self.ops = ops
        self.answer = 0
        self.done = True

    def reset(self, seed: int) -> str:
        a, op, b = _task(seed, self.max_operand, self.ops)
        self.answer = a + b if op == "+" else a - b if op == "-" else a * b
        self.done = False
        return f"{a}{op}{b}="

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self.done = True
        try:
            ok = int(action.strip()) == self.answer
        except ValueError:
            ok = False
        # "task" carries the reference to reward functions (gyre.rewards) as the column `answer`.
        info = {"success": ok, "moves": 1, "malformed": False, "task": {"answer": str(self.answer)}}
        return "", (1.0 if ok else 0.0), True, info

    def expert_action(self, rng: np.random.Generator) -> str:
        return str(self.answer)

    def random_action(self, rng: np.random.Generator) -> str:
        return str(self.answer + int(rng.integers(-9, 10)) or 1)
