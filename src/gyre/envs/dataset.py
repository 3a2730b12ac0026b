"""A prompt dataset as a single-turn env: real tasks loaded from a JSONL file.

Each non-blank line of the file is one JSON object with at least a prompt and a reference
answer (field names configurable)::

    {"prompt": "Tom has 3 apples and buys 4 more. How many apples? Answer: ", "answer": "7"}

The prompt may also be a list of chat messages, as in TRL's conversational datasets::

    {"prompt": [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "3 + 4?"}], "answer": "7"}

Such a dataset (or any dataset with ``env.dataset.messages: true``, which makes each text prompt
one user message) is a message-mode env: the rollout renders the prompt with the tokenizer's chat
template and the reply ends at its end-of-turn token (docs/envs.md).

Every other key of the row is task metadata: it is handed to reward functions as a column of
the same name (see ``gyre.rewards``). The policy sees the prompt text verbatim and answers in one
turn. The env's own reward is a strict check, 1.0 iff the stripped answer text equals the
stripped reference; richer checking (``math-verify``, a reward model) is a reward function.

Seeds map to rows: training seeds (``< 2^31``) pick from the first ``len(rows) - eval_rows``
rows, held-out seeds (``2^31 + i``) from the last ``eval_rows`` rows (all rows when
``eval_rows == 0``, so evaluation then measures training tasks — say so when reporting it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gyre.errors import InputError

# Held-out seeds start here (gyre.rollout.evaluate.EVAL_SEED_BASE; not imported, to keep envs
# light).
EVAL_SEED_BASE = 2**31


ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Task:
    """One dataset row: the prompt (text, or chat messages), the reference answer (as text) and
    the other fields."""

    prompt: str | list[dict[str, Any]]
    answer: str
    meta: dict[str, Any]
    line: int


def load_jsonl_tasks(
    path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer"
) -> list[Task]:
    """Read and validate every row; a malformed row raises ``InputError`` (a ValueError)
    naming file:line."""
    p = Path(path)
    if not str(path):
        raise InputError("env.dataset.path is empty; set it to a JSONL file of tasks")
    if not p.is_file():
        raise InputError(f"env.dataset.path '{p}' does not exist")
    tasks: list[Task] = []
    with p.open("rb") as fh:  # bytes, so an undecodable row is named by its line
        for lineno, raw_bytes in enumerate(fh, start=1):
            where = f"{p}:{lineno}"
            try:
                raw = raw_bytes.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(
                    f"{where}: not UTF-8 text (byte 0x{raw_bytes[exc.start]:02x} at column "
                    f"{exc.start + 1})"
                ) from None
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise InputError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise InputError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
            tasks.append(task_from_row(row, where, lineno, prompt_field, answer_field))
    if not tasks:
        raise InputError(f"env.dataset.path '{p}' holds no rows")
    return tasks


def task_from_row(
    row: dict[str, Any], where: str, line: int, prompt_field: str, answer_field: str
) -> Task:
    """One validated task; ``where`` (``file:line`` or ``file[row i]``) starts every error."""
    for key in (prompt_field, answer_field):
        if key not in row:
            raise InputError(f"{where}: missing field '{key}' (row keys: {sorted(row)})")
    prompt, answer = row[prompt_field], row[answer_field]
    if isinstance(prompt, list):
        prompt = chat_prompt(prompt, where, prompt_field)
    elif not isinstance(prompt, str) or not prompt:
        raise InputError(
            f"{where}: field '{prompt_field}' must be a non-empty string or a list of chat messages"
        )
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise InputError(
            f"{where}: field '{answer_field}' must be a string or a number, "
            f"got {type(answer).__name__}"
        )
    meta = {k: v for k, v in row.items() if k != prompt_field}
    meta[answer_field] = str(answer)
    return Task(prompt, str(answer), meta, line)


def chat_prompt(value: list[Any], where: str, field: str) -> list[dict[str, Any]]:
    """A conversational prompt, validated: ``{"role", "content"}`` messages (other keys with a
    value, such as a tool message's ``name``, are kept; the ``None`` that a columnar file puts
    in keys only other rows have are dropped). It must not end with the assistant's message."""
    if not value:
        raise InputError(f"{where}: field '{field}' is an empty list of messages")
    out = []
    for j, m in enumerate(value):
        at = f"{where}: {field}[{j}]"
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InputError(f"{at} must be a message {{'role': ..., 'content': ...}}, got {m!r}")
        if m["role"] not in ROLES:
            raise InputError(f"{at}.role is {m['role']!r}; valid: {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise InputError(f"{at}.content must be a string, got {type(m['content']).__name__}")
        out.append({k: v for k, v in m.items() if v is not None})
    if out[-1]["role"] == "assistant":
        raise InputError(
            f"{where}: the last message of '{field}' is the assistant's; a prompt ends with the "
            "message the model answers"
        )
    return out


def message_tasks(tasks: list[Task], messages: bool, source: str) -> bool:
    """Whether the dataset is a message-mode env: every prompt is a message list, or
    ``messages`` asks for it. A mix of text and message prompts is refused, naming the row."""
    chat = [isinstance(t.prompt, list) for t in tasks]
    if any(chat) and not all(chat):
        odd = tasks[chat.index(not chat[0])]
        kinds = ("text", "a message list") if chat[0] else ("a message list", "text")
        raise InputError(
            f"{source}:{odd.line}: the prompt is {kinds[0]}, but the first row's is {kinds[1]}; "
            "a dataset's prompts are all text or all chat messages"
        )
    return messages or all(chat)


class DatasetEnv:
    """One-step env over a shared list of tasks (see the module docstring)."""

    def __init__(self, tasks: list[Task], eval_rows: int = 0, source: str = "") -> None:
        if eval_rows >= len(tasks):
            raise InputError(
                f"env.dataset.eval_rows={eval_rows} leaves no training rows "
                f"({len(tasks)} rows in {source or 'the dataset'})"
            )
        self.tasks = tasks
        self.eval_rows = eval_rows
        self.task: Task | None = None
        self.done = True

    def row_index(self, seed: int) -> int:
        n_train = len(self.tasks) - self.eval_rows
        if seed >= EVAL_SEED_BASE:
            if self.eval_rows == 0:
                return (seed - EVAL_SEED_BASE) % len(self.tasks)
            return n_train + (seed - EVAL_SEED_BASE) % self.eval_rows
        return seed % n_train

    def reset(self, seed: int) -> Any:
        self.task = self.tasks[self.row_index(seed)]
        self.done = False
        return self.task.prompt

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.done or self.task is None:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self.done = True
        ok = action.strip() == self.task.answer.strip()
        info = {"success": ok, "moves": 1, "malformed": False, "task": dict(self.task.meta)}
        return "", (1.0 if ok else 0.0), True, info

    def expert_action(self, rng: np.random.Generator) -> str:
        assert self.task is not None
        return self.task.answer

    def random_action(self, rng: np.random.Generator) -> str:
        """Another row's answer: well-formed, usually wrong."""
        return self.tasks[int(rng.integers(len(self.tasks)))].answer


class DatasetMessageEnv(DatasetEnv):
    """The dataset in message mode: the prompt is its messages (a text prompt: one user
    message). The demonstrator (the reference answer) serves message-mode SFT."""

    message_mode = True

    def reset(self, seed: int) -> Any:
        prompt = super().reset(seed)
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return [dict(m) for m in prompt]

    def step(self, action: str) -> tuple[Any, float, bool, dict[str, Any]]:
        _, reward, done, info = super().step(action)
        return [], reward, done, info
